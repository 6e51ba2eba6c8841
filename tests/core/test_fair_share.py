"""--max-buffered-trajectories shared fairly: one task's flood never locks another's new groups out."""

from __future__ import annotations

import pytest

from buffer.core.hooks import Hooks
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.errors import BufferFull
from tests.support.factories import group


def two_tasks(max_buffered: int) -> RolloutBuffer:
    buffer = RolloutBuffer(max_buffered=max_buffered)
    for name in ("flood", "quiet"):
        buffer.configure_task(name, TaskSettings(group_size=2), Hooks())
    return buffer


def write_group(buffer: RolloutBuffer, task: str, instance_id: str) -> None:
    buffer.write_many([{**item, "task_type": task} for item in group(instance_id, [0.0, 1.0])])


def test_a_full_buffer_takes_a_task_under_its_share_and_refuses_the_flooding_one() -> None:
    buffer = two_tasks(max_buffered=8)
    for i in range(4):  # the flood fills the whole buffer
        write_group(buffer, "flood", f"f{i}")
    with pytest.raises(BufferFull):
        write_group(buffer, "flood", "f4")
    write_group(buffer, "quiet", "q0")  # under its share (8 / 2 tasks): taken
    write_group(buffer, "quiet", "q1")
    assert buffer.buffered_items() == 12
    with pytest.raises(BufferFull):  # past its share now, and the buffer full
        write_group(buffer, "quiet", "q2")
    with pytest.raises(BufferFull):
        write_group(buffer, "flood", "f4")
    assert buffer.stats()["refused_full"] == 3


def test_one_task_alone_still_stops_at_the_limit() -> None:
    buffer = two_tasks(max_buffered=4)
    write_group(buffer, "quiet", "q0")
    write_group(buffer, "quiet", "q1")
    with pytest.raises(BufferFull):
        write_group(buffer, "quiet", "q2")
