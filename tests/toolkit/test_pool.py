"""The engine pool: load shared evenly, a group on one engine, a dead engine out and back.

Three stand-in engines are aiohttp servers on loopback, so the client's real transport (aiohttp,
called directly) is what is exercised; each records what it was asked."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from buffer.toolkit.llm import ChatClient, ContinuePolicy, LLMError, RetryPolicy
from buffer.toolkit.pool import EnginePool, group_key, routing_key
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.tito import TokenClient
from buffer.toolkit.transport import ROUTING_KEY_HEADER, Unreachable
from buffer.toolkit.types import Completion, Message
from default_func import FAILURE_REWARD
from tests.support.factories import Collected

pytestmark = pytest.mark.anyio


class StandInEngine:
    """An engine on a fixed loopback port: chat completions and SGLang's ``/generate`` after
    ``latency_s``, ``/health``; ``stop()`` and ``start()`` take it down and bring it back."""

    def __init__(self, latency_s: float = 0.02) -> None:
        self.latency_s = latency_s
        self.asked: list[dict[str, Any]] = []  # {"prompt": ..., "key": routing header}
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(
            {"prompt": body["messages"][-1]["content"], "key": request.headers.get(ROUTING_KEY_HEADER)}
        )
        await asyncio.sleep(self.latency_s)
        answer = {
            "choices": [{"message": {"role": "assistant", "content": "\\boxed{1}"}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 2},
        }
        return web.json_response(answer)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append({"prompt": body["input_ids"], "key": request.headers.get(ROUTING_KEY_HEADER)})
        await asyncio.sleep(self.latency_s)
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]]}
        return web.json_response({"text": "x", "output_ids": [7], "meta_info": meta})


@pytest.fixture
async def engines() -> AsyncIterator[list[StandInEngine]]:
    three = [StandInEngine() for _ in range(3)]
    for engine in three:
        await engine.start()
    yield three
    for engine in three:
        await engine.stop()


def data_set(tmp_path: Path, n: int) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "label": "1"}) + "\n" for i in range(n)))
    return str(path)


def payload(tmp_path: Path, urls: Sequence[str], instances: int, **overrides: Any) -> dict[str, Any]:
    return {
        "task_type": "math",
        "input_file": data_set(tmp_path, instances),
        "remote_engine_url": list(urls),
        "num_repeat_per_sample": 4,
        "num_process": 24,
        "sampling_params": {"max_tokens": 8},
        **overrides,
    }


def one(sample: Any, episode: Any) -> float:
    return 1.0


def groups_per_engine(engines: Sequence[StandInEngine]) -> dict[str, set[int]]:
    """For each prompt (one group: one epoch here), the engines that served it."""
    served: dict[str, set[int]] = {}
    for index, engine in enumerate(engines):
        for asked in engine.asked:
            served.setdefault(str(asked["prompt"]), set()).add(index)
    return served


async def test_a_pool_of_three_shares_the_load_evenly_and_keeps_each_group_on_one_engine(
    engines: list[StandInEngine], tmp_path: Path
) -> None:
    sink = Collected()
    progress = await run_rollouts(
        payload(tmp_path, [e.url for e in engines], instances=90), reward=one, sink=sink
    )
    assert progress.completed == len(sink.trajectories) == 360
    assert progress.failed == 0
    counts = [len(engine.asked) for engine in engines]
    assert sum(counts) == 360
    for count in counts:
        assert abs(count - 120) <= 12, counts  # each within 10% of a third
    served = groups_per_engine(engines)
    assert len(served) == 90
    assert all(len(where) == 1 for where in served.values()), served
    keys = {asked["key"] for engine in engines for asked in engine.asked}
    assert len(keys) == 90  # one routing key per group, sent with every request


async def test_a_router_gets_the_groups_routing_key_in_its_header(tmp_path: Path) -> None:
    router = StandInEngine(latency_s=0.0)
    await router.start()
    try:
        await run_rollouts(payload(tmp_path, [router.url], instances=5), reward=one, sink=Collected())
    finally:
        await router.stop()
    by_prompt: dict[str, set[str]] = {}
    for asked in router.asked:
        by_prompt.setdefault(asked["prompt"], set()).add(asked["key"])
    assert len(by_prompt) == 5
    assert all(len(keys) == 1 and None not in keys for keys in by_prompt.values())
    assert len({key for keys in by_prompt.values() for key in keys}) == 5


async def test_a_dead_engine_is_taken_out_nothing_is_lost_and_it_comes_back_when_healthy(
    engines: list[StandInEngine], tmp_path: Path
) -> None:
    urls = [e.url for e in engines]
    retry = RetryPolicy(max_retry_s=10.0, backoff_s=0.01, max_backoff_s=0.05)
    async with ChatClient(urls, retry=retry, health_interval_s=0.05) as llm:
        sink = Collected()
        run = asyncio.create_task(
            run_rollouts(payload(tmp_path, urls, instances=120), reward=one, sink=sink, llm=llm)
        )
        while len(engines[1].asked) < 10:  # noqa: ASYNC110 (the engine's own count)
            await asyncio.sleep(0.01)
        await engines[1].stop()  # mid-run: its requests in flight are cut
        served_before_death = len(engines[1].asked)
        progress = await run
        assert progress.completed == len(sink.trajectories) == 480
        assert progress.failed == 0
        assert all(t["reward"] != FAILURE_REWARD for t in sink.trajectories)
        assert not llm.pool.engines[1].healthy
        assert len(engines[1].asked) == served_before_death  # nothing reached it once down
        assert len(engines[0].asked) + len(engines[2].asked) >= 480 - served_before_death

        await engines[1].start()  # same port
        deadline = time.monotonic() + 60  # checked every 0.05 s: a minute is a busy machine's slack
        while not llm.pool.engines[1].healthy and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        assert llm.pool.engines[1].healthy  # the health check put it back
        for engine in engines:
            engine.asked.clear()
        again = payload(tmp_path, urls, instances=30, task_type="eval")  # new groups: none sticks yet
        await run_rollouts(again, reward=one, sink=Collected(), llm=llm)
        assert len(engines[1].asked) >= 20  # it takes its share again


async def test_a_refused_connection_moves_the_request_to_another_engine_at_once(
    engines: list[StandInEngine],
) -> None:
    await engines[0].stop()
    urls = [e.url for e in engines]
    no_retry = RetryPolicy(max_retry_s=0)  # only the move to another engine can save it
    async with ChatClient(urls, retry=no_retry, health_interval_s=60.0) as llm:
        llm.pool.engines[1].sent = llm.pool.engines[2].sent = 1  # engine 0 is picked first
        completion = await llm.complete([{"role": "user", "content": "hi"}])
    assert completion.text == "\\boxed{1}"
    assert completion.attempts == 2
    assert llm.stats.failures_by_kind == Counter({"ConnectError": 1})


class Rendered:
    """A renderer stand-in: the prompt's ids are its length, the output is decoded as x's."""

    def first_prompt(self, messages: Sequence[Message], tools: Any) -> list[int]:
        return [1, 2, len(str(messages[-1]["content"]))]

    def decode(self, ids: Sequence[int]) -> str:
        return "x" * len(ids)


async def test_the_token_client_uses_the_pool_too(engines: list[StandInEngine]) -> None:
    urls = [e.url for e in engines]
    client = TokenClient(urls, Rendered(), continuation=ContinuePolicy(delay_s=0))  # type: ignore[arg-type]

    async def group(index: int) -> list[Completion]:
        routing_key.set(group_key("math", 0, index))
        prompt = [{"role": "user", "content": "q" * index}]
        return await asyncio.gather(*(client.complete(prompt, max_tokens=4) for _ in range(4)))

    async with client:
        done = await asyncio.gather(*(group(i) for i in range(1, 31)))
    assert all(c.tokens is not None and c.tokens.output_ids == [7] for g in done for c in g)
    counts = [len(engine.asked) for engine in engines]
    assert sum(counts) == 120
    assert all(count >= 28 for count in counts), counts
    assert all(len(where) == 1 for where in groups_per_engine(engines).values())


async def test_with_no_engine_healthy_requests_still_go_out() -> None:
    class Down:
        async def get(self, url: str, timeout_s: float) -> int:
            raise Unreachable("ConnectError", "refused", connect=True)

    pool = EnginePool(["http://a", "http://b"], Down(), health_interval_s=60.0)  # type: ignore[arg-type]
    for engine in pool.engines:
        engine.healthy = False
    first = pool.pick("k")
    second = pool.pick("k")
    assert first is second  # the group still sticks
    await pool.aclose()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_start_rollout_with_a_list_of_engines_runs_the_job_over_all_of_them(
    process: Callable[..., str], tmp_path: Path
) -> None:
    sim = [
        "-m",
        "buffer.simulator",
        "--latency-mean-s",
        "0.02",
        "--accuracy",
        "1.0",
        "--log-level",
        "warning",
    ]
    urls = [process(*sim, "--seed", str(seed), name=f"simulator{seed}") for seed in range(2)]
    buffer_url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        started = client.post(
            "/start_rollout",
            json={**payload(tmp_path, urls, instances=20), "task_type": "math", "num_process": "16"},
        )
        assert started.status_code == 200, started.text
        deadline = time.monotonic() + 60
        while (job := client.get(f"/jobs/{started.json()['job_id']}").json()["data"])["status"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
    assert job["status"] == "succeeded", job
    assert job["progress"]["completed"] == 80
    served = [httpx.get(f"{url}/stats", trust_env=False).json()["requests"] for url in urls]
    assert sum(served) >= 80
    assert min(served) >= 30, served  # both engines took their share


async def test_max_attempts_bounds_the_moves_to_other_engines_too(engines: list[StandInEngine]) -> None:
    for engine in engines:
        await engine.stop()
    async with ChatClient(
        [e.url for e in engines], retry=RetryPolicy(max_attempts=2, backoff_s=0.001)
    ) as llm:
        with pytest.raises(LLMError, match="failed 2 times"):
            await llm.complete([{"role": "user", "content": "hi"}])
    assert llm.stats.requests == 2
