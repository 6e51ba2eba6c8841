"""What an abort costs on the simulator: a request is charged its latency times the part of the
whole reply it sampled, so an aborted reply and its continuation take the time of one reply."""

from __future__ import annotations

import time
from typing import Any, cast

import httpx
import pytest

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.control import Control
from buffer.simulator.front import SimApp
from buffer.simulator.tokenizer import build_tokenizer

pytestmark = pytest.mark.anyio


def approx(seconds: float) -> Any:
    return pytest.approx(seconds, abs=1e-9)


TOKENIZER = build_tokenizer()
QUESTION = [{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}]
PROMPT = cast(
    list[int], TOKENIZER.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
)


class Asleep(Control):
    """The pause state, without the sleeping: the tests read what is charged, not the clock."""

    async def sleep(self, seconds: float) -> bool:
        return False


def app_with(latency_s: float, **overrides: Any) -> tuple[SimApp, list[float]]:
    """A simulator, and the latency each of its requests is charged (not slept)."""
    options: dict[str, Any] = {"seed": 0, "accuracy": 1.0, **overrides}
    app = create_sim_app(SimConfig(latency_mean_s=latency_s, **options))
    simulator = app.state.simulator
    simulator.control = Asleep()
    charged: list[float] = []
    latency_of = simulator.latency_of

    def recorded(answer: Any, stream: bool) -> float:
        charged.append(latency_of(answer, stream))
        return charged[-1]

    simulator.latency_of = recorded
    return app, charged


async def generate(app: SimApp, route: str, prompt: list[int], **params: Any) -> tuple[list[int], str]:
    """(output ids, finish reason) of a token prompt on ``/generate`` or ``/v1/completions``."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        if route == "/generate":
            body: dict[str, Any] = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200, **params}}
            answer = (await client.post(route, json=body)).json()
            return answer["output_ids"], answer["meta_info"]["finish_reason"]["type"]
        body = {"prompt": prompt, "max_tokens": 200, "return_token_ids": True, **params}
        [choice] = (await client.post(route, json=body)).json()["choices"]
        return choice["token_ids"], choice["finish_reason"]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
async def test_an_aborted_reply_and_its_continuation_are_charged_one_reply_s_latency(route: str) -> None:
    whole_app, whole_charged = app_with(1.0)
    whole, _ = await generate(whole_app, route, PROMPT)
    limit: dict[str, Any] = {"max_new_tokens": 5} if route == "/generate" else {"max_tokens": 5}
    _, finish_reason = await generate(whole_app, route, PROMPT, **limit)
    assert finish_reason == "length"
    # A reply from the start that is not aborted: the whole latency.
    assert whole_charged == [approx(1.0), approx(1.0)]
    for seed in range(5):
        aborted_app, aborted_charged = app_with(1.0, abort_rate=1.0, seed=seed)
        partial, finish_reason = await generate(aborted_app, route, PROMPT)
        assert finish_reason == "abort"
        continued_app, continued_charged = app_with(1.0)
        rest, _ = await generate(continued_app, route, PROMPT + partial)
        assert partial + rest == whole
        assert aborted_charged == [approx(len(partial) / len(whole))]
        assert continued_charged == [approx(len(rest) / len(whole))]
        assert aborted_charged[0] + continued_charged[0] == approx(1.0)


async def test_a_chat_reply_continued_from_its_text_is_charged_the_rest_of_the_reply() -> None:
    aborted_app, aborted_charged = app_with(1.0, abort_rate=1.0)
    continued_app, continued_charged = app_with(1.0)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=aborted_app), base_url="http://sim"
    ) as client:
        body = {"messages": QUESTION, "return_token_ids": True}
        [aborted] = (await client.post("/v1/chat/completions", json=body)).json()["choices"]
    assert aborted["finish_reason"] == "abort"
    messages = [*QUESTION, {"role": "assistant", "content": aborted["message"]["content"]}]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=continued_app), base_url="http://sim"
    ) as client:
        body = {"messages": messages, "continue_final_message": True, "return_token_ids": True}
        [continued] = (await client.post("/v1/chat/completions", json=body)).json()["choices"]
    whole = len(aborted["token_ids"]) + len(continued["token_ids"])
    assert aborted_charged == [approx(len(aborted["token_ids"]) / whole)]
    assert continued_charged == [approx(len(continued["token_ids"]) / whole)]


async def test_on_the_clock_an_aborted_reply_and_its_continuation_take_about_one_latency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    latency_s = 0.6
    slept: list[float] = []
    sleep = Control.sleep

    async def recorded(control: Control, seconds: float) -> bool:
        slept.append(seconds)
        return await sleep(control, seconds)

    monkeypatch.setattr(Control, "sleep", recorded)
    aborted_app = create_sim_app(SimConfig(latency_mean_s=latency_s, seed=0, accuracy=1.0, abort_rate=1.0))
    continued_app = create_sim_app(SimConfig(latency_mean_s=latency_s, seed=0, accuracy=1.0))
    started = time.monotonic()
    partial, finish_reason = await generate(aborted_app, "/generate", PROMPT)
    assert finish_reason == "abort"
    _, finish_reason = await generate(continued_app, "/generate", PROMPT + partial)
    assert finish_reason == "stop"
    elapsed_s = time.monotonic() - started
    # Each request sleeps its charge less the time it took to compose: together at most one
    # latency, not two (1.2 s) as when every request took the whole of it ...
    assert len(slept) == 2
    assert sum(slept) <= latency_s + 1e-9
    # ... and it is slept: the clock only bounds it below, where a busy machine cannot move it.
    assert elapsed_s >= latency_s * 0.95
