"""What you see is what you train on, against a real vLLM: the shipped generators, run by the
service, give samples made of exactly what vLLM received and sampled, with vLLM's own logprobs.

vLLM 0.32 (the CPU wheel) serves a tiny random Qwen3 with the real Qwen3 chat template; a
recording proxy in front of it is the ground truth; every sample's logprobs are scored again by
``transformers`` from the same weights (teacher forcing). Weight updates are stood in for as a
trainer makes them: the buffer's ``POST /policy/pause`` in ``abort`` mode, which reaches vLLM's own
``/pause?mode=abort``, then ``/policy/resume``, again and again while the jobs run, so answers are
aborted and continued as they are in asynchronous RL.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.trainer.samples import SampleConverter
from tests.support.calls import wait_for
from tests.support.engine_records import assert_sampled
from tests.support.paths import REPO
from tests.support.recording_proxy import Exchange
from tests.support.vllm_engine import MODEL_NAME
from tests.vllm.conftest import Engine

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

#: How far the engine's logprobs may be from teacher forcing (float32 on the CPU: about 1e-5).
LOGPROB_TOLERANCE = 1e-3
#: A Qwen3 tool call of the calculator's, the only text vLLM's structured outputs let the model
#: write; vLLM's hermes parser turns it into ``tool_calls``.
TOOL_CALL = (
    r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "[1-9][0-9]? [-+*] [1-9][0-9]?"\}\}'
    r"\n</tool_call>"
)


def rows(path: Path, count: int, data: str = "math.jsonl") -> Path:
    source = REPO / "generator" / "data" / data
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))
    return path


@contextlib.contextmanager
def weight_updates(buffer_url: str, engine: Engine, every_s: float) -> Iterator[None]:
    """What a trainer does around each weight update, again and again for the block: the
    buffer's ``POST /policy/pause`` in ``abort`` mode, which pauses generation and has vLLM abort
    what is in flight (its own ``/pause?mode=abort``), then ``POST /policy/resume``."""
    done = threading.Event()
    failures: list[str] = []

    def run() -> None:
        with httpx.Client(base_url=buffer_url, timeout=120, trust_env=False) as client:
            while not done.wait(every_s):
                paused = client.post(
                    "/policy/pause",
                    json={
                        "mode": "abort",
                        "engine_urls": [engine.direct_url],
                        "engine": "vllm",
                        "timeout_s": 10,
                    },
                )
                resumed = client.post("/policy/resume", json={})
                failures.extend(r.text for r in (paused, resumed) if r.status_code != 200)

    thread = threading.Thread(target=run, name="weight-updates", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=120)
    assert not failures, failures[:3]


def run_math(
    process: Callable[..., str], tmp_path: Path, engine: Engine, **fields: Any
) -> list[dict[str, Any]]:
    """The shipped math generator, run by the service against ``engine``; every trajectory read."""
    return run_task("math", process, tmp_path, engine, **fields)


def run_task(
    task: str,
    process: Callable[..., str],
    tmp_path: Path,
    engine: Engine,
    *,
    pause_every_s: float | None = None,
    **fields: Any,
) -> list[dict[str, Any]]:
    """A shipped generator, run by the service against ``engine`` on 6 rows of its data, 4 samples
    each, with weight updates every ``pause_every_s`` while it runs; every trajectory read."""
    url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        started = client.post(
            "/start_rollout",
            json={
                "task_type": task,
                "input_file": str(rows(tmp_path / f"{task}.jsonl", 6, f"{task}.jsonl")),
                "remote_engine_url": engine.url,
                "engine": "vllm",
                "model": MODEL_NAME,
                "num_repeat_per_sample": 4,
                "num_process": 8,
                "abort_retry_delay_s": 0,
                "max_continuations": 100,
                "evaluation": True,  # random rewards: keep every group, as written
                **fields,
            },
        )
        assert started.status_code == 200, started.text

        def ended() -> bool:
            jobs = client.get("/jobs").json()["data"]["jobs"]
            return bool(jobs) and all(job["status"] != "running" for job in jobs)

        with weight_updates(url, engine, pause_every_s) if pause_every_s else contextlib.nullcontext():
            wait_for(ended, 600, f"the {task} job")
        jobs = client.get("/jobs").json()["data"]["jobs"]
        assert [job["status"] for job in jobs] == ["succeeded"], jobs
        items: list[dict[str, Any]] = []
        while batch := client.post("/get_rollout_data", json={"batch_size": -1}).json()["data"]["data"]:
            items += batch
    assert len(items) == 24, len(items)
    return items


def assert_logprobs_are_the_models(
    engine: Engine, sequences: list[tuple[list[int], list[int], list[float]]]
) -> None:
    scored = engine.score([(prompt, output) for prompt, output, _ in sequences])
    worst = 0.0
    for (_, output, kept), teacher in zip(sequences, scored, strict=True):
        assert len(kept) == len(teacher) == len(output)
        worst = max([worst, *(abs(a - b) for a, b in zip(kept, teacher, strict=True))])
    assert worst < LOGPROB_TOLERANCE, f"rollout logprobs off the model's by up to {worst}"


def test_token_mode_samples_are_what_vllm_received_and_sampled_through_aborts(
    vllm: Engine, process: Callable[..., str], tmp_path: Path
) -> None:
    items = run_math(
        process,
        tmp_path,
        vllm,
        pause_every_s=0.3,
        token_mode=True,
        tokenizer_path=str(vllm.model),
        logprobs_mode="processed_logprobs",  # as the suite's vLLM runs: its logprobs are handed over
        sampling_params={"max_tokens": 160, "temperature": 1.0},
    )
    assert aborted_answers(vllm), "no answer was aborted: the pauses did not land during generation"
    answers = engine_answers(vllm)
    converter = SampleConverter(_tokenizer(vllm.model))
    to_score: list[tuple[list[int], list[int], list[float]]] = []
    for item in items:
        (sample,) = converter.convert_all(item)
        expected = assert_sampled(answers, item)
        to_score += expected.turns
        assert sample.tokens == expected.tokens
        assert sample.loss_mask == expected.mask
        assert sample.rollout_log_probs == expected.log_probs
    assert_logprobs_are_the_models(vllm, to_score)


def test_logprobs_at_another_temperature_reach_the_trainer_only_as_sampling_logprobs(
    vllm: Engine, process: Callable[..., str], tmp_path: Path
) -> None:
    """Issue 20, item 2. The suite's vLLM runs with ``--logprobs-mode processed_logprobs``. A run
    that says so (``logprobs_mode``) hands its logprobs to the trainer, and they are the tempered
    distribution's (teacher forcing at T = 0.6); a run that does not is taken to be on vLLM's
    default, whose logprobs are taken before temperature, and they are withheld, saying why."""
    fields: dict[str, Any] = {
        "token_mode": True,
        "tokenizer_path": str(vllm.model),
        "sampling_params": {"max_tokens": 64, "temperature": 0.6},
    }
    declared = run_math(process, tmp_path, vllm, logprobs_mode="processed_logprobs", **fields)
    converter = SampleConverter(_tokenizer(vllm.model))
    to_score: list[tuple[list[int], list[int], list[float]]] = []
    for item in declared:
        assert {turn["logprobs"] for turn in item["turns"]} == {"sampling"}, item["uid"]
        (sample,) = converter.convert_all(item)
        assert sample.rollout_log_probs is not None, item["uid"]
        tokens: list[int] = []
        for turn in item["turns"]:
            prompt = tokens[: turn["prompt_offset"]] + turn["prompt_ids"]
            to_score.append((prompt, turn["output_ids"], turn["output_logprobs"]))
            tokens = prompt + turn["output_ids"]
    scored = vllm.score([(prompt, output) for prompt, output, _ in to_score], temperature=0.6)
    worst = max(
        abs(a - b)
        for (_, _, kept), teacher in zip(to_score, scored, strict=True)
        for a, b in zip(kept, teacher, strict=True)
    )
    assert worst < LOGPROB_TOLERANCE, f"rollout logprobs off the tempered distribution by up to {worst}"

    (tmp_path / "undeclared").mkdir()
    undeclared = run_math(process, tmp_path / "undeclared", vllm, **fields)
    for item in undeclared:
        assert {turn["logprobs"] for turn in item["turns"]} == {"raw"}, item["uid"]
        (sample,) = converter.convert_all(item)
        assert sample.rollout_log_probs is None, item["uid"]
        assert "--logprobs-mode processed_logprobs" in (sample.log_probs_withheld or ""), (
            sample.log_probs_withheld
        )


def test_chat_mode_samples_are_what_vllm_received_and_sampled(
    vllm: Engine, process: Callable[..., str], tmp_path: Path
) -> None:
    """Without pauses: every chat answer's token record is vLLM's own, in one context."""
    items = run_math(
        process, tmp_path, vllm, token_mode=False, sampling_params={"max_tokens": 120, "temperature": 1.0}
    )
    # Nothing continued (the service's reachability probes, GET /v1/models, aside).
    generation = {e.path for e in vllm.proxy.exchanges if e.path != "/v1/models"}
    assert generation == {"/v1/chat/completions"}
    answers = engine_answers(vllm)
    to_score = [turn for item in items for turn in assert_sampled(answers, item).turns]
    assert_logprobs_are_the_models(vllm, to_score)


def test_chat_mode_answers_aborted_by_weight_updates_are_never_spliced_across_contexts(
    vllm: Engine, process: Callable[..., str], tmp_path: Path
) -> None:
    """Issue 20, item 1: a chat answer aborted and continued is, token for token, what vLLM sampled
    in the context the sample shows (however the toolkit continued it: from ids, or as a part of
    its own), and its logprobs are the model's there."""
    items = run_math(
        process,
        tmp_path,
        vllm,
        pause_every_s=0.3,
        token_mode=False,
        sampling_params={"max_tokens": 160, "temperature": 1.0},
    )
    assert aborted_answers(vllm), "no answer was aborted: the pauses did not land during generation"
    answers = engine_answers(vllm)
    to_score = [turn for item in items for turn in assert_sampled(answers, item).turns]
    assert_logprobs_are_the_models(vllm, to_score)


