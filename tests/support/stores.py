"""A buffer over a store, opened and closed as the service opens them, and everything a client
can see of it: what the store tests (``tests/store``) share."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from buffer.core import reads
from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE, Hooks, bind_hooks
from buffer.core.records import Event
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.store.base import Store
from buffer.store.sqlite import Journal
from tests.support.factories import FakeClock, group, trajectory

WALL_BASE = time.time() - 1000  # the fake clock's wall time: now, so the export retention keeps it
CUSTOM_META = bind_hooks({"get_group_data_meta_info": lambda temp_data: {"instances": sorted(temp_data)}})
FAILING = bind_hooks({"normalize_group_data": lambda group, *args: 1 / 0})


def hooks_for(source: str) -> Hooks:
    """What the generator registry would give for each generator name."""
    return {"custom": CUSTOM_META, "broken": FAILING}.get(source, Hooks())


class Opened:
    """A buffer restored from ``store`` and keeping its changes there, as the service starts
    one (``buffer.service.app``); ``events`` are the records it was restored from."""

    def __init__(self, store: Store, clock: FakeClock) -> None:
        self.store = store
        self.buffer = RolloutBuffer(
            TaskSettings(group_size=4, group_timeout_s=60),
            clock=clock,
            wall_clock=lambda: clock.now + WALL_BASE,
            hooks_for=hooks_for,
        )
        try:
            self.events: list[Event] = list(store.recover())
            self.restored = self.buffer.restore(self.events)
            self.buffer.attach(store)
        except BaseException:
            store.close()
            raise

    def kinds(self) -> list[str]:
        return [event.header["e"] for event in self.events]

    def close(self) -> None:
        self.store.close()

    def stop(self) -> None:
        """Close once everything written is on disk, as the service stops cleanly."""
        self.store.wait_durable_blocking(5)
        self.close()


def on_journal(directory: Path, clock: FakeClock) -> Opened:
    """A buffer started on the data folder ``directory`` (a ``Journal``, unsynced: a test's)."""
    return Opened(Journal(directory, sync=False), clock)


def state(buffer: RolloutBuffer) -> dict[str, Any]:
    """Everything a client can observe, without changing it."""
    tasks = buffer._tasks
    stats = buffer.stats()
    for counters in stats["tasks"].values():  # the trainer's lag is counted afresh by each process
        del counters["served_age_s_sum"], counters["served_age_count"]
    return {
        "stats": {**stats, "journal": None},  # the store's own counters start afresh
        "ready": [(g.task_type, g.instance_id, g.seq, g.items) for g in buffer.peek()],
        "open": {
            name: [(g.instance_id, g.size, [r.uid for r in g.records]) for g in task.open.values()]
            for name, task in tasks.items()
        },
        "set_aside": [(g.task_type, g.instance_id, g.hook, g.items) for g in buffer.set_aside()],
        "meta": reads.meta_info(list(tasks.values())),
        "finished": {name: list(task.finished_instance_ids) for name, task in tasks.items()},
        "window_discarded": {name: dict(task.window_discarded) for name, task in tasks.items()},
        "settings": {name: (task.settings, task.hooks_source, task.hooks) for name, task in tasks.items()},
        "current": buffer.current_task,
        "recent": list(buffer.recent),
        "reads": buffer.reads,
        "jobs": buffer.jobs,
    }


def fill(buffer: RolloutBuffer, clock: FakeClock) -> None:
    """A buffer with a bit of everything: two tasks, ready, open, delivered, discarded and
    set-aside groups, a duplicate, a dict reward, a custom meta hook, reads with windows, jobs."""
    buffer.configure_task("math", TaskSettings(group_size=2, reward_key="acc"), Hooks())
    buffer.configure_task(
        "eval", TaskSettings(group_size=2), EVALUATION_HOOKS, hooks_source=EVALUATION_SOURCE
    )
    buffer.configure_task("broken", TaskSettings(group_size=1), FAILING)
    buffer.configure_task("custom", TaskSettings(group_size=2), CUSTOM_META)
    for i in range(3):
        buffer.write_many(group(f"m{i}", [{"acc": 0.0}, {"acc": 1.0}], task_type="math"))
    buffer.read("math", max_items=2)  # m0 delivered; m1, m2 ready
    buffer.write(trajectory("m9", {"acc": 1.0}, task_type="math"))  # open
    duplicate = trajectory("e1", 1.0, task_type="eval")
    buffer.write(duplicate)
    buffer.write(duplicate)
    buffer.write(trajectory("e1", 0.0, task_type="eval"))
    buffer.write(trajectory("b1", 1.0, task_type="broken"))  # set aside: its hook raises
    buffer.write(trajectory("late", 1.0, task_type="math"))
    clock.advance(30)
    buffer.write(trajectory("fresh", 1.0, task_type="math"))
    buffer.configure_task("math", TaskSettings(group_size=2, group_timeout_s=40, reward_key="acc"), Hooks())
    clock.advance(15)
    buffer.expire()  # m9 and late time out (45 s > 40 s): too small, discarded; fresh stays open
    buffer.write_many(group("c1", [0.0, 1.0], task_type="custom"))
    buffer.write(trajectory("c2", 0.0, task_type="custom"))
    buffer.write(trajectory(7, 0.5))  # the current task, with an integer instance id
    buffer.job_started("math", "math", {"task_type": "math", "num_repeat_per_sample": 2})
    buffer.job_started("eval", "math", {"task_type": "eval"})
    buffer.job_ended("eval")
    buffer.job_started("custom", "custom", {"task_type": "custom"})
    buffer.job_paused("custom")  # a clean stop: resumed after the restart


@contextlib.contextmanager
def opened(directory: Path, clock: FakeClock, **options: Any) -> Iterator[Opened]:
    """A buffer over the data folder ``directory`` (a ``Journal`` with ``options``), closed on leaving."""
    service = Opened(Journal(directory, **options), clock)
    try:
        yield service
    finally:
        service.close()


def journal(service: Opened) -> Journal:
    assert isinstance(service.store, Journal)
    return service.store


def tear_last_commit(wal: Path) -> None:
    """Cut the WAL short 10 bytes before the end of its last commit, as a crash while that
    commit was being written leaves it. The last commit is not always at the file's end: once
    a checkpoint has copied every frame, the next commit starts the WAL again from its start
    (new salts), and the frames after it are left from before."""
    data = wal.read_bytes()
    page_size = struct.unpack_from(">I", data, 8)[0]
    salts = data[16:24]
    frame_size = 24 + page_size
    end = None
    for offset in range(32, len(data) - frame_size + 1, frame_size):
        if data[offset + 8 : offset + 16] != salts:
            break  # frames of the WAL before it started again
        if struct.unpack_from(">I", data, offset + 4)[0]:  # the last frame of a commit
            end = offset + frame_size
    assert end is not None, f"{wal} holds no commit"
    os.truncate(wal, end - 10)
