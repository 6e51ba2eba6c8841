"""slime's rollout function against slime's contract, through the stand-in of slime's types
and trainer checks in tests/support/slime_stub, with the buffer's API faked.

Each test is one mismatch the adapter had with slime (issue 10, items 7 and 8): the step
goes through what slime's RolloutManager does with it (``slime.ray.rollout.generate``) or
through slime's eval logging, which fail as slime fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from slime.observability.rollout_metrics import log_eval_rollout_data
from slime.observability.train_metric_utils import log_passrate
from slime.ray.rollout import generate
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils.types import Sample

import default_func
from buffer.trainer import slime_rollout, slime_samples
from buffer.trainer.client import BufferStats, JobInfo, RolloutBatch
from tests.support.chat_templates import QWEN25_TEMPLATE, QWEN_PLAIN, QWEN_SPECIAL, make_tokenizer, train_bpe


class FakeBuffer:
    """The buffer's API as the adapter calls it. Each start of a task's run plays the next of
    its ``passes`` (a list of batches, one per read); the run's job is running while batches
    are left, then ends with ``end_status``."""

    def __init__(
        self, passes: dict[str, list[list[list[dict[str, Any]]]]], end_status: str = "succeeded"
    ) -> None:
        self.passes = passes
        self.end_status = end_status
        self.starts: list[dict[str, Any]] = []
        self.queues: dict[str, list[list[dict[str, Any]]]] = {}
        self.job_list: list[JobInfo] = []
        self.late: dict[str, list[list[dict[str, Any]]]] = {}
        self.policy_calls: list[tuple[str, Any]] = []

    def start_rollout(self, task_type: str, *, restart: bool = False, **payload: Any) -> None:
        name = payload.get("rollout_name") or task_type
        self.starts.append({"task_type": task_type, "restart": restart, **payload})
        self.queues[name] = list(self.passes[name].pop(0)) if self.passes.get(name) else []
        job = JobInfo(
            id=f"job-{len(self.job_list)}", task_type=name, status="running", started_at=len(self.job_list)
        )
        self.job_list.append(job)

    def get_rollout_data(
        self, batch_size: int | None = None, task_type: str | None = None, wait_s: float = 0.0
    ) -> RolloutBatch:
        queue = self.queues.get(task_type or "", [])
        items = queue.pop(0) if queue else []
        finished = sorted({item["instance_id"] for item in items}, key=str)
        return RolloutBatch(items=items, meta_info={"finished_groups": finished})

    def set_policy_version(self, version: int) -> dict[str, Any]:
        self.policy_calls.append(("version", version))
        return {}

    def pause_generation(self, mode: str = "abort", **_: Any) -> dict[str, Any]:
        self.policy_calls.append(("pause", mode))
        return {}

    def resume_generation(self, version: int | None = None) -> dict[str, Any]:
        self.policy_calls.append(("resume", version))
        return {}

    def jobs(self) -> list[JobInfo]:
        for job in self.job_list:
            if job.status == "running" and not self.queues.get(job.task_type):
                job.status = self.end_status
                job.error = (
                    None if self.end_status == "succeeded" else "ConnectionError: the engine went away"
                )
        return self.job_list

    def stats(self) -> BufferStats:
        """Groups still open after the job ended (``late``) show as pending, then become ready."""
        tasks = {}
        for name, batches in self.late.items():
            if batches:
                self.queues.setdefault(name, []).append(batches.pop(0))
                tasks[name] = {"pending_groups": 1}
        return BufferStats(tasks=tasks)

    def cancel_job(self, job_id: str) -> JobInfo:
        (job,) = [job for job in self.job_list if job.id == job_id]
        job.status = "cancelled"
        return job

    def close(self) -> None:
        pass


def trajectory(
    instance_id: Any, k: int, reward: float, *, log_probs: bool = False, **extra: Any
) -> dict[str, Any]:
    """One trajectory as the buffer returns it (after GRPO: ``reward`` normalised, ``raw_reward``)."""
    item: dict[str, Any] = {
        "instance_id": instance_id,
        "uid": f"{instance_id}-{k}",
        "messages": [
            {"role": "user", "content": f"What is {k} + 3?"},
            {"role": "assistant", "content": f"It is {k + 3}."},
        ],
        "reward": reward,
        "raw_reward": extra.pop("raw_reward", reward),
        "extra_info": {"label": "7"},
    }
    if log_probs:  # the engine's tokens, single-turn (the converter's token path)
        item["extra_info"] |= {
            "prompt_token_ids": [5, 6, 7, 8],
            "token_ids": [9, 10, 11],
            "logprobs": [-0.5, -0.25, -0.125],
        }
    item.update(extra)
    return item


def group(instance_id: Any, raw: list[float], **options: Any) -> list[dict[str, Any]]:
    mean = sum(raw) / len(raw)
    return [
        trajectory(instance_id, k, round(r - mean, 6), raw_reward=r, **options) for k, r in enumerate(raw)
    ]


def refused(instance_id: Any, k: int, reward: float) -> dict[str, Any]:
    """A trajectory the converter refuses (no assistant message: nothing to train on)."""
    item = trajectory(instance_id, k, reward)
    item["messages"] = item["messages"][:1]
    return item


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer(train_bpe(), QWEN25_TEMPLATE, QWEN_SPECIAL + QWEN_PLAIN, eos="<|im_end|>")


@pytest.fixture
def args(tmp_path: Path) -> SimpleNamespace:
    """slime's flags as its parser leaves them by default (those the adapter and the stand-in read)."""
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(f'{{"instance_id": "q{i}"}}\n' for i in range(4)))
    return SimpleNamespace(
        rollout_buffer_url="http://buffer.test",
        rollout_task_type="math",
        prompt_data=str(prompts),
        hf_checkpoint="unused",
        sglang_router_ip="127.0.0.1",
        sglang_router_port=30000,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        num_epoch=None,
        num_rollout=None,
        rollout_max_response_len=64,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_stop=None,
        apply_chat_template_kwargs={},
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        eval_reward_key=None,
        custom_reward_post_process_path=None,
        use_tis=False,
        use_rollout_logprobs=False,
        get_mismatch_metrics=False,
        fetch_trajectory_retry_times=-1,
        eval_datasets=None,
        eval_prompt_data=None,
        n_samples_per_eval_prompt=2,
        eval_max_response_len=None,
        eval_temperature=None,
        eval_top_p=None,
        eval_top_k=None,
        log_passrate=True,
    )


