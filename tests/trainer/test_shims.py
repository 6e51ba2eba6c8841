"""The old import paths users' code and slime configs name still reach the same objects."""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.support.paths import SLIME_STUB


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("buffer.client", "buffer.trainer.client", "RolloutBufferClient"),
        ("buffer.samples", "buffer.trainer.samples", "SampleConverter"),
        ("buffer.wandb_reads", "buffer.trainer.wandb_reads", "WandbReads"),
    ],
)
def test_an_old_path_gives_the_moved_object_itself(old: str, new: str, name: str) -> None:
    moved = importlib.import_module(new)
    shim = importlib.import_module(old)
    assert getattr(shim, name) is getattr(moved, name)
    assert set(shim.__all__) == set(moved.__all__)


def test_slime_configs_naming_buffer_slime_rollout_keep_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--rollout-function-path buffer.slime_rollout.generate_rollout`` is in users' slime configs."""
    monkeypatch.syspath_prepend(str(SLIME_STUB))
    shim = importlib.import_module("buffer.slime_rollout")
    moved = sys.modules["buffer.trainer.slime_rollout"]
    assert shim.generate_rollout is moved.generate_rollout
    assert shim.normalize_rewards_by_group is moved.normalize_rewards_by_group
