"""What you see is what you train on: the shipped generators, run by the service in token mode
(the default, given ``tokenizer_path``) against the simulated engine, give training samples made of
exactly what the engine received and sampled.

The simulator runs in this process behind a recording middleware, so every token endpoint's
request and answer is known; the buffer is a real process running ``generator/`` as a user
would. Each sample the trainer side converts is checked against the recording: its tokens are
the prompt the engine received and, turn by turn, the ids it sampled (aborted replies continued
included), the loss mask is 1 exactly on the sampled ids, and the rollout logprobs are the
sampling logprobs of those ids, 0.0 elsewhere (slime's convention).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from buffer.processes import free_port
from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.tokenizer import build_tokenizer
from buffer.trainer.samples import SampleConverter
from tests.support.calls import wait_for
from tests.support.engine_records import assert_sampled, sampled
from tests.support.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN_ENDPOINTS = ("/generate", "/v1/completions")


class Recording:
    """ASGI middleware: the request and answer of every successful call of a token endpoint."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def __call__(self, scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["path"] not in TOKEN_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        body: list[bytes] = []
        answer: list[bytes] = []
        status = [0]

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def send_answer(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive_body, send_answer)
        if status[0] == 200:
            self.exchanges.append((json.loads(b"".join(body)), json.loads(b"".join(answer))))


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Recording]]:
    """The simulator imitating ``request.param``, in a thread of this process: (name, URL, recording)."""
    name: str = request.param
    config = SimConfig(engine=name, latency_mean_s=0.01, abort_rate=0.3, accuracy=0.5, seed=0)
    recording = Recording(create_sim_app(config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(recording, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 120, "the simulator starting")
    assert server.started, "the simulator did not start"
    yield name, f"http://127.0.0.1:{port}", recording
    server.should_exit = True
    thread.join(timeout=10)


def rows(path: Path, source: Path, count: int) -> Path:
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))
    return path


@pytest.mark.parametrize("engine", ["sglang", "vllm"], indirect=True)
def test_every_sample_of_the_shipped_generators_is_what_the_engine_received_and_sampled(
    engine: tuple[str, str, Recording], process: Callable[..., str], tmp_path: Path
) -> None:
    name, engine_url, recording = engine
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    data = REPO / "generator" / "data"
    inputs = {
        "math": rows(tmp_path / "math.jsonl", data / "math.jsonl", 6),
        "calculator": rows(tmp_path / "calculator.jsonl", data / "calculator.jsonl", 6),
    }
    url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    items: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        for task, input_file in inputs.items():
            started = client.post(
                "/start_rollout",
                json={
                    "task_type": task,
                    "input_file": str(input_file),
                    "remote_engine_url": engine_url,
                    "num_repeat_per_sample": 4,
                    "num_process": 16,
                    # Every field that shapes the distribution set, so the engine's logprobs are
                    # known to be the sampling distribution's (none left to the model's defaults).
                    "sampling_params": {"max_tokens": 200, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
                    | {
                        "min_p": 0.0,
                        "repetition_penalty": 1.0,
                        "presence_penalty": 0.0,
                        "frequency_penalty": 0.0,
                    },
                    "tokenizer_path": str(tmp_path / "tokenizer"),  # token mode: the default with one
                    "engine": name,
                    "model": "sim-model",
                    "abort_retry_delay_s": 0,
                    "max_continuations": 50,
                    # With its tool the simulator is always right: every calculator group has equal
                    # rewards, which training drops (is_valid_group). Kept as written instead.
                    "evaluation": task == "calculator",
                },
            )
            assert started.status_code == 200, started.text

        def ended() -> bool:
            jobs = client.get("/jobs").json()["data"]["jobs"]
            return len(jobs) == 2 and all(job["status"] != "running" for job in jobs)

        wait_for(ended, 120, "the two jobs")
        jobs = client.get("/jobs").json()["data"]["jobs"]
        assert [job["status"] for job in jobs] == ["succeeded", "succeeded"], jobs
        while batch := client.post("/get_rollout_data", json={"batch_size": -1}).json()["data"]["data"]:
            items += batch
    answers: dict[Any, list[tuple[list[int], list[float]]]] = {}
    for request, answer in recording.exchanges:
        key, ids, logprobs = sampled(name, request, answer)
        answers.setdefault(key, []).append((ids, logprobs))
    by_task = {task: [item for item in items if item["task_type"] == task] for task in inputs}
    assert all(len(found) >= 8 for found in by_task.values()), {t: len(f) for t, f in by_task.items()}
    assert any(len(item["turns"]) > 1 for item in by_task["calculator"])  # it called its tool
    assert len(recording.exchanges) > sum(len(item["turns"]) for item in items)  # aborts were continued

    assert {item["extra_info"]["generation_mode"] for item in items} == {"token"}
    converter = SampleConverter(tokenizer)
    for item in items:
        (sample,) = converter.convert_all(item)  # the simulator's template never rewrites history
        # The engine received each turn's prompt and sampled its ids with these logprobs:
        expected = assert_sampled(answers, item)
        tokens, mask, log_probs = expected.tokens, expected.mask, expected.log_probs
        first_prompt = len(tokens) - len(mask)
        assert sample.tokens == tokens
        assert sample.loss_mask == mask
        assert sample.response_length == len(mask) == len(sample.tokens) - first_prompt
        assert {turn["logprobs"] for turn in item["turns"]} == {"sampling"}
        assert sample.rollout_log_probs == log_probs
        if item["task_type"] == "math":  # trained: a reply still aborted is never among them
            assert item["extra_info"]["finish_reason"] != "abort"
