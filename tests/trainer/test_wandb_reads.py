"""W&B logging of each read's meta_info, against a stand-in ``wandb`` module (no network)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from buffer.trainer.wandb_reads import WandbReads, flatten


class StandInRun:
    def __init__(self, **init_kwargs: Any) -> None:
        self.init_kwargs = init_kwargs
        self.logged: list[tuple[dict[str, float], int | None]] = []
        self.finished = False

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def wandb(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.run = None  # type: ignore[attr-defined]
    module.init = lambda **kwargs: StandInRun(**kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


META = {
    "total_samples": 8,
    "num_groups": 2,
    "avg_reward": 0.5,
    "reward_std": 0.53,
    "finished_groups": ["q1", "q2"],
    "tasks": {"math": {"avg_reward": 0.25, "total_samples": 4}, "code": {"avg_reward": 0.75, "note": "x"}},
}


def test_flatten_keeps_numbers_nests_tasks_and_counts_lists() -> None:
    assert flatten(META) == {
        "rollout_buffer/total_samples": 8,
        "rollout_buffer/num_groups": 2,
        "rollout_buffer/avg_reward": 0.5,
        "rollout_buffer/reward_std": 0.53,
        "rollout_buffer/finished_groups_count": 2,
        "rollout_buffer/tasks/math/avg_reward": 0.25,
        "rollout_buffer/tasks/math/total_samples": 4,
        "rollout_buffer/tasks/code/avg_reward": 0.75,
    }


def test_each_read_is_logged_at_the_trainers_step_and_an_empty_read_is_not(wandb: types.ModuleType) -> None:
    reads = WandbReads(project="rl", name="run-1")
    run = reads.run
    assert isinstance(run, StandInRun)
    assert run.init_kwargs == {"project": "rl", "name": "run-1"}
    reads.log(META, step=3)
    reads.log({"total_samples": 0, "num_groups": 0, "avg_reward": 0}, step=4)  # nothing was ready
    reads.log(META, step=5)
    assert [step for _, step in run.logged] == [3, 5]
    assert run.logged[1][0]["rollout_buffer/reads"] == 2
    assert run.logged[0][0]["rollout_buffer/avg_reward"] == 0.5
    reads.finish()
    assert run.finished


def test_a_read_draining_a_backlog_logs_what_it_served_not_zeros(wandb: types.ModuleType) -> None:
    reads = WandbReads(project="rl")
    served = {"total_samples": 8, "num_groups": 2, "avg_reward": 0.625}
    logged = reads.log({"total_samples": 0, "avg_reward": 0, "served": served}, step=7)
    assert logged["rollout_buffer/served/avg_reward"] == 0.625
    assert "rollout_buffer/avg_reward" not in logged  # slime's figure: nothing written since


def test_the_trainers_own_run_is_used_and_left_open(wandb: types.ModuleType) -> None:
    trainer_run = StandInRun()
    wandb.run = trainer_run  # type: ignore[attr-defined]
    reads = WandbReads()
    reads.log(META)
    assert trainer_run.logged[0][1] is None
    reads.finish()
    assert not trainer_run.finished


def test_without_wandb_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rollout-buffer\[wandb\]'"):
        WandbReads()
