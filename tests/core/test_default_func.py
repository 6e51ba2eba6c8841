"""The default hooks: slime's behaviour, with its two defects fixed."""

from __future__ import annotations

import inspect
import math
import random
import re

import pytest

import default_func
from buffer.core.hook_guard import GuardedHook, guard_hooks
from buffer.core.hooks import EVALUATION_HOOKS, Hooks, bind_hooks
from buffer.core.stats import RewardStats
from default_func import HOOKS
from tests.support.factories import group, trajectory
from tests.support.paths import REPO


def test_every_hook_in_the_spec_has_a_matching_default_and_a_field_on_hooks() -> None:
    assert set(HOOKS) == {name for name in Hooks.__dataclass_fields__ if name != "overridden"}
    for name, spec in HOOKS.items():
        assert spec.name == name
        assert spec.default is getattr(default_func, name)
        assert getattr(Hooks(), name) is spec.default
        # The default takes every argument the buffer passes.
        inspect.signature(spec.default).bind(*spec.params)


def test_the_generators_guide_lists_exactly_the_hooks_of_the_contract() -> None:
    guide = (REPO / "docs" / "generators.md").read_text()
    listed = re.search(r"`default_func\.py` is the hook contract: it lists the hooks \(([^)]*)\)", guide)
    assert listed is not None, "docs/generators.md names the hooks of default_func.HOOKS"
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(HOOKS)


def test_every_hook_a_generator_overrides_runs_under_the_time_limit() -> None:
    def stand_in(*args: object) -> object:
        return args[0]

    hooks = bind_hooks(dict.fromkeys(HOOKS, stand_in))
    assert hooks.overridden == set(HOOKS)
    guarded = guard_hooks(hooks, limit_s=1.0)
    assert {name for name in HOOKS if isinstance(getattr(guarded, name), GuardedHook)} == set(HOOKS)
    assert guard_hooks(Hooks(), limit_s=1.0) == Hooks()  # the defaults are the buffer's own: run directly


def test_an_evaluation_keeps_every_item_and_reports_the_hooks_it_replaces() -> None:
    items = [trajectory(reward=-1.0), trajectory(reward=0.5)]
    assert all(EVALUATION_HOOKS.filter_item(item, "eval") for item in items)
    assert EVALUATION_HOOKS.overridden == {
        name for name in HOOKS if getattr(EVALUATION_HOOKS, name) is not HOOKS[name].default
    }


@pytest.mark.parametrize(
    ("reward", "kept"),
    [
        (0, True),
        (1, True),
        (0.5, True),
        (-1, False),
        (1.5, False),
        (float("nan"), False),
        ("0.5", False),
        (True, False),
    ],
)
def test_filter_item_keeps_rewards_in_the_unit_interval(reward: object, kept: bool) -> None:
    assert default_func.filter_item(trajectory(reward=reward), "math") is kept


def test_filter_item_drops_a_trajectory_left_aborted_and_keeps_one_continued_to_its_end() -> None:
    assert not default_func.filter_item(trajectory(extra_info={"finish_reason": "abort"}), "math")
    assert default_func.filter_item(
        trajectory(extra_info={"finish_reason": "stop", "continuations": 2}), "math"
    )


def test_filter_item_needs_a_message_list() -> None:
    assert not default_func.filter_item(trajectory(messages="hello"), "math")


def test_is_valid_group_needs_its_size_and_diverse_rewards() -> None:
    assert default_func.is_valid_group(("q", group("q", [0, 1, 0, 1])), 4, "math") == (True, True)
    assert default_func.is_valid_group(("q", group("q", [1, 1, 1, 1])), 4, "math") == (False, True)
    assert default_func.is_valid_group(("q", group("q", [0, 1])), 4, "math") == (False, False)


def test_normalize_is_grpo_over_valid_rewards_and_keeps_raw_reward() -> None:
    items = group("q", [1, 0, 1, 0, -1])
    _, out = default_func.normalize_group_data(("q", items))
    valid = [1, 0, 1, 0]
    mean = sum(valid) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / 4)
    assert [item["raw_reward"] for item in out] == [1, 0, 1, 0, -1]
    assert [item["reward"] for item in out[:4]] == pytest.approx([(r - mean) / (std + 1e-8) for r in valid])
    assert out[4]["reward"] == -1  # an invalid reward passes through


def test_normalize_leaves_all_zero_groups_and_zeroes_constant_ones() -> None:
    _, zeros = default_func.normalize_group_data(("q", group("q", [0, 0, 0])))
    assert [item["reward"] for item in zeros] == [0, 0, 0]
    _, constant = default_func.normalize_group_data(("q", group("q", [0.7, 0.7])))
    assert [item["reward"] for item in constant] == [0.0, 0.0]


def test_normalize_survives_a_group_without_valid_rewards() -> None:
    # slime's default divides by zero here.
    _, out = default_func.normalize_group_data(("q", group("q", [-1, -1])))
    assert [item["reward"] for item in out] == [-1, -1]


def test_pad_matches_slime_arithmetic_and_gives_distinct_uids() -> None:
    items = group("q", [0.6, -0.3, 0.9])
    _, out = default_func.pad_group_data(("q", items), 4)
    assert len(out) == 4
    assert len({item["uid"] for item in out}) == 4
    scale = 4 / 3
    # slime: scale all, then halve the first pad_count originals and their copies.
    assert [item["reward"] for item in out] == pytest.approx(
        [0.6 * scale / 2, -0.3 * scale, 0.9 * scale, 0.6 * scale / 2]
    )
    assert out[3]["extra_info"]["padded_from"] == out[0]["uid"]
    assert "padded_from" not in out[0]["extra_info"]


def test_pad_can_more_than_double_a_group() -> None:
    # slime's default asserts here; a timed-out group with ratio < 0.5 still pads.
    _, out = default_func.pad_group_data(("q", group("q", [0.4, 0.8])), 7)
    assert len(out) == 7
    assert len({item["uid"] for item in out}) == 7
    assert sum(item["reward"] for item in out) == pytest.approx((0.4 + 0.8) * 7 / 2)


def test_default_meta_info_agrees_with_the_incremental_statistics() -> None:
    rng = random.Random(7)
    temp_data = {f"q{i}": group(f"q{i}", [rng.random() for _ in range(rng.randint(1, 6))]) for i in range(20)}
    expected = default_func.get_group_data_meta_info(temp_data)
    stats = RewardStats()
    halves = RewardStats()
    for n, items in enumerate(temp_data.values()):
        for item in items:
            (stats if n % 2 else halves).add(item["reward"])
    merged = stats.merge(halves)
    for key, value in merged.meta_info(len(temp_data)).items():
        assert value == pytest.approx(expected[key]), key


def test_meta_info_of_nothing_is_all_zero() -> None:
    zeros = dict.fromkeys(
        [
            "total_samples",
            "num_groups",
            "avg_group_size",
            "avg_reward",
            "reward_std",
            "reward_min",
            "reward_max",
        ],
        0,
    )
    assert default_func.get_group_data_meta_info({}) == zeros
    assert RewardStats().meta_info(0) == zeros