@pytest.fixture
def connect(monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> Iterator[Any]:
    """Install a fake buffer (and the test tokenizer) for the adapter's session."""

    def install(buffer: FakeBuffer, tokenizer_for_run: Any = None) -> FakeBuffer:
        monkeypatch.setattr(slime_rollout, "_client", lambda args: buffer)
        monkeypatch.setattr(slime_rollout, "_tokenizer", lambda args: tokenizer_for_run or tokenizer)
        return buffer

    yield install
    slime_rollout.close_sessions()


def step(args: SimpleNamespace, source: RolloutDataSourceWithBuffer, rollout_id: int = 0) -> Any:
    """One training step as slime's RolloutManager runs it."""
    return generate(args, slime_rollout.generate_rollout, rollout_id, source)


def test_a_step_mixing_samples_with_and_without_log_probs_trains_with_tis(
    args: SimpleNamespace, connect: Any
) -> None:
    args.use_tis = True
    connect(FakeBuffer({"math": [[group("a", [0, 1], log_probs=True) + group("b", [1, 0])]]}))
    source = RolloutDataSourceWithBuffer(args)
    samples, train_data = step(args, source)
    assert [s.metadata["instance_id"] for s in samples] == ["a", "a", "b", "b"]
    assert train_data["rollout_log_probs"][0] == (-0.5, -0.25, -0.125)
    # The text-only samples stay in their group for its baseline, with nothing to train.
    assert [s.remove_sample for s in samples] == [False, False, True, True]
    assert train_data["loss_masks"][2] == (0,) * samples[2].response_length
    assert train_data["rollout_log_probs"][2] == (0.0,) * samples[2].response_length


def test_without_a_flag_that_reads_them_a_mixed_step_drops_the_log_probs(
    args: SimpleNamespace, connect: Any
) -> None:
    connect(FakeBuffer({"math": [[group("a", [0, 1], log_probs=True) + group("b", [1, 0])]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert "rollout_log_probs" not in train_data
    assert not any(s.remove_sample for s in samples)


def test_tis_on_a_step_without_any_log_probs_says_why_and_keeps_the_groups(
    args: SimpleNamespace, connect: Any
) -> None:
    args.use_tis = True
    connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [1, 0])]]}))
    source = RolloutDataSourceWithBuffer(args)
    with pytest.raises(slime_rollout.RolloutLogProbsMissing, match="--use-tis needs rollout log probs"):
        step(args, source)
    assert source.get_buffer_length() == 2


