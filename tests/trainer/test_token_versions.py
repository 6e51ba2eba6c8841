"""Per-token policy versions and routed experts on the trainer's side (issue 24, items 2 and 7):
an off-policy mask over a sample's response, and slime's ``Sample`` (the stand-in in
tests/support/slime_stub) with ``rollout_routed_experts`` and the loss mask slime's
``--mask-offpolicy-in-partial-rollout`` asks for.

The trajectory is made against the simulator, an answer aborted and continued across weight
updates (tests/toolkit/test_token_versions.py), so the records are the toolkit's own.
"""

from __future__ import annotations

import asyncio
import base64
import sys
from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from buffer.policy import Gate
from buffer.policy.gate import recording
from buffer.simulator.experts import expert
from buffer.toolkit.records import turn_records
from buffer.toolkit.stamp import stamp
from buffer.trainer.samples import samples_from_turns
from buffer.trainer.samples.experts import layout
from tests.support.paths import SLIME_STUB
from tests.toolkit.test_token_versions import LAYERS, QUESTION, TOPK, continued_answers, token_client

sys.path.insert(0, str(SLIME_STUB))

from buffer.trainer import slime_samples


def continued_trajectory(*, experts: bool) -> dict[str, Any]:
    """A trajectory of one answer continued across updates, as the runner writes it."""

    async def run() -> dict[str, Any]:
        versions = recording()
        completions = await continued_answers(token_client(Gate(), experts=experts))
        at = next(i for i, c in enumerate(completions) if c.continuations)
        answer, before = completions[at], sum(c.attempts for c in completions[:at])
        messages = [*QUESTION, answer.message()]
        trajectory = {
            "uid": "u",
            "instance_id": "q",
            "messages": messages,
            "reward": 1.0,
            "extra_info": {},
            "turns": turn_records(messages, [answer]),
        }
        stamp(trajectory, [answer], versions[before : before + answer.attempts])
        return trajectory

    return asyncio.run(run())


def test_the_off_policy_mask_covers_the_tokens_sampled_before_the_newest_version() -> None:
    trajectory = continued_trajectory(experts=False)
    runs = trajectory["turns"][0]["weight_versions"]
    assert len(runs) > 1, "the answer was sampled under several versions"
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    assert sample.token_versions == [version for version, count in runs for _ in range(count)]
    newest = runs[-1][0]
    off = sample.off_policy_mask()
    assert sum(off) == sample.response_length - runs[-1][1]
    assert off == [int(v < newest) for v in sample.token_versions]
    assert sample.off_policy_mask(runs[0][0]) == [0] * sample.response_length  # none older than the oldest
    assert sample.on_policy_loss_mask() == [1 - o for o in off]


def test_routed_experts_of_a_continued_answer_reach_slimes_sample_with_the_masked_loss() -> None:
    trajectory = continued_trajectory(experts=True)
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    args = SimpleNamespace(
        mask_offpolicy_in_partial_rollout=True,
        num_layers=LAYERS,
        moe_router_topk=TOPK,
        advantage_estimator="grpo",
    )
    builder = slime_samples.SampleBuilder(args)
    counts = slime_samples.StepCounts()
    (entry,) = builder.group([slime_samples.Converted(trajectory, [sample])], counts) or []
    experts = entry.rollout_routed_experts
    assert len(experts) == len(entry.tokens) - 1
    assert experts == [
        [[expert(token, layer, k) for k in range(TOPK)] for layer in range(LAYERS)]
        for token in entry.tokens[:-1]
    ]
    assert entry.loss_mask == sample.on_policy_loss_mask() != sample.loss_mask
    assert counts.off_policy_tokens == sum(sample.off_policy_mask()) > 0


def test_without_the_flag_slimes_loss_mask_is_left_whole() -> None:
    trajectory = continued_trajectory(experts=False)
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    builder = slime_samples.SampleBuilder(SimpleNamespace(advantage_estimator="grpo"))
    (entry,) = (
        builder.group([slime_samples.Converted(trajectory, [sample])], slime_samples.StepCounts()) or []
    )
    assert entry.loss_mask == sample.loss_mask
    assert entry.rollout_routed_experts is None


def ints(values: list[int]) -> str:
    return base64.b64encode(array("i", values).tobytes()).decode()


@pytest.mark.parametrize(
    ("segments", "laid"),
    [
        ([(0, 2, [1, 2, 3, 4])], [1, 2, 3, 4]),
        ([(0, 1, [1, 2]), (0, 2, [5, 6, 7, 8])], [5, 6, 7, 8]),  # a continuation covers it all again
        ([(0, 1, [1, 2]), (1, 1, [7, 8])], [1, 2, 7, 8]),  # SGLang's start_len: only the new rows
        ([(1, 1, [7, 8])], None),  # row 0 missing: no experts rather than zeros
    ],
)
def test_segments_are_laid_out_by_their_start(segments: list[Any], laid: list[int] | None) -> None:
    parts = [(start, rows, base64.b64decode(ints(values))) for start, rows, values in segments]
    raw = layout(parts, 2)
    assert (None if raw is None else array("i", raw).tolist()) == laid