def test_chat_mode_tool_calls_forced_by_structured_outputs_through_aborts(
    vllm: Engine, process: Callable[..., str], tmp_path: Path
) -> None:
    """The calculator task, its tool calls forced by vLLM's structured outputs (a random model
    would never call a tool), under weight updates: each turn is what vLLM sampled in the context
    its sample shows, and the trainer side converts every trajectory. Logprobs sampled under a
    grammar are the masked distribution's, not the model's: they are marked and never handed over.
    (A continuation restarts the grammar, so a tool call cut by a pause may come back broken: the
    model then answered, which is what it sampled; the others call it turn after turn.)"""
    items = run_task(
        "calculator",
        process,
        tmp_path,
        vllm,
        pause_every_s=2.0,
        token_mode=False,
        sampling_params={
            "max_tokens": 200,
            "temperature": 1.0,
            "structured_outputs": {"regex": TOOL_CALL},
        },
    )
    several = [item for item in items if len(item["turns"]) > 1]
    assert len(several) >= 4, [len(item["turns"]) for item in items]  # the tool was called
    answers = engine_answers(vllm)
    converter = SampleConverter(_tokenizer(vllm.model))
    for item in items:
        samples = converter.convert_all(item)
        assert samples, item["uid"]
        assert_sampled(answers, item)
        assert {turn["logprobs"] for turn in item["turns"]} == {"constrained"}
        sampled = {tuple(turn["output_ids"]) for turn in item["turns"]}
        for sample in samples:  # what a sample trains on (mask 1) was sampled, as one of the turns
            assert sample.rollout_log_probs is None
            assert "constrained" in (sample.log_probs_withheld or "")
            response = sample.tokens[len(sample.tokens) - len(sample.loss_mask) :]
            trained = [token for token, mask in zip(response, sample.loss_mask, strict=True) if mask]
            assert trained, item["uid"]
            assert any(_contains(trained, list(ids)) for ids in sampled), item["uid"]


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def aborted_answers(engine: Engine) -> list[Exchange]:
    """vLLM's answers that a pause aborted."""
    return [
        e
        for e in engine.proxy.exchanges
        if e.answer and (e.answer.get("choices") or [{}])[0].get("finish_reason") == "abort"
    ]


def engine_answers(engine: Engine) -> dict[Any, list[tuple[list[int], list[float]]]]:
    """Every answer vLLM gave, by (the prompt ids it reports, the request's seed): chat and token routes."""
    answers: dict[Any, list[tuple[list[int], list[float]]]] = {}
    for exchange in engine.proxy.exchanges:
        if exchange.status != 200 or not exchange.answer or not exchange.request:
            continue
        [choice] = exchange.answer["choices"]
        if exchange.path == "/v1/chat/completions":
            prompt = exchange.answer["prompt_token_ids"]
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        elif exchange.path == "/v1/completions":
            prompt = choice.get("prompt_token_ids") or exchange.request["prompt"]
            logprobs = choice["logprobs"]["token_logprobs"]
        else:
            continue
        key = (tuple(prompt), exchange.request.get("seed"))
        answers.setdefault(key, []).append((choice["token_ids"], logprobs))
    return answers


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))