def test_a_key_some_trajectories_carry_in_extra_info_is_on_every_sample(
    args: SimpleNamespace, connect: Any
) -> None:
    first = group("a", [0, 1])
    for item in first:
        item["extra_info"]["round_number"] = 1  # slime's own generators count the turns
    connect(FakeBuffer({"math": [[first + group("b", [1, 0])]]}))
    _, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert train_data["round_number"] == [1, 1, 1, 1]


def test_a_top_p_below_one_is_refused_before_anything_runs(args: SimpleNamespace, connect: Any) -> None:
    args.rollout_top_p = 0.9
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [1, 0])]]}))
    with pytest.raises(ValueError, match=r"--rollout-top-p 0\.9: .*top-p token sets"):
        step(args, RolloutDataSourceWithBuffer(args))
    assert buffer.starts == []


def with_turn(item: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """``item`` with one token record whose logprobs are of ``kind`` (None: the turn does not say)."""
    turn = {
        "prompt_ids": [5, 6, 7, 8],
        "output_ids": [9, 10, 11],
        "output_logprobs": [-0.5, -0.25, -0.125],
        "finish_reason": "stop",
        "message_index": 1,
        "sampling": {"temperature": 0.6, "top_p": 1.0},
    }
    if kind is not None:
        turn["logprobs"] = kind
    item["turns"] = [turn]
    return item


def turned(instance_id: str, raw: list[float], kind: str | None) -> list[dict[str, Any]]:
    return [with_turn(item, kind) for item in group(instance_id, raw)]


def test_sampling_logprobs_are_handed_to_tis(args: SimpleNamespace, connect: Any) -> None:
    args.use_tis = True
    connect(FakeBuffer({"math": [[turned("a", [0, 1], "sampling") + turned("b", [1, 0], "sampling")]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert train_data["rollout_log_probs"][0] == (-0.5, -0.25, -0.125)
    assert not any(s.remove_sample for s in samples)


@pytest.mark.parametrize("kind", ["raw", "unknown", None])
def test_tis_refuses_a_step_whose_logprobs_are_not_the_sampling_distributions(
    args: SimpleNamespace, connect: Any, kind: str | None
) -> None:
    args.use_tis = True
    connect(FakeBuffer({"math": [[turned("a", [0, 1], "sampling") + turned("b", [1, 0], kind)]]}))
    source = RolloutDataSourceWithBuffer(args)
    with pytest.raises(
        slime_samples.RolloutLogProbsNotSampling, match=r"--use-tis .*2 of this step's 4"
    ) as refused:
        step(args, source)
    assert f"turns.0.logprobs: {'absent' if kind is None else repr(kind).replace(chr(39), chr(34))}" in str(
        refused.value
    )
    assert source.get_buffer_length() == 2  # kept for the run that fixes its engine or its flags


def test_without_tis_logprobs_that_are_not_sampling_are_withheld_counted_and_said(
    args: SimpleNamespace, connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    args.rollout_batch_size = 1
    connect(FakeBuffer({"math": [[turned("a", [0, 1], "raw")], [turned("b", [1, 0], "raw")]]}))
    source = RolloutDataSourceWithBuffer(args)
    first = slime_rollout.generate_rollout(args, 0, source)
    second = slime_rollout.generate_rollout(args, 1, source)
    for output in (first, second):
        for sample in output.samples[0]:
            assert sample.rollout_log_probs is None
            assert "--logprobs-mode processed_logprobs" in sample.metadata["log_probs_withheld"]
        assert output.metrics["rollout_buffer/withheld_log_probs"] == 2
    said = [r for r in caplog.records if "rollout log probs withheld" in r.getMessage()]
    assert len(said) == 1  # once per trainer process, not once per step


def test_tis_with_a_top_k_is_refused_before_anything_runs(args: SimpleNamespace, connect: Any) -> None:
    args.use_tis = True
    args.rollout_top_k = 20
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [1, 0])]]}))
    with pytest.raises(
        ValueError, match=r"--use-tis with --rollout-top-k 20: SGLang returns logprobs before"
    ):
        step(args, RolloutDataSourceWithBuffer(args))
    assert buffer.starts == []


