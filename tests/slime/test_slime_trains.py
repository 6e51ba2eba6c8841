"""slime's own training loops, unchanged, on the service (issue 21).

Each test runs slime's ``train.py`` or ``train_async.py`` ``train(args)`` with slime's
``parse_args``, ``RolloutManager`` and train-side functions (``tests/support/slime_side.py``
says what runs and what stands in for the GPUs) against a buffer running the shipped generators
in worker processes, on the simulated SGLang engine behind a recording proxy. Every sample the
trainer receives is checked against what the engine received and sampled: each run of loss-mask
1 tokens is what the engine sampled after exactly the tokens before it, with the logprobs it
reported (an aborted reply continued from its tokens included); every other position has mask 0
and log prob 0; the reward slime normalises is the generator's, normalised once per group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from buffer.processes import free_port, started, wait_ready
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.rewards.answers import decide_fast, extract_boxed
from tests.support.engine_records import sampled
from tests.support.paths import REPO, SUPPORT
from tests.support.recording_proxy import RecordingProxy
from tests.support.slime_runtime import SLIME, pythonpath

pytestmark = [pytest.mark.e2e, pytest.mark.slime, pytest.mark.timeout(900)]

#: A Megatron model that matches the checkpoint's config.json (slime validates one against the
#: other); nothing loads it: the trainer's logits are random.
MODEL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128}
MEGATRON_MODEL = [
    "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "10000", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
]  # fmt: skip


@dataclass
class Report:
    """What slime's run did, read from the report the slime side wrote."""

    entries: list[dict[str, Any]]
    exchanges: dict[Any, list[tuple[list[int], list[float]]]] = field(default_factory=dict)
    log: str = ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [entry for entry in self.entries if entry["kind"] == kind]

    def metrics(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for entry in self.of("log"):
            merged |= entry["metrics"]
        return merged

    def logged(self, key: str) -> list[Any]:
        return [entry["metrics"][key] for entry in self.of("log") if key in entry["metrics"]]


def _model_config(folder: Path, vocab_size: int | None = None) -> None:
    """A tiny Qwen3's config.json, as Megatron's flags above describe it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **MODEL,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
    }
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (folder / "config.json").write_text(json.dumps(config))


def _checkpoint(folder: Path) -> Path:
    """Where ``--hf-checkpoint`` points: the simulator's tokenizer and a tiny Qwen3 config."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    _model_config(folder, len(tokenizer) + 64)
    return folder


def _arithmetic(path: Path, count: int, offset: int) -> Path:
    rows = [
        {"instance_id": f"{path.stem}-{i}", "prompt": f"What is {i} + {offset}?", "label": str(i + offset)}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path


def run_slime(
    runtime: tuple[Path, Path],
    folder: Path,
    *,
    loop: str,
    simulator: list[str],
    argv: list[str],
    checkpoint: Path | None = None,
    service: tuple[str, ...] = (),
) -> Report:
    """slime's ``loop`` (train or train_async) over ``argv``, against a fresh simulator (with
    ``simulator`` flags) behind a recording proxy and a fresh buffer (with ``service`` flags)."""
    python, third_party = runtime
    checkpoint = checkpoint or _checkpoint(folder / "checkpoint")
    (folder / "ref").mkdir()
    engine_port, buffer_port = free_port(), free_port()
    engine = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(engine_port)]
    engine += ["--seed", "5", "--log-level", "warning", *simulator]
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(buffer_port)]
    command += ["--log-level", "warning", "--input-roots", str(folder), "--data-dir", str(folder / "data")]
    with (
        started(engine, "simulator", folder / "simulator.log") as engine_process,
        started([*command, *service], "buffer", folder / "buffer.log") as buffer_process,
    ):
        wait_ready(f"http://127.0.0.1:{engine_port}/health", engine_process, 60, "simulator")
        wait_ready(f"http://127.0.0.1:{buffer_port}/health", buffer_process, 60, "buffer")
        proxy = RecordingProxy(f"http://127.0.0.1:{engine_port}")
        with proxy.serving() as engine_url:
            host, port = engine_url.removeprefix("http://").split(":")
            slime_command = [
                "--rollout-num-gpus", "0", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
                "--rollout-function-path", "buffer.slime_rollout.generate_rollout",
                "--hf-checkpoint", str(checkpoint), "--ref-load", str(folder / "ref"),
                "--sglang-router-ip", host, "--sglang-router-port", port,
                "--rollout-buffer-url", f"http://127.0.0.1:{buffer_port}",
                "--input-key", "prompt", "--label-key", "label",
                *MEGATRON_MODEL, *argv,
            ]  # fmt: skip
            spec = folder / "spec.json"
            spec.write_text(json.dumps({"loop": loop}))
            report = folder / "report.jsonl"
            env = {
                **os.environ,
                "PYTHONPATH": pythonpath(third_party),
                "HF_HUB_OFFLINE": "1",
                "RAY_DISABLE_USAGE_STATS": "1",
                "WANDB_MODE": "disabled",
            }
            with (folder / "slime.log").open("w") as log:
                done = subprocess.run(
                    [
                        str(python),
                        str(SUPPORT / "slime_side.py"),
                        str(spec),
                        str(report),
                        "--",
                        *slime_command,
                    ],
                    cwd=third_party / SLIME,  # slime's train.py and train_async.py
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=780,
                    check=False,
                )
            text = (folder / "slime.log").read_text()
            assert done.returncode == 0, f"slime's run failed:\n{_tail(text)}"
            exchanges = _engine_answers(proxy)
    entries = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    return Report(entries, exchanges, text)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(line for line in text.splitlines() if "Warning" not in line)[-6000:]


