"""Binding a generator's optional hooks to the contract written in ``default_func.HOOKS``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import default_func
from default_func import HOOKS, HookSpec

HookFn = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Hooks:
    """The six hooks of one task, each callable with the full argument list of its spec."""

    filter_item: HookFn = default_func.filter_item
    is_valid_group: HookFn = default_func.is_valid_group
    normalize_group_data: HookFn = default_func.normalize_group_data
    pad_group_data: HookFn = default_func.pad_group_data
    get_group_data_meta_info: HookFn = default_func.get_group_data_meta_info
    transform_group: HookFn = default_func.transform_group
    overridden: frozenset[str] = field(default_factory=frozenset)


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
    return Hooks(**bound, overridden=frozenset(bound))


def _keep(*_: Any) -> bool:
    return True


def _unchanged(group: Any, *_: Any) -> Any:
    return group


#: The ``hooks_source`` a task configured with ``EVALUATION_HOOKS`` is journaled under
#: (not a possible generator file name, so it never shadows one).
EVALUATION_SOURCE = ":evaluation"

#: An evaluation keeps every finished group as the generator wrote it (no filter, no
#: normalisation, no padding), so the trainer scores the raw rewards of every sample.
EVALUATION_HOOKS = Hooks(
    filter_item=_keep,
    is_valid_group=_keep,
    normalize_group_data=_unchanged,
    pad_group_data=_unchanged,
    transform_group=_unchanged,
    overridden=frozenset({"filter_item", "is_valid_group", "normalize_group_data", "pad_group_data"}),
)
