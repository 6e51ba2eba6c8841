"""Padding is bounded: a client sets the group size, and a few items padded to a huge one would
make every copy the buffer keeps and a read hands out (issue 22)."""

from __future__ import annotations

import default_func
from buffer.core.hooks import bind_hooks
from buffer.core.pipeline import MAX_PAD_ITEMS, TOO_LARGE_TO_PAD, Discarded, GroupRules, Ready, process_group
from tests.support.factories import group


def test_a_group_that_needs_more_padding_than_the_cap_is_discarded_unpadded() -> None:
    hooks = bind_hooks({"pad_group_data": default_func.pad_group_data})
    rules = GroupRules(group_size=200_000, min_valid_group_size_ratio=0.0, min_valid_item_size_ratio=0.0)
    outcome = process_group("math", "q", group("q", [0.0, 1.0]), rules, hooks, timed_out=True)
    assert outcome == Discarded(TOO_LARGE_TO_PAD)


def test_padding_up_to_the_cap_still_pads() -> None:
    hooks = bind_hooks({"pad_group_data": default_func.pad_group_data})
    size = MAX_PAD_ITEMS + 2
    rules = GroupRules(group_size=size, min_valid_group_size_ratio=0.0, min_valid_item_size_ratio=0.0)
    outcome = process_group("math", "q", group("q", [0.0, 1.0]), rules, hooks, timed_out=True)
    assert isinstance(outcome, Ready)
    assert len(outcome.items) == size