def _engine_answers(proxy: RecordingProxy) -> dict[Any, list[tuple[list[int], list[float]]]]:
    """What the engine sampled after each prompt, whatever the sampling seed."""
    answers: dict[Any, list[tuple[list[int], list[float]]]] = defaultdict(list)
    for exchange in proxy.recorded("/generate"):
        if exchange.status != 200 or exchange.request is None or exchange.answer is None:
            continue
        (prompt, _seed), output, logprobs = sampled("sglang", exchange.request, exchange.answer)
        answers[(prompt, None)].append((list(output), list(logprobs)))
    return answers


def assert_trained_as_sampled(report: Report, sample: dict[str, Any]) -> None:
    """One sample as slime trains on it: its response's mask-1 runs are what the engine sampled
    after exactly the tokens before them, with the engine's logprobs; elsewhere mask and log
    prob are 0; the lengths agree."""
    tokens, length = sample["tokens"], sample["response_length"]
    mask, log_probs = sample["loss_mask"], sample["rollout_log_probs"]
    assert 0 < length < len(tokens)
    assert len(mask) == length
    assert log_probs is None or len(log_probs) == length
    start = len(tokens) - length
    index = 0
    while index < length:
        if mask[index] == 0:
            if log_probs is not None:
                assert log_probs[index] == 0.0, "a masked position carries a log prob"
            index += 1
            continue
        end = index
        while end < length and mask[end] == 1:
            end += 1
        context = tokens[: start + index]
        piece = tokens[start + index : start + end]
        piece_log_probs = log_probs[index:end] if log_probs is not None else None
        assert _covered(report.exchanges, context, piece, piece_log_probs), (
            f"tokens {start + index}..{start + end} are not what the engine sampled after the "
            "tokens before them"
        )
        index = end


def _covered(
    answers: dict[Any, list[tuple[list[int], list[float]]]],
    context: list[int],
    piece: list[int],
    log_probs: list[float] | None,
) -> bool:
    """Whether the engine sampled ``piece`` after ``context``, in one answer or an aborted one and
    its continuations (``tests.support.engine_records.covered``), with these log probs: slime
    carries them as float32, so they agree with the engine's to float32's precision."""
    if not piece:
        return True
    for output, output_log_probs in answers.get((tuple(context), None), []):
        if not output or piece[: len(output)] != output:
            continue
        if log_probs is not None and log_probs[: len(output)] != pytest.approx(
            output_log_probs, rel=1e-6, abs=1e-6
        ):
            continue
        rest = log_probs[len(output) :] if log_probs is not None else None
        if _covered(answers, context + output, piece[len(output) :], rest):
            return True
    return False


def assert_normalised_once(rewards: list[float], raw: list[float], n: int) -> None:
    """slime's GRPO normalisation, once, per group of ``n``: (raw - mean) / (std + 1e-6)."""
    assert len(rewards) == len(raw)
    for begin in range(0, len(raw), n):
        group = raw[begin : begin + n]
        mean = sum(group) / n
        std = (sum((value - mean) ** 2 for value in group) / (n - 1)) ** 0.5
        for reward, value in zip(rewards[begin : begin + n], group, strict=True):
            assert reward == pytest.approx((value - mean) / (std + 1e-6), abs=1e-4)


