"""A policy version on every generated token, and MoE routed experts, through aborts continued
across a weight update (issue 24, items 2, 3 and 7).

The simulator aborts answers (``abort_rate``) and reports SGLang's initial version "default";
after each of its ``/generate`` answers the gate moves on one version, as a pause, a weight update
and a resume at the next version would: each continued part is sampled under its own version.
"""

from __future__ import annotations

import base64
from array import array
from typing import Any

import httpx
import pytest

from buffer.core.hooks import Hooks
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.policy import Gate, Policy, PolicyError
from buffer.policy.gate import recording
from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.experts import expert
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.llm import ChatClient, ContinuePolicy, EngineClient
from buffer.toolkit.parts import continued
from buffer.toolkit.records import turn_records
from buffer.toolkit.stamp import stamp
from buffer.toolkit.tito import TokenClient, TokenRenderer
from buffer.toolkit.types import Completion, TokenCapture
from tests.support.factories import group

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
LAYERS, TOPK = 2, 3


def updating_engine(gate: Gate, *, experts: bool = False) -> Any:
    """The simulator, with the gate's version moved on after each of its token route answers."""
    sim = create_sim_app(
        SimConfig(
            engine="sglang",
            latency_mean_s=0.0,
            abort_rate=0.6,
            accuracy=1.0,
            seed=5,
            routed_experts=f"{LAYERS},{TOPK}" if experts else None,
        )
    )

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await sim(scope, receive, send)
        if scope["type"] == "http" and scope["path"] == "/generate":
            gate.version = (gate.version or 0) + 1

    return app


def token_client(gate: Gate, *, experts: bool = False) -> EngineClient:
    client = TokenClient(
        "http://sim",
        TokenRenderer(build_tokenizer()),
        engine="sglang",
        model="sim-model",
        continuation=ContinuePolicy(delay_s=0, max_continuations=50),
        transport=httpx.ASGITransport(app=updating_engine(gate, experts=experts)),
        routed_experts=experts,
    )
    client.gate = gate
    return client


def chat_client(gate: Gate) -> EngineClient:
    client = ChatClient(
        "http://sim",
        engine="sglang",
        model="sim-model",
        continuation=ContinuePolicy(delay_s=0, max_continuations=50),
        transport=httpx.ASGITransport(app=updating_engine(gate)),
    )
    client.gate = gate
    return client


async def continued_answers(client: EngineClient, count: int = 8) -> list[Completion]:
    """Answers until one was continued (the simulator's aborts are seeded): all of them."""
    completions = []
    async with client:
        for seed in range(count):
            completions.append(await client.complete(QUESTION, max_tokens=256, seed=seed))
    assert any(c.continuations for c in completions), "some answers were aborted and continued"
    return completions


def expand(runs: list[list[Any]]) -> list[Any]:
    return [version for version, count in runs for _ in range(count)]


@pytest.mark.parametrize("make", [token_client, chat_client], ids=["token mode", "chat mode"])
async def test_each_token_carries_the_version_it_was_sampled_under_across_updates(make: Any) -> None:
    gate = Gate()  # no version yet: the trainer has not said one
    recorded = recording()
    completions = await continued_answers(make(gate))
    for completion in completions:
        tokens = completion.tokens
        assert tokens is not None
        assert tokens.weight_versions is not None
        per_token = expand(tokens.weight_versions)
        assert len(per_token) == len(tokens.output_ids)
        assert per_token == sorted(per_token), "later parts, later versions"
        if completion.continuations:
            assert len(set(per_token)) > 1, "a part after an update is told apart from the one before"
    first = completions[0].tokens
    assert first is not None
    assert first.weight_versions is not None
    assert first.weight_versions[0][0] == 0, "sampled before the trainer's first version: 0, not none"
    assert recorded[0] == 0, "the gate records 0 for a request made before any version"


async def test_a_trajectory_keeps_its_runs_and_its_oldest_version_is_what_staleness_reads() -> None:
    gate = Gate()
    versions = recording()
    completions = await continued_answers(token_client(gate))
    at = next(i for i, c in enumerate(completions) if c.continuations)
    aborted, before = completions[at], sum(c.attempts for c in completions[:at])
    messages = [*QUESTION, aborted.message()]
    trajectory: dict[str, Any] = {"messages": messages, "turns": turn_records(messages, [aborted])}
    stamp(trajectory, [aborted], versions[before : before + aborted.attempts])
    turn = trajectory["turns"][0]
    assert turn["weight_versions"] == aborted.tokens.weight_versions  # type: ignore[union-attr]
    runs = turn["weight_versions"]
    info = trajectory["extra_info"]
    assert (info["policy_version_min"], info["policy_version_max"]) == (runs[0][0], runs[-1][0])


