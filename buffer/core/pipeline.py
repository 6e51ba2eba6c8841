"""The read pipeline: what becomes of a group once it has finished.

``process_group`` runs the task's hooks over one finished group and returns an outcome:
``Ready`` (the final items, encoded once, for reads to hand out as they are), ``Discarded``
(with the reason) or ``SetAside`` (a hook raised or broke the contract; kept for inspection).
It never raises on account of a hook.

Hooks that read only a trajectory's small fields (the defaults, and an evaluation's: see
``reads_small_fields``) get items of those fields alone (``hook_item``): its messages and
token records stay the bytes they were written as, and the final items are the small fields
encoded again with those bytes after them. Hooks a generator defines see whole items.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any

from buffer import encoding
from buffer.core.hooks import EVALUATION_HOOKS, Hooks
from default_func import HOOKS

REQUIRED_KEYS = ("uid", "instance_id", "messages", "reward", "extra_info")

# Why a group was discarded; each is counted and reported.
INVALID_GROUP = "invalid_group"
TOO_FEW_VALID_ITEMS = "too_few_valid_items"
TIMEOUT_TOO_SMALL = "timeout_too_small"
TOO_LARGE_TO_PAD = "too_large_to_pad"

#: The most copies padding may add to a group: a client sets the group size, and padding a few
#: items to a huge one would make copies the buffer keeps and a read hands out (a group that
#: needs more is discarded as ``too_large_to_pad``).
MAX_PAD_ITEMS = 4096


@dataclass(frozen=True, slots=True)
class GroupRules:
    """The settings of a task that decide a group's fate."""

    group_size: int
    min_valid_group_size_ratio: float = 1.0
    min_valid_item_size_ratio: float = 0.7


@dataclass(slots=True)
class Ready:
    items: list[bytes]
    #: The raw rewards of the items that are no padded copy, for the statistics of the reads
    #: that serve the group (``served_rewards``); None: not known (a replayed outcome).
    rewards: tuple[float, ...] | None = None


@dataclass(slots=True)
class Discarded:
    reason: str


@dataclass(slots=True)
class SetAside:
    hook: str
    error: str
    traceback: str = ""


Outcome = Ready | Discarded | SetAside


#: The hooks a group goes through, in order (``get_group_data_meta_info`` reads the window).
PIPELINE_HOOKS = (
    "is_valid_group",
    "filter_item",
    "normalize_group_data",
    "pad_group_data",
    "transform_group",
)
#: For each, the functions known to read no more of an item than its small fields (the
#: default ``filter_item`` checks that ``messages`` is a list, which validation ensured).
_SMALL_FIELD_HOOKS = {name: {HOOKS[name].default, getattr(EVALUATION_HOOKS, name)} for name in PIPELINE_HOOKS}
#: Where a small-fields item keeps the trajectory it came from: (raw, head). Not a string, so
#: no JSON key can be it; ``{**item}`` and ``dict(item)`` (a padded copy) keep it.
_SOURCE = object()
#: The ``messages`` of a small-fields item: a list, as validation ensured the real ones are.
_ELIDED: list[Any] = []


def reads_small_fields(hooks: Hooks) -> bool:
    """Whether every hook of the pipeline reads only the small fields of an item
    (``encoding.BULKY`` aside): then the hooks get ``hook_item``s of those alone."""
    return all(getattr(hooks, name) in _SMALL_FIELD_HOOKS[name] for name in PIPELINE_HOOKS)


def hook_item(raw: bytes, head: int) -> dict[str, Any]:
    """The item the hooks get of a trajectory: its small fields alone where ``head`` says
    where they end (``encoding.dumps_parted``), else the whole trajectory decoded."""
    if not head:
        return encoding.loads(raw)  # type: ignore[no-any-return]
    item = encoding.small_fields(raw, head)
    item["messages"] = _ELIDED
    item[_SOURCE] = (raw, head)  # type: ignore[index]
    return item


def encode_item(item: dict[str, Any]) -> bytes:
    """A final item's JSON: a small-fields item's fields joined to the bytes it came from."""
    source = item.pop(_SOURCE, None)  # type: ignore[call-overload]
    if source is None:
        return encoding.dumps(item)
    if item.get("messages") is _ELIDED:
        del item["messages"]
    raw, head = source
    return encoding.with_small_fields(item, raw, head)


class _HookBroke(Exception):
    def __init__(self, hook: str, error: str, tb: str = "") -> None:
        super().__init__(error)
        self.hook, self.error, self.tb = hook, error, tb