def test_the_filters_are_sent_so_the_engine_takes_none_from_the_model(
    args: SimpleNamespace, connect: Any
) -> None:
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [1, 0])]]}))
    step(args, RolloutDataSourceWithBuffer(args))
    sampling = buffer.starts[0]["sampling_params"]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"], sampling["min_p"]) == (
        1.0,
        1.0,
        -1,
        0.0,
    )


def test_indices_count_trajectories_and_group_indices_count_groups(
    args: SimpleNamespace, connect: Any
) -> None:
    first = group("a", [0, 1]) + group(7, [1, 0]) + group("c", [1, 1])
    connect(FakeBuffer({"math": [[first], [group("d", [0, 1])]]}))
    source = RolloutDataSourceWithBuffer(args)
    samples, train_data = step(args, source)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    assert train_data["rollout_ids"] == [0, 1, 2, 3]
    samples, _ = step(args, source, 1)  # the surplus group, then one more read
    assert [s.index for s in samples][:2] == [4, 5]
    assert [s.group_index for s in samples][:2] == [2, 2]


@pytest.mark.parametrize("slime_normalises", [True, False])
def test_rewards_are_normalised_once(args: SimpleNamespace, connect: Any, slime_normalises: bool) -> None:
    args.rewards_normalization = slime_normalises
    connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [1, 1])]]}))
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert train_data["raw_reward"] == [0, 1, 1, 1]
    if slime_normalises:  # the raw rewards, normalised by slime: minus the mean, over the std
        assert [s.reward for s in samples] == [0, 1, 1, 1]
        assert train_data["rewards"] == pytest.approx([-0.7071, 0.7071, 0, 0], abs=1e-3)
    else:  # the buffer's, as its task normalised them
        assert train_data["rewards"] == [-0.5, 0.5, 0, 0]


def test_a_refused_trajectory_neither_fails_the_step_nor_loses_its_group(
    args: SimpleNamespace, connect: Any
) -> None:
    args.rollout_batch_size = 3
    first = [*group("a", [0, 1])[:1], refused("a", 1, 0.5)]
    hopeless = [refused("b", 0, -0.5), refused("b", 1, 0.5)]
    connect(FakeBuffer({"math": [[first + hopeless], [group("c", [1, 0]) + group("d", [0, 1])]]}))
    source = RolloutDataSourceWithBuffer(args)
    output = slime_rollout.generate_rollout(args, 0, source)
    assert output.metrics["rollout_buffer/refused_samples"] == 3
    assert output.metrics["rollout_buffer/refused_groups"] == 1
    groups = output.samples
    assert [g[0].metadata["instance_id"] for g in groups] == ["a", "c", "d"]
    placeholder = groups[0][1]
    assert placeholder.remove_sample
    assert placeholder.status == Sample.Status.FAILED
    assert "no assistant message" in placeholder.metadata["refused"]
    assert placeholder.reward == 0.5  # its raw reward still counts in the group's baseline
    assert source.metadata == {"0": ["a", "b", "c", "d"]}  # the dropped group is finished, for a resume


def test_a_refused_trajectory_goes_through_slimes_trainer_checks(args: SimpleNamespace, connect: Any) -> None:
    args.use_tis = True
    connect(FakeBuffer({"math": [[[*group("a", [0, 1], log_probs=True)[:1], refused("a", 1, 0.5)]]]}))
    args.rollout_batch_size = 1
    samples, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert train_data["loss_masks"][1] == (0,) * samples[1].response_length
    assert len(train_data["rollout_log_probs"][1]) == samples[1].response_length


