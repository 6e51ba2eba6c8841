"""Legacy completions under a session: an unmodified ``openai`` SDK agent calling
``client.completions.create`` (plain, streamed, ``n=2``, a retry), each call recorded token-exact
and chained by its prompt's ids, against the simulator in-process (its vLLM and its SGLang)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from buffer.service.gateway.service import GatewayConfig
from buffer.simulator.app import create_sim_app
from buffer.simulator.config import SimConfig
from buffer.simulator.tokenizer import build_tokenizer
from buffer.trainer.samples.turns import samples_from_turns
from tests.support.calls import wait_for
from tests.support.gateway import HeldEngine, open_session, proxied_to, sdk, session_trajectories

pytestmark = pytest.mark.timeout(60)
ENGINE = "http://engine.test"
PROMPT = "Question: What is 2 + 3?\nAnswer:"
IDS = {"return_token_ids": True}  # the agent asks for the ids too: to compare them with the record


def serving(
    make_client: Any, engine: str, tokenizer_path: str | None = None
) -> tuple[TestClient, HeldEngine]:
    """The service, its gateway sending to the simulator in-process (``engine``'s dialect)."""
    config = SimConfig(
        engine=engine,  # type: ignore[arg-type]
        served_model_name="policy",
        latency_mean_s=0.0,
        seed=0,
        accuracy=1.0,
        tokenizer_path=tokenizer_path,
    )
    simulator = HeldEngine(create_sim_app(config))
    return proxied_to(make_client(group_size=2), engine, simulator), simulator


def end(client: TestClient, session: dict[str, Any]) -> dict[str, Any]:
    ended = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    assert ended.status_code == 200, ended.text
    data: dict[str, Any] = ended.json()["data"]
    return data


def text_of(stream: Any) -> tuple[str, str | None, list[int] | None]:
    """A streamed completion's text, finish reason and (asked for) token ids, as an agent reads them."""
    text, finish, ids = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
            ids = (choice.model_extra or {}).get("token_ids") or ids
    return text, finish, ids


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_sdk_completions_agent_is_one_chain_trained_on_exactly_what_the_engine_saw(
    make_client: Any, engine: str, stream: bool
) -> None:
    client, simulator = serving(make_client, engine)
    session = open_session(client, ENGINE)
    agent = sdk(client, session)
    first = agent.completions.create(model="policy", prompt=PROMPT, max_tokens=24, extra_body=IDS)
    choice = first.choices[0]
    prompt_ids, output_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    follow_up = PROMPT + choice.text + "\nQuestion: And 4 * 5?\nAnswer:"
    if stream:
        text, finish, _ = text_of(
            agent.completions.create(model="policy", prompt=follow_up, max_tokens=24, stream=True)
        )
    else:
        second = agent.completions.create(model="policy", prompt=follow_up, max_tokens=24)
        text, finish = second.choices[0].text, second.choices[0].finish_reason
        assert second.choices[0].logprobs is None  # the capture's logprobs are not the agent's
        assert "token_ids" not in (second.choices[0].model_extra or {})
    assert text
    assert finish == "length"
    sent = simulator.bodies[-1]
    assert (sent["return_token_ids"], sent["logprobs"], sent["stream"]) == (True, 0, False)
    assert end(client, session)["uids"] == [f"session-{session['session_id']}"]

    (trajectory,) = session_trajectories(client, "q1")
    first_turn, second_turn = trajectory["turns"]
    assert (first_turn["prompt_ids"], first_turn["output_ids"]) == (prompt_ids, output_ids)
    assert second_turn["prompt_ids"][: len(prompt_ids) + len(output_ids)] == prompt_ids + output_ids
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant", "user", "assistant"]
    assert trajectory["messages"][0]["content"] == PROMPT
    assert trajectory["messages"][2]["content"] == "\nQuestion: And 4 * 5?\nAnswer:"  # past what it held
    assert trajectory["messages"][3]["content"] == text
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    assert sample.tokens == second_turn["prompt_ids"] + second_turn["output_ids"]
    observation = len(second_turn["prompt_ids"]) - len(prompt_ids) - len(output_ids)
    assert sample.loss_mask == [1] * len(output_ids) + [0] * observation + [1] * len(
        second_turn["output_ids"]
    )
    assert all(len(t["output_logprobs"]) == len(t["output_ids"]) for t in trajectory["turns"])
    if engine == "sglang":  # SGLang says which weights sampled it
        assert first_turn["weight_version"] is not None


def test_n_2_records_every_choice_each_a_chain_of_its_own(make_client: Any) -> None:
    client, _ = serving(make_client, "vllm")
    session = open_session(client, ENGINE)
    answer = sdk(client, session).completions.create(
        model="policy", prompt=PROMPT, max_tokens=16, n=2, temperature=1.0, logprobs=1
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.logprobs is not None and c.logprobs.token_logprobs for c in answer.choices)  # it asked
    uids = end(client, session)["uids"]
    assert uids == [f"session-{session['session_id']}", f"session-{session['session_id']}-chain-1"]
    trajectories = session_trajectories(client, "q1", "q1#chain-1")
    texts = sorted(t["messages"][-1]["content"] for t in trajectories)
    assert texts == sorted(c.text for c in answer.choices)
    for trajectory in trajectories:
        (turn,) = trajectory["turns"]
        assert turn["sampling"]["n"] == 2
        (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
        assert sample.tokens == turn["prompt_ids"] + turn["output_ids"]


def test_an_sdk_retry_is_answered_from_the_record_and_recorded_once(make_client: Any) -> None:
    client, simulator = serving(make_client, "vllm")
    session = open_session(client, ENGINE)
    agent = sdk(client, session)
    first = agent.completions.create(model="policy", prompt=PROMPT, max_tokens=16)
    # what the SDK sends again after a timeout: the same body, its retry counted
    retried = agent.completions.create(
        model="policy", prompt=PROMPT, max_tokens=16, extra_headers={"x-stainless-retry-count": "1"}
    )
    assert retried.choices[0].text == first.choices[0].text
    assert retried.usage == first.usage
    assert len(simulator.bodies) == 1
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 1


def test_the_session_s_sampling_is_what_the_engine_gets_and_is_recorded(make_client: Any) -> None:
    client, simulator = serving(make_client, "vllm")
    pins = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    session = open_session(client, ENGINE, sampling=pins)
    sdk(client, session).completions.create(model="policy", prompt=PROMPT, temperature=0.7, max_tokens=100)
    sent = simulator.bodies[-1]
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (1.0, 1.0, 8)
    end(client, session)
    (trajectory,) = session_trajectories(client, "q1")
    (turn,) = trajectory["turns"]
    assert (turn["sampling"]["temperature"], turn["sampling"]["max_tokens"]) == (1.0, 8)
    assert turn["sampling_asked"] == {"temperature": 0.7, "top_p": None, "max_tokens": 100}
    assert len(turn["output_ids"]) <= 8


def test_what_cannot_be_served_is_refused_naming_the_field(make_client: Any) -> None:
    client, simulator = serving(make_client, "vllm")
    agent = sdk(client, open_session(client, ENGINE))
    for request, field in (
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": [PROMPT, "Another"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": PROMPT, "best_of": 3}, "best_of"),
        ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ({"prompt": PROMPT, "n": 0}, "n"),
    ):
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            agent.completions.create(model="policy", **request)
        assert refused.value.body["param"] == field, request
    assert not simulator.bodies
    ids = agent.completions.create(model="policy", prompt=[[5, 6, 7]], max_tokens=4, extra_body=IDS)
    assert ids.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]  # a list of one id list


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_token_mode_sends_the_ids_it_holds_and_extends_them_by_the_text_the_agent_adds(
    make_client: Any, tmp_path: Path, engine: str
) -> None:
    tokenizer = build_tokenizer()
    path = str(tmp_path / "tokenizer")
    tokenizer.save_pretrained(path)
    client, simulator = serving(make_client, engine, path)
    session = open_session(client, ENGINE, token_mode=True, tokenizer_path=path)
    agent = sdk(client, session)
    first = agent.completions.create(model="policy", prompt=PROMPT, max_tokens=12)
    held = simulator.bodies[0]["prompt"]
    assert held == tokenizer.encode(PROMPT)  # the gateway encoded it
    first_turn_output = None
    follow_up = PROMPT + first.choices[0].text + "\nQuestion: And 4 * 5?\nAnswer:"
    agent.completions.create(model="policy", prompt=follow_up, max_tokens=12)
    end(client, session)
    (trajectory,) = session_trajectories(client, "q1")
    first_turn, second_turn = trajectory["turns"]
    first_turn_output = first_turn["output_ids"]
    rest = tokenizer.encode("\nQuestion: And 4 * 5?\nAnswer:", add_special_tokens=False)
    assert simulator.bodies[1]["prompt"] == held + first_turn_output + rest  # never re-tokenised
    assert second_turn["prompt_ids"] == held + first_turn_output + rest
    assert trajectory["extra_info"]["token_mode"] is True
    assert len(samples_from_turns(trajectory, 1.0, 1.0)) == 1


def test_a_completion_its_agent_left_is_cancelled_at_the_engine(make_client: Any) -> None:
    client, simulator = serving(make_client, "vllm")
    gateway = client.app.state.gateway
    gateway.config = GatewayConfig(retry_grace_s=0.0)
    session = gateway.session(open_session(client, ENGINE)["session_id"])
    simulator.held = True

    async def start() -> asyncio.Task[dict[str, Any]]:
        return asyncio.ensure_future(
            gateway.complete(session, {"model": "policy", "prompt": PROMPT}, text=True)
        )

    call = client.portal.call(start)
    try:
        wait_for(lambda: len(simulator.bodies) == 1, 30, "the request at the engine")
        client.portal.call(call.cancel)  # what the route does when the agent disconnects
        wait_for(lambda: simulator.cancelled == 1, 30, "the engine's request cancelled")
    finally:
        client.portal.call(simulator.release)
    assert not session.calls