def process_group(
    task_type: str,
    instance_id: Any,
    items: list[dict[str, Any]],
    rules: GroupRules,
    hooks: Hooks,
    *,
    timed_out: bool = False,
) -> Outcome:
    """Run ``is_valid_group``, ``filter_item``, ``normalize_group_data``, ``pad_group_data`` and
    ``transform_group`` over a finished group of ``rules.group_size`` items (fewer when it
    timed out)."""
    try:
        return _process(task_type, instance_id, items, rules, hooks, timed_out)
    except _HookBroke as exc:
        return SetAside(exc.hook, exc.error, exc.tb)


def _process(
    task_type: str,
    instance_id: Any,
    items: list[dict[str, Any]],
    rules: GroupRules,
    hooks: Hooks,
    timed_out: bool,
) -> Outcome:
    size = rules.group_size
    min_valid_group_size = int(rules.min_valid_group_size_ratio * size)
    if timed_out:
        # A timed-out group is as complete as it will get: judge its quality, not its size.
        min_valid_group_size = min(min_valid_group_size, len(items))
    verdict = _call(
        "is_valid_group", hooks.is_valid_group, (instance_id, items), min_valid_group_size, task_type
    )
    if not _is_valid(verdict):
        return Discarded(INVALID_GROUP)

    kept = [item for item in items if _call("filter_item", hooks.filter_item, item, task_type)]
    if len(kept) < max(1, int(rules.min_valid_item_size_ratio * size)):
        return Discarded(TOO_FEW_VALID_ITEMS)

    group = _group(
        "normalize_group_data", _call("normalize_group_data", hooks.normalize_group_data, (instance_id, kept))
    )
    if size - len(group[1]) > MAX_PAD_ITEMS:
        return Discarded(TOO_LARGE_TO_PAD)
    group = _group("pad_group_data", _call("pad_group_data", hooks.pad_group_data, group, size))
    group = _group("transform_group", _call("transform_group", hooks.transform_group, group, task_type))
    final = group[1]
    if len(final) != size:
        raise _HookBroke(
            "pad_group_data", f"the group has {len(final)} items after the hooks, expected {size}"
        )
    _check_items(final)
    _give_distinct_uids(final)
    try:
        return Ready([encode_item(item) for item in final], served_rewards(final))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise _HookBroke("transform_group", f"an item cannot be encoded as JSON: {exc}") from exc


def served_rewards(items: list[dict[str, Any]]) -> tuple[float, ...]:
    """The raw reward (``raw_reward``, else ``reward``) of each item that is not a padded copy
    (``extra_info.padded_from``): what a read's ``served`` statistics average."""
    rewards = []
    for item in items:
        extra_info = item.get("extra_info")
        if isinstance(extra_info, dict) and "padded_from" in extra_info:
            continue
        reward = item.get("raw_reward", item.get("reward"))
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            rewards.append(float(reward))
    return tuple(rewards)


def _call(name: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise _HookBroke(name, f"{type(exc).__name__}: {exc}", traceback.format_exc()) from exc


def _is_valid(verdict: Any) -> bool:
    """``is_valid_group`` returns a bool today and ``(is_valid, is_finished)`` in older slime."""
    if isinstance(verdict, bool):
        return verdict
    if isinstance(verdict, tuple) and len(verdict) == 2:
        return bool(verdict[0])
    raise _HookBroke("is_valid_group", f"returned {verdict!r}; expected a bool or (is_valid, is_finished)")


def _group(hook: str, value: Any) -> tuple[Any, list[dict[str, Any]]]:
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and isinstance(value[1], list)
        and all(isinstance(item, dict) for item in value[1])
    ):
        return value[0], value[1]
    raise _HookBroke(hook, f"returned {type(value).__name__}; expected (instance_id, [item dicts])")


def _check_items(items: list[dict[str, Any]]) -> None:
    for index, item in enumerate(items):
        missing = [key for key in REQUIRED_KEYS if key not in item]
        if missing:
            raise _HookBroke("transform_group", f"item {index} lacks {', '.join(missing)}")
        reward = item["reward"]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise _HookBroke(
                "normalize_group_data", f"item {index} has reward {reward!r}, not a finite number"
            )


def _give_distinct_uids(items: list[dict[str, Any]]) -> None:
    """A trainer keys samples by uid: repeated uids (a custom pad hook's copies) get a suffix."""
    seen: set[Any] = set()
    objects: set[int] = set()
    for index, item in enumerate(items):
        if id(item) in objects:  # the same dict placed twice, e.g. ``items * 2``
            items[index] = item = dict(item)
        objects.add(id(item))
        uid = item["uid"]
        copy = 0
        while uid in seen:
            copy += 1
            uid = f"{item['uid']}-dup{copy}"
        seen.add(uid)
        item["uid"] = uid