def _math_reward(tokenizer: Any, sample: dict[str, Any]) -> float:
    """The reward the math task gives a sample, recomputed from its tokens."""
    prompt = tokenizer.decode(sample["tokens"][: -sample["response_length"]])
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
    answer = extract_boxed(tokenizer.decode(sample["tokens"][-sample["response_length"] :]))
    return 0.0 if answer is None else float(decide_fast(answer, str(int(a) + int(b))) or 0.0)


def test_train_py_math_with_two_eval_sets_kl_and_tis(slime: tuple[Path, Path], folder: Path) -> None:
    """slime's synchronous loop: three steps of math with KL and TIS, evaluation of two data sets
    before training and after every step, pass@k logged: every sample exact."""
    train = _arithmetic(folder / "train.jsonl", 8, 3)
    first, second = _arithmetic(folder / "add5.jsonl", 3, 5), _arithmetic(folder / "add7.jsonl", 2, 7)
    n, batch = 4, 2
    report = run_slime(
        slime,
        folder,
        loop="train",
        simulator=["--latency-mean-s", "0.02", "--accuracy", "0.5"],
        argv=[
            "--rollout-task-type", "math", "--prompt-data", str(train),
            "--num-rollout", "3", "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
            "--global-batch-size", str(n * batch), "--rollout-max-response-len", "64",
            "--eval-prompt-data", "add5", str(first), "add7", str(second),
            "--n-samples-per-eval-prompt", "2", "--eval-interval", "1", "--log-passrate",
            "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--use-tis",
        ],
    )  # fmt: skip
    tokenizer = build_tokenizer()
    steps = report.of("train")
    assert [step["rollout_id"] for step in steps] == [0, 1, 2]
    for step in steps:
        samples = step["samples"]
        assert len(samples) == n * batch  # whole groups, exactly n samples each
        for sample in samples:
            assert_trained_as_sampled(report, sample)
            assert sample["rollout_log_probs"] is not None  # TIS needs them, and they came
        assert step["raw_reward"] == [_math_reward(tokenizer, sample) for sample in samples]
        assert_normalised_once([sample["reward"] for sample in samples], step["raw_reward"], n)
        assert all(loss == loss for loss in step["losses"])  # finite, checked with its gradient
    # slime's own pass@k over the step's groups, and both eval data sets at every evaluation
    assert len(report.logged("passrate/pass@4")) == 3
    assert len(report.logged("eval/add5")) == len(report.logged("eval/add7")) == 4
    assert all(0.0 <= value <= 1.0 for value in report.logged("eval/add5"))
    assert [sync["aborted"] for sync in report.of("sync")] == [0, 0, 0, 0]


@pytest.mark.parametrize("pause", ["drain", "abort"])
def test_train_async_py_multi_turn_tools_under_aborts_with_a_pause_at_every_weight_update(
    slime: tuple[Path, Path], folder: Path, pause: str
) -> None:
    """slime's asynchronous loop (the next step generates while this one trains) on the
    calculator task, the engine aborting 30% of replies and mistyping 30% of tool calls, the
    adapter pausing generation once a step's batch is read (``--rollout-buffer-pause``, given
    on slime's command line): every sample exact, whole groups whatever the branches, pass@k
    logged without a crash, and slime's weight syncs find nothing in flight to abort."""
    data = folder / "calculator.jsonl"
    data.write_text((REPO / "generator" / "data" / "calculator.jsonl").read_text())
    n, batch = 4, 2
    report = run_slime(
        slime,
        folder,
        loop="train_async",
        simulator=[
            "--latency-mean-s", "0.05", "--accuracy", "0.5",
            "--abort-rate", "0.3", "--tool-error-rate", "0.3",
        ],
        argv=[
            "--rollout-task-type", "calculator", "--prompt-data", str(data),
            "--num-rollout", "3", "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
            "--global-batch-size", str(n * batch), "--rollout-max-response-len", "96",
            "--log-passrate", "--advantage-estimator", "grpo", "--use-rollout-logprobs",
            "--rollout-buffer-pause", pause, "--rollout-buffer-max-staleness", "1",
        ],
    )  # fmt: skip
    steps = report.of("train")
    assert [step["rollout_id"] for step in steps] == [0, 1, 2]
    turns = 0
    for step in steps:
        samples = step["samples"]
        assert len(samples) == n * batch
        for sample in samples:
            assert_trained_as_sampled(report, sample)
            turns += _runs(sample["loss_mask"])
        assert_normalised_once([sample["reward"] for sample in samples], step["raw_reward"], n)
    assert turns > len(steps) * n * batch  # tool calls were made: more than one turn per sample
    assert len(report.logged("passrate/pass@4")) == 3
    syncs = report.of("sync")
    assert len(syncs) == 4  # the push before training, then one per step
    assert [sync["aborted"] for sync in syncs] == [0] * 4


