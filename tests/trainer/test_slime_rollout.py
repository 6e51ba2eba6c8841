"""slime's rollout function against a running buffer, through the stand-in of slime's types,
data source and trainer checks in tests/support/slime_stub.

The buffer runs the shipped math generator against the simulated policy server; the
tokenizer is built offline and saved where slime's ``--hf-checkpoint`` would point.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from slime.observability.rollout_metrics import log_eval_rollout_data
from slime.ray.rollout import generate
from slime.utils.types import Sample

from buffer.processes import free_port, started, wait_ready
from buffer.simulator.tokenizer import build_tokenizer
from buffer.trainer import slime_rollout

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


class DataSource:
    """The part of slime's RolloutDataSourceWithBuffer a rollout function uses."""

    def __init__(self, metadata: dict[str, list[Any]] | None = None) -> None:
        self.buffer: list[list[Any]] = []
        self.metadata = metadata or {}

    def get_metadata(self) -> dict[str, list[Any]]:
        return self.metadata

    def update_metadata(self, metadata: dict[str, list[Any]]) -> None:
        self.metadata.update(metadata)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def add_samples(self, groups: list[list[Any]]) -> None:
        self.buffer.extend(groups)

    def get_samples(self, count: int) -> list[list[Any]]:
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        return taken


def jsonl(path: Path, count: int) -> Path:
    rows = [
        {"instance_id": f"q{i}", "prompt": f"What is {i} + 3?", "label": str(i + 3)} for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--latency-mean-s", "0.02", "--accuracy", "0.5", "--seed", "3", "--log-level", "warning"]
    with started(command, "simulator", tmp_path_factory.mktemp("logs") / "simulator.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "simulator")
        yield port


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where slime's --hf-checkpoint points: the served model's tokenizer (the simulator's own),
    saved to disk. slime sends it as tokenizer_path, so the generators run token in, token out
    (the default wherever a tokenizer is known): it must be the engine's, as it is in slime."""
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("checkpoint")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def buffer_url(tmp_path: Path) -> Iterator[str]:
    """A buffer of its own for each test, running the shipped generators."""
    port = free_port()
    command = [
        sys.executable,
        "buffer.py",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--input-roots",  # the tests' data sets
        str(tmp_path),
    ]
    with started(command, "buffer", tmp_path / "buffer.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "buffer")
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def args(
    engine: int, checkpoint: Path, buffer_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimpleNamespace]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer is on disk; nothing is downloaded
    yield SimpleNamespace(
        rollout_buffer_url=buffer_url,
        rollout_task_type="math",
        prompt_data=str(jsonl(tmp_path / "train.jsonl", 12)),
        n_samples_per_prompt=4,
        rollout_batch_size=3,
        rollout_num_process=16,
        num_epoch=1,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=engine,
        rollout_max_response_len=256,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        hf_checkpoint=str(checkpoint),
        fetch_trajectory_retry_times=-1,
        eval_prompt_data=["arith", str(jsonl(tmp_path / "eval.jsonl", 5))],
        n_samples_per_eval_prompt=2,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        log_passrate=True,
    )
    slime_rollout.close_sessions()


def buffer_get(url: str, path: str) -> Any:
    return httpx.get(url + path, timeout=10, trust_env=False).json()["data"]


def test_training_steps_return_whole_groups_keep_the_surplus_and_record_finished_groups(
    args: SimpleNamespace,
) -> None:
    source = DataSource()
    steps = [generate(args, slime_rollout.generate_rollout, step, source) for step in range(2)]
    for samples, train_data in steps:
        assert len(samples) == 3 * 4  # rollout_batch_size groups of n, not samples
        assert len(train_data["tokens"]) == len(train_data["rewards"]) == 12
        groups = [samples[start : start + 4] for start in range(0, 12, 4)]
        for group in groups:
            assert len({sample.group_index for sample in group}) == 1
            assert len({sample.metadata["uid"] for sample in group}) == 4
            for sample in group:
                assert isinstance(sample, Sample)
                assert len(sample.loss_mask) == sample.response_length < len(sample.tokens)
                assert sample.label == str(int(sample.metadata["instance_id"][1:]) + 3)
    jobs = buffer_get(args.rollout_buffer_url, "/jobs")["jobs"]
    assert len([job for job in jobs if job["task_type"] == "math"]) == 1  # started once per process
    delivered = buffer_get(args.rollout_buffer_url, "/buffer/stats")["meta_info"]["tasks"]["math"][
        "delivered_groups"
    ]
    assert delivered == 6 + source.get_buffer_length()  # nothing fetched was dropped
    assert {"0"} <= set(source.metadata)
    recorded = [instance_id for ids in source.metadata.values() for instance_id in ids]
    assert len(recorded) >= delivered  # returned and discarded groups, for a resume to skip


def test_a_resume_sends_the_recorded_groups_back_as_skips(args: SimpleNamespace) -> None:
    args.rollout_batch_size = 1
    skipped = [f"q{i}" for i in range(8)]  # recorded by an earlier run of the trainer
    # Four groups are left, so that one of them has rewards that differ (the default
    # is_valid_group drops a group of equal rewards; the simulator is right half the time).
    groups = slime_rollout.generate_rollout(args, 7, DataSource({"3": skipped})).samples
    ((instance,),) = [{sample.metadata["instance_id"] for sample in group} for group in groups]
    assert instance in {"q8", "q9", "q10", "q11"}


def test_when_the_pass_over_the_data_ends_another_starts(args: SimpleNamespace) -> None:
    args.rollout_batch_size = 2
    skipped = [f"q{i}" for i in range(11)]  # one group left to make, two wanted
    output = slime_rollout.generate_rollout(args, 0, DataSource({"0": skipped}))
    assert len(output.samples) == 2
    assert output.metrics["rollout_buffer/epochs_started"] == 1
    jobs = buffer_get(args.rollout_buffer_url, "/jobs")["jobs"]
    assert [job["status"] for job in jobs if job["task_type"] == "math"][:1] == ["succeeded"]


def test_evaluation_returns_raw_rewards_of_every_sample_per_data_set(args: SimpleNamespace) -> None:
    output = slime_rollout.generate_rollout(args, 5, DataSource(), evaluation=True)
    result = output.data["arith"]
    assert len(result["rewards"]) == len(result["truncated"]) == len(result["samples"]) == 5 * 2
    assert set(result["rewards"]) <= {0.0, 1.0}  # raw: not normalised, not padded
    assert all(isinstance(flag, bool) for flag in result["truncated"])
    assert [sample.group_index for sample in result["samples"]] == [i // 2 for i in range(10)]
    logged = log_eval_rollout_data(5, args, output.data, output.metrics)
    assert logged["eval/arith"] == sum(result["rewards"]) / 10
    assert "eval/arith-pass@2" in logged


def test_each_step_sets_the_policy_version_and_pauses_generation_until_the_next(
    args: SimpleNamespace,
) -> None:
    args.rollout_buffer_pause = "abort"
    args.rollout_buffer_max_staleness = 1
    args.num_epoch = 3
    source = DataSource()
    for step in range(3):
        samples, _ = generate(args, slime_rollout.generate_rollout, step, source)
        policy = buffer_get(args.rollout_buffer_url, "/policy")
        # slime's engines' numbering: the push before step 0 makes weight version 1
        assert policy["version"] == step + 1
        assert policy["paused"] is True  # held while slime trains and syncs the weights
        for sample in samples:
            assert step + 1 - sample.metadata["policy_version_min"] <= 1
    admission = buffer_get(args.rollout_buffer_url, "/policy")["admission"]["math"]
    assert admission["max_staleness"] == 1
    assert admission["batch_groups"] == args.rollout_batch_size  # declared, not guessed
    slime_rollout.generate_rollout(args, 3, source)
    assert buffer_get(args.rollout_buffer_url, "/policy")["version"] == 4
