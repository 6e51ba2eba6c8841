"""Binding a generator's optional hooks to the contract written in ``default_func.HOOKS``.

``HOOKS`` is the one list of hook names: ``bind_hooks`` checks a generator against it, the
guard (``hook_guard``) and the reports go by it, and ``Hooks`` has one field per entry (its
default is the entry's) so the pipeline calls each hook as a plain attribute; a test keeps the
fields and ``HOOKS`` in step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from default_func import HOOKS, HookSpec

HookFn = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Hooks:
    """The hooks of one task (a field per entry of ``HOOKS``), each callable with the full
    argument list of its spec; ``overridden`` names those that are not the defaults."""

    filter_item: HookFn = HOOKS["filter_item"].default
    is_valid_group: HookFn = HOOKS["is_valid_group"].default
    normalize_group_data: HookFn = HOOKS["normalize_group_data"].default
    pad_group_data: HookFn = HOOKS["pad_group_data"].default
    get_group_data_meta_info: HookFn = HOOKS["get_group_data_meta_info"].default
    transform_group: HookFn = HOOKS["transform_group"].default
    overridden: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def overriding(cls, hooks: Mapping[str, HookFn]) -> Hooks:
        """The defaults, but for ``hooks`` (by name), which are the ones ``overridden``."""
        return cls(**hooks, overridden=frozenset(hooks))


def positional_arity(spec: HookSpec, fn: Any) -> int:
    """How many of the spec's arguments ``fn`` takes; raises ``TypeError`` naming the problem."""
    if not callable(fn):
        raise TypeError(f"{spec.name} must be a function, not {type(fn).__name__}")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"{spec.name} must be a plain function: hooks run synchronously on each group")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return len(spec.params)
    for count in range(len(spec.params), spec.min_params - 1, -1):
        try:
            signature.bind(*spec.params[:count])
        except TypeError:
            continue
        return count
    forms = " or ".join(
        f"({', '.join(spec.params[:n])})" for n in range(len(spec.params), spec.min_params - 1, -1)
    )
    raise TypeError(f"{spec.name}{signature} has the wrong parameters: expected {forms}")


def _adapt(fn: HookFn, count: int, full: int) -> HookFn:
    if count == full:
        return fn

    def call(*args: Any) -> Any:
        return fn(*args[:count])

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def bind_hooks(namespace: Mapping[str, Any]) -> Hooks:
    """The hooks a generator module's namespace defines, defaults for the rest.

    Raises ``TypeError`` listing every hook with the wrong parameters.
    """
    bound: dict[str, HookFn] = {}
    problems: list[str] = []
    for name, spec in HOOKS.items():
        if name not in namespace:
            continue
        fn = namespace[name]
        try:
            bound[name] = _adapt(fn, positional_arity(spec, fn), len(spec.params))
        except TypeError as exc:
            problems.append(str(exc))
    if problems:
        raise TypeError("; ".join(problems))
    return Hooks.overriding(bound)


def _keep(*_: Any) -> bool:
    return True


def _unchanged(group: Any, *_: Any) -> Any:
    return group


#: The ``hooks_source`` a task configured with ``EVALUATION_HOOKS`` is journaled under
#: (not a possible generator file name, so it never shadows one).
EVALUATION_SOURCE = ":evaluation"

#: An evaluation keeps every finished group as the generator wrote it (no filter, no
#: normalisation, no padding), so the trainer scores the raw rewards of every sample.
EVALUATION_HOOKS = Hooks.overriding(
    {
        "filter_item": _keep,
        "is_valid_group": _keep,
        "normalize_group_data": _unchanged,
        "pad_group_data": _unchanged,
    }
)