def _runs(mask: list[int]) -> int:
    return sum(1 for index, value in enumerate(mask) if value == 1 and (index == 0 or mask[index - 1] == 0))


FIXTURE_GENERATOR = """
import json

from buffer.toolkit.sink import open_sink

TASK_TYPE = "fixture"


async def run_rollout(data):
    \"\"\"Write the trajectories of the input file as they are: a test's fixed groups.\"\"\"
    sink = await open_sink(data.get("remote_buffer_url"))
    try:
        with open(data["input_file"]) as rows:
            for row in rows:
                if row.strip():
                    trajectory = json.loads(row)
                    for field in ("prompt", "label"):  # the data set's, for slime's data source
                        trajectory.pop(field)
                    await sink.write(trajectory)
    finally:
        await sink.aclose()
"""


def test_images_and_a_refused_trajectory_reach_slimes_trainer_as_it_takes_them(
    slime: tuple[Path, Path], folder: Path
) -> None:
    """A VLM's trajectories (LLaVA's processor on the checkpoint) and one the converter refuses,
    through slime's own ``train.py``: the image sample reaches the trainer with the processor's
    pixels for exactly the image tokens its prompt holds (``multimodal_train_inputs``),
    the text one with none; the refused trajectory is a placeholder slime trains nothing of, its
    reward kept in its group's normalisation."""
    python, third_party = slime
    _model_config(folder / "checkpoint")
    prepared = folder / "prepared.jsonl"
    done = subprocess.run(
        [str(python), str(SUPPORT / "slime_side.py"), "prepare-vlm", str(folder), str(prepared)],
        env={**os.environ, "PYTHONPATH": pythonpath(third_party), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [facts] = [json.loads(line) for line in prepared.read_text().splitlines()]
    generators = folder / "generators"
    generators.mkdir()
    (generators / "fixture_generator.py").write_text(FIXTURE_GENERATOR)
    report = run_slime(
        slime,
        folder,
        loop="train",
        simulator=[],
        checkpoint=folder / "checkpoint",
        service=("--generator-dir", str(generators)),
        argv=[
            "--rollout-task-type", "fixture", "--prompt-data", str(folder / "fixture.jsonl"),
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rollout-max-response-len", "64",
            "--advantage-estimator", "grpo", "--log-passrate",
        ],
    )  # fmt: skip
    [step] = report.of("train")
    samples = step["samples"]
    assert len(samples) == 4
    pictures = [sample for sample in samples if facts["image_pad"] in sample["tokens"]]
    assert len(pictures) == 2
    for sample in pictures:
        inputs = sample["multimodal"]
        assert inputs is not None, "the image sample reached the trainer without its pixels"
        assert sample["tokens"].count(facts["image_pad"]) == facts["image_tokens"] == 4
        assert inputs == {"pixel_values": [1, 3, 28, 28]}  # the processor's pixels; no input_ids
        assert sum(sample["loss_mask"]) == sample["response_length"] > 0
    texts = [sample for sample in samples if sample not in pictures]
    assert [sample["multimodal"] for sample in texts] == [None, None]
    trained, placeholder = sorted(texts, key=lambda sample: -sum(sample["loss_mask"]))
    assert sum(trained["loss_mask"]) == trained["response_length"] > 0
    assert sum(placeholder["loss_mask"]) == 0  # refused: nothing of it is trained on
    # the refused trajectory's reward (0) still counts in its group's baseline
    assert sorted(step["raw_reward"]) == [0.0, 0.0, 1.0, 1.0]
    assert_normalised_once([sample["reward"] for sample in samples], step["raw_reward"], 2)
    assert report.logged("rollout_buffer/refused_samples") == [1.0]