def test_a_refused_trajectory_does_not_cost_its_siblings_their_log_probs(
    args: SimpleNamespace, connect: Any
) -> None:
    connect(FakeBuffer({"math": [[[*group("a", [0, 1], log_probs=True)[:1], refused("a", 1, 0.5)]]]}))
    args.rollout_batch_size = 1
    _, train_data = step(args, RolloutDataSourceWithBuffer(args))
    assert train_data["rollout_log_probs"][0] == (-0.5, -0.25, -0.125)


def test_samples_re_rendered_from_text_are_counted_in_the_step_s_metrics(
    args: SimpleNamespace, connect: Any
) -> None:
    """A text-only trajectory is re-rendered through the chat template, and the step says how many
    were; those from the engine's tokens are not counted."""
    batch = group("a", [0, 1]) + group("b", [1, 0], log_probs=True)
    connect(FakeBuffer({"math": [[batch]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert output.metrics["rollout_buffer/rerendered_samples"] == 2
    sources = [sample.metadata["source"] for entries in output.samples for sample in entries]
    assert sources == ["rerendered", "rerendered", "engine_tokens", "engine_tokens"]


def test_when_the_pass_over_the_data_ends_another_starts(args: SimpleNamespace, connect: Any) -> None:
    args.rollout_batch_size = 3
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1])], [group("a", [1, 0]) + group("b", [0, 1])]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(output.samples) == 3
    assert output.metrics["rollout_buffer/epochs_started"] == 1
    assert [start["skip_instance_ids"] for start in buffer.starts] == [[], []]


def test_groups_still_open_when_the_job_ends_are_waited_for(args: SimpleNamespace, connect: Any) -> None:
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1])]]}))
    buffer.late = {"math": [group("b", [1, 0])]}  # timed out after the generator finished
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [g[0].metadata["instance_id"] for g in output.samples] == ["a", "b"]
    assert len(buffer.starts) == 1


def test_the_passes_asked_for_cover_num_rollout(args: SimpleNamespace, connect: Any) -> None:
    args.num_rollout = 5  # 5 steps of 2 groups over 4 prompts: 3 passes
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1]) + group("b", [0, 1])]]}))
    slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert buffer.starts[0]["num_epoch"] == "3"


def test_a_failed_job_is_an_error_with_its_reason(args: SimpleNamespace, connect: Any) -> None:
    connect(FakeBuffer({"math": [[group("a", [0, 1])]]}, end_status="failed"))
    with pytest.raises(RuntimeError, match=r"job-0 failed: ConnectionError: the engine went away"):
        slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_chat_template_kwargs_reach_the_engine_and_the_conversion(
    args: SimpleNamespace, connect: Any, tokenizer: Any
) -> None:
    marker_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'user' and greeting %}"
        "{{ greeting }} {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    greeting = make_tokenizer(train_bpe(), marker_template, QWEN_SPECIAL, eos="<|im_end|>")
    args.apply_chat_template_kwargs = '{"greeting": "Hello there"}'  # as slime's parser leaves it
    args.rollout_batch_size = 1
    buffer = connect(FakeBuffer({"math": [[group("a", [0, 1])]]}), greeting)
    (sample, _), *_ = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    assert buffer.starts[0]["sampling_params"]["chat_template_kwargs"] == {"greeting": "Hello there"}
    assert "Hello there What is 0 + 3?" in greeting.decode(sample.tokens)