def test_runs_join_across_parts_and_a_re_rendered_part_starts_over() -> None:
    first = TokenCapture([1, 2], [3, 4], None, weight_versions=[[0, 2]])
    second = TokenCapture([1, 2, 3, 4], [5], None, weight_versions=[[1, 1]])
    record, extended = continued(first, second)
    assert extended
    assert record.weight_versions == [[0, 2], [1, 1]]
    same = TokenCapture([1, 2, 3, 4, 5], [6, 7], None, weight_versions=[[1, 2]])
    assert continued(record, same)[0].weight_versions == [[0, 2], [1, 3]]
    unknown = TokenCapture([1, 2, 3, 4], [5], None)  # no engine version, no gate
    assert continued(first, unknown)[0].weight_versions == [[0, 2], [None, 1]]
    rerendered = TokenCapture([9, 9], [5], None, weight_versions=[[2, 1]])
    assert continued(first, rerendered) == (rerendered, False)


def test_an_unversioned_trajectory_gets_the_service_version_and_goes_stale() -> None:
    buffer = RolloutBuffer()
    buffer.configure_task("math", TaskSettings(group_size=2, max_staleness=1), Hooks())
    buffer.write_many([{**item, "task_type": "math"} for item in group("q", [0.0, 1.0])])  # version 0
    buffer.policy.set_version(2)
    assert buffer.read("math", None).groups == []
    assert buffer.policy.stale["math"] == 1, "made before any POST /policy, at version 0: 2 behind"
    buffer.write_many([{**item, "task_type": "math"} for item in group("r", [0.0, 1.0])])  # version 2
    assert [ready.instance_id for ready in buffer.read("math", None).groups] == ["r"]


def test_a_refused_resume_stays_paused_and_says_why() -> None:
    policy = Policy()
    policy.set_version(3)
    policy.pause("abort")
    with pytest.raises(PolicyError):
        policy.resume(2)
    assert policy.gate.paused
    assert "lower than the current version 3" in str(policy.snapshot()["resume_refused"])
    policy.resume(4)
    assert not policy.gate.paused
    assert policy.snapshot()["resume_refused"] is None


async def test_routed_experts_are_captured_per_request_and_cover_every_token_but_the_last() -> None:
    gate = Gate()
    completions = await continued_answers(token_client(gate, experts=True))
    for completion in completions:
        tokens = completion.tokens
        assert tokens is not None
        assert tokens.routed_experts
        assert len(tokens.routed_experts) == 1 + completion.continuations  # one segment per request
        last = tokens.routed_experts[-1]
        sequence = [*tokens.prompt_ids, *tokens.output_ids]
        assert (last["start"], last["rows"]) == (0, len(sequence) - 1)
        values = array("i", base64.b64decode(last["data"])).tolist()
        want = [expert(t, layer, k) for t in sequence[:-1] for layer in range(LAYERS) for k in range(TOPK)]
        assert values == want


async def test_routed_experts_are_asked_for_only_when_the_task_wants_them() -> None:
    bodies: list[bytes] = []

    def engine(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, 7, None]]}
        return httpx.Response(200, json={"text": "x", "output_ids": [7], "meta_info": meta})

    renderer = TokenRenderer(build_tokenizer())
    for wanted in (False, True):
        client = TokenClient(
            "http://sim", renderer, transport=httpx.MockTransport(engine), routed_experts=wanted
        )
        async with client:
            completion = await client.complete(QUESTION, max_tokens=4)
        assert (b'"return_routed_experts":true' in bodies[-1]) is wanted
        assert completion.tokens is not None
        assert completion.tokens.routed_experts is None


def test_versions_that_are_no_number_are_left_out_of_the_bounds_not_compared() -> None:
    """An engine's initial ``"default"`` and a gate's None say no version: the bounds come from
    the numbers, strings of one included, and a run nobody versioned takes its request's."""
    completion = Completion("hi", "stop", attempts=2)
    trajectory: dict[str, Any] = {
        "turns": [{"output_ids": [1, 2, 3], "weight_versions": [["default", 1], [None, 1], ["3", 1]]}]
    }
    stamp(trajectory, [completion], [None, 2])  # type: ignore[list-item]
    info = trajectory["extra_info"]
    assert (info["policy_version_min"], info["policy_version_max"]) == (2, 3)
    assert trajectory["turns"][0]["weight_versions"][1] == [2, 1]