def branched(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with token records of two turns, the second of which does not extend the first
    (a template that rewrote history): the converter makes one sample per branch."""
    item["messages"] = [
        {"role": "user", "content": "What is 1 + 3?"},
        {"role": "assistant", "content": "Let me think.", "generated": True},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "It is 4.", "generated": True},
    ]
    item["turns"] = [
        {
            "prompt_ids": [5, 6],
            "output_ids": [7, 8],
            "output_logprobs": [-0.5, -0.5],
            "finish_reason": "stop",
            "message_index": 1,
            "weight_version": 3,
        },
        {
            "prompt_ids": [5, 9, 10],
            "output_ids": [11],
            "output_logprobs": [-0.25],
            "finish_reason": "stop",
            "message_index": 3,
            "weight_version": 4,
        },
    ]
    return item


def test_a_branched_step_gives_slime_whole_groups_and_its_pass_rate(
    args: SimpleNamespace, connect: Any
) -> None:
    """Issue 21, item 2: a branched trajectory is one sample (its last branch), so the step is
    exactly n_samples_per_prompt per group, and slime's log_passrate and normalisation hold."""
    a = group("a", [0, 1])
    a[1] = branched(a[1])
    connect(FakeBuffer({"math": [[a + group("b", [1, 0])]]}))
    source = RolloutDataSourceWithBuffer(args)
    output = slime_rollout.generate_rollout(args, 0, source)
    (_, a1), _ = output.samples
    assert a1.tokens == [5, 9, 10, 11]  # the last branch: the first turn is in its context
    assert a1.loss_mask == [1]
    assert a1.weight_versions == ["4"]
    assert output.metrics["rollout_buffer/branched_trajectories"] == 1
    assert output.metrics["rollout_buffer/dropped_branches"] == 1
    samples, train_data = generate(args, lambda *a, **k: output, 0, source)
    assert len(samples) == args.rollout_batch_size * args.n_samples_per_prompt
    assert log_passrate(args, train_data)["pass@1"] == 0.5
    # slime reshapes by n_samples_per_prompt: per group, -0.707 and +0.707
    assert train_data["rewards"] == pytest.approx([-0.7071, 0.7071, 0.7071, -0.7071], abs=1e-3)


def test_a_step_where_every_group_is_refused_stops_with_the_reason(
    args: SimpleNamespace, connect: Any
) -> None:
    """Issue 21, item 4: a pass that kept nothing raises, rather than starting pass after pass."""
    hopeless = [[refused("a", 0, -0.5), refused("a", 1, 0.5)]]
    buffer = connect(FakeBuffer({"math": [hopeless, hopeless, hopeless]}))
    with pytest.raises(RuntimeError, match=r"all 1 groups read were refused \(the last: .*no assistant"):
        slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(buffer.starts) == 1


def test_a_long_run_of_refused_groups_stops_the_step_while_the_job_runs(
    args: SimpleNamespace, connect: Any
) -> None:
    limit = slime_rollout.refusal_limit(args)
    batches = [[refused(f"q{i}", 0, -0.5), refused(f"q{i}", 1, 0.5)] for i in range(limit + 5)]
    buffer = connect(FakeBuffer({"math": [batches]}))
    with pytest.raises(RuntimeError, match=rf"the last {limit} groups of the math rollout were all refused"):
        slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert buffer.queues["math"]  # before the pass ended


def served_version(rollout_id: int, *, asynchronous: bool) -> int:
    """The engines' weight_version while slime generates step ``rollout_id`` (interval 1): the
    push before the loop makes 1; train.py pushes after each step before the next generate;
    train_async.py starts generate(j + 1) before step j trains and pushes after it."""
    return max(1, rollout_id) if asynchronous else rollout_id + 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_buffer_s_lag_is_the_true_lag(args: SimpleNamespace, connect: Any, asynchronous: bool) -> None:
    """Issue 21, item 5: the adapter's version is in the engines' numbering, so a trajectory the
    engines stamped is as stale to the buffer as it is to the trainer (train_async: one step)."""
    buffer = connect(FakeBuffer({"math": [[group(f"q{j}", [0, 1]) for j in range(8)]]}))
    args.rollout_batch_size = 1
    source = RolloutDataSourceWithBuffer(args)
    for rollout_id in range(4):
        slime_rollout.generate_rollout(args, rollout_id, source)
        (_, version) = buffer.policy_calls[-1]
        trainer_steps = rollout_id  # the policy step rollout_id trains has taken rollout_id steps
        generated_steps = served_version(rollout_id, asynchronous=asynchronous) - 1
        true_lag = trainer_steps - generated_steps
        assert version - served_version(rollout_id, asynchronous=asynchronous) == true_lag
    assert [call[1] for call in buffer.policy_calls] == [1, 2, 3, 4]


def test_a_resumed_run_counts_versions_as_slime_s_engines_do(args: SimpleNamespace) -> None:
    args.start_rollout_id = 10  # slime's engines start again at 1 after the first push
    assert slime_rollout.policy_version(args, 10) == 1
    args.update_weights_interval = 2
    assert [slime_rollout.policy_version(args, j) for j in range(10, 14)] == [1, 1, 2, 2]


def eval_items(name: str, rewards: list[list[float]]) -> list[list[dict[str, Any]]]:
    return [[trajectory(f"{name}{i}", k, r) for k, r in enumerate(row)] for i, row in enumerate(rewards)]


def test_evaluation_counts_whole_groups_without_failures(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n{"q": 2}\n{"q": 3}\n{"q": 4}\n')
    args.eval_prompt_data = ["arith", str(path)]
    groups = eval_items("e", [[1, 0], [1, -1], [0, 0], [1]])  # a failure, and a group that came back short
    connect(FakeBuffer({"eval-arith": [[[item for g in groups for item in g]]]}))
    output = slime_rollout.generate_rollout(args, 3, RolloutDataSourceWithBuffer(args), evaluation=True)
    result = output.data["arith"]
    assert result["rewards"] == [1, 0, 0, 0]
    assert [s.group_index for s in result["samples"]] == [0, 0, 1, 1]
    assert [s.index for s in result["samples"]] == [0, 1, 2, 3]
    assert output.metrics["eval/arith-failed_samples"] == 1
    assert output.metrics["eval/arith-dropped_groups"] == 2
    logged = log_eval_rollout_data(3, args, output.data, output.metrics)
    assert logged["eval/arith"] == 0.25
    assert logged["eval/arith-pass@2"] == 0.5


def test_an_evaluation_that_gives_nothing_is_left_out(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["empty", str(path)]
    connect(FakeBuffer({"eval-empty": [[eval_items("e", [[-1, -1]])[0]]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    assert output.data == {}
    logged = log_eval_rollout_data(0, args, output.data, output.metrics)
    assert logged["eval/empty-failed_samples"] == 2


def test_the_eval_config_sets_each_data_sets_run(args: SimpleNamespace, connect: Any, tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["ignored", "not/read.jsonl"]  # slime's --eval-config overrides it
    args.eval_datasets = [
        SimpleNamespace(
            name="hard",
            path=str(path),
            n_samples_per_eval_prompt=3,
            temperature=0.6,
            top_p=0.95,
            top_k=20,
            max_response_len=128,
            stop=None,
            apply_chat_template_kwargs={"enable_thinking": False},
        )
    ]
    args.n_samples_per_eval_prompt = 3
    buffer = connect(FakeBuffer({"eval-hard": [[eval_items("h", [[1, 0, 1]])[0]]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    (start,) = buffer.starts
    assert (start["rollout_name"], start["input_file"], start["num_repeat_per_sample"]) == (
        "eval-hard",
        str(path),
        "3",
    )
    assert start["sampling_params"] == {
        "max_tokens": 128,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert output.data["hard"]["rewards"] == [1, 0, 1]


def test_a_failed_trajectory_is_told_by_the_reward_generators_write() -> None:
    assert slime_samples.FAILURE_REWARD == default_func.FAILURE_REWARD


def test_each_data_set_has_one_eval_task_and_a_branched_trajectory_counts_every_branch(
    args: SimpleNamespace, connect: Any, tmp_path: Path
) -> None:
    """Issue 21, item 10: evaluations reuse one task per data set (nothing left behind per
    rollout id), drop what an earlier one left ready, and count every branch's tokens."""
    path = tmp_path / "eval.jsonl"
    path.write_text('{"q": 1}\n')
    args.eval_prompt_data = ["arith", str(path)]
    first = eval_items("e", [[1, 0]])[0]
    first[1] = branched(first[1])
    second = eval_items("f", [[0, 0]])[0]
    buffer = connect(FakeBuffer({"eval-arith": [[first], [second]]}))
    output = slime_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    merged = output.data["arith"]["samples"][1]
    assert merged.tokens == [5, 6, 7, 8, 11]
    assert merged.loss_mask == [1, 1, 1]
    assert merged.response_length == 3
    buffer.queues["eval-arith"] = [eval_items("x", [[1, 1]])[0]]  # left ready by the first
    output = slime_rollout.generate_rollout(args, 1, RolloutDataSourceWithBuffer(args), evaluation=True)
    assert {start["rollout_name"] for start in buffer.starts} == {"eval-arith"}
    assert output.data["arith"]["rewards"] == [0, 0]
