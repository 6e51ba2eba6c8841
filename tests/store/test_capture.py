"""A compaction's capture of the buffer's state (``RolloutBuffer.snapshot``, ``core.open_table``):
the lock is held for O(1) per task, the records are made outside it, writes and reads go on
meanwhile, and the state after a restart is the one without a compaction, whole or a delta."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from buffer.core import open_table
from buffer.core import snapshots as core_snapshots
from buffer.core.hooks import Hooks
from buffer.core.records import Piece
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.store import snapshot_table
from buffer.store.sqlite import Journal
from tests.support.factories import FakeClock, trajectory
from tests.support.stores import Opened, state


def item(instance_id: Any, n: int, task_type: str = "default") -> dict[str, Any]:
    return trajectory(instance_id, float(n % 2), uid=f"{instance_id}-{n}", task_type=task_type)


def prepare(buffer: RolloutBuffer) -> None:
    """Open groups (one past 64 records, kept as a list), ready ones, one delivered."""
    buffer.configure_task("big", TaskSettings(group_size=100, group_timeout_s=60), Hooks())
    for n in range(70):
        buffer.write(item("wide", n, task_type="big"))
    for i in range(40):
        buffer.write(item(f"q{i}", 0))
    for i in range(40, 44):
        buffer.write_many([item(f"q{i}", n) for n in range(4)])  # ready
    buffer.read("default", max_items=4)


def changes(buffer: RolloutBuffer, clock: FakeClock) -> None:
    """What a capture is taken across: groups written to again, finished, opened, timed out."""
    buffer.write(item("wide", 70, task_type="big"))  # its list grows: the captured one must not
    for i in range(0, 10):
        buffer.write_many([item(f"q{i}", n) for n in range(1, 4)])  # full: ready
    for i in range(10, 20):
        buffer.write(item(f"q{i}", 1))  # moved to the newest
    clock.advance(45)
    for i in range(20, 25):
        buffer.write(item(f"q{i}", 1))
    buffer.write(item("new", 0))
    clock.advance(20)  # q25..q39 (and q10..q19? no: written 20 s ago) time out
    buffer.expire()
    buffer.read("default", max_items=8)
    buffer.write(item("wide", 71, task_type="big"))


def run(
    directory: Path,
    clock: FakeClock,
    *,
    compact_during: bool,
    monkeypatch: pytest.MonkeyPatch,
    delta: bool = False,
) -> Any:
    """The state after ``changes``, live and after a restart; with ``compact_during`` the
    changes are made while a compaction has captured the state and read 3 of its pieces (with
    ``delta``, of what changed since a first compaction)."""
    stage = snapshot_table.Staging.stage
    reading, go = threading.Event(), threading.Event()
    staged: list[snapshot_table.Staged] = []

    def held(staging: snapshot_table.Staging, pieces: Iterable[Piece]) -> snapshot_table.Staged:
        if delta and not staged:  # the first compaction, before the changes
            staged.append(stage(staging, pieces))
            return staged[-1]
        pieces = iter(pieces)
        first = list(itertools.islice(pieces, 3))
        reading.set()
        assert go.wait(60)
        staged.append(stage(staging, itertools.chain(first, pieces)))
        return staged[-1]

    monkeypatch.setattr(snapshot_table.Staging, "stage", held)
    service = Opened(Journal(directory), clock)
    try:
        prepare(service.buffer)
        store = service.store
        assert isinstance(store, Journal)
        store.wait_durable_blocking(60)
        if delta:
            store.compact()
            store.wait_durable_blocking(60)
            service.buffer.write(item("q0", 1))  # after it: a change the delta has
        compaction = threading.Thread(target=store.compact)
        if compact_during:
            compaction.start()
            assert reading.wait(60), "the compaction never captured the state"
        done = threading.Thread(target=changes, args=(service.buffer, clock))  # the lock is free
        done.start()
        done.join(60)
        assert not done.is_alive(), "the changes waited on the capture"
        go.set()
        if compact_during:
            compaction.join(60)
            store.wait_durable_blocking(60)
            assert store.compactions == 1 + delta
            assert [s.full for s in staged] == [True, False][: 1 + delta] if delta else [True]
        live = state(service.buffer)
    finally:
        go.set()
        service.close()
    restarted = Opened(Journal(directory), clock)
    try:
        if compact_during:
            assert restarted.kinds()[0] == "task"  # from the snapshot
        return live, state(restarted.buffer)
    finally:
        restarted.close()


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
def test_changes_during_a_capture_end_in_the_same_state_as_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta: bool
) -> None:
    monkeypatch.setattr(open_table, "FOLD_SLICE", 3)  # folded back in many slices
    without_live, without_restarted = run(
        tmp_path / "without", FakeClock(), compact_during=False, monkeypatch=monkeypatch, delta=delta
    )
    during_live, during_restarted = run(
        tmp_path / "during", FakeClock(), compact_during=True, monkeypatch=monkeypatch, delta=delta
    )
    assert without_restarted == without_live
    assert during_live == without_live
    assert during_restarted == without_live
    assert [len(groups) for groups in during_live["open"].values()] == [1, 6]  # some of everything
    assert len(during_live["ready"]) == 12


class CountingLock:
    """The buffer's lock, counting how often it is taken and telling whether it is held."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = threading.local()
        self.holds = 0

    def held(self) -> bool:
        return getattr(self._depth, "n", 0) > 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken:
            self._depth.n = getattr(self._depth, "n", 0) + 1
            self.holds += self._depth.n == 1
        return taken

    def release(self) -> None:
        self._depth.n -= 1
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_the_capture_makes_no_record_under_the_lock_and_folds_back_in_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=4, group_timeout_s=60), clock=clock)
    lock = CountingLock()
    buffer._lock = lock  # type: ignore[assignment]  # the hook: every hold counted
    journal = Journal(tmp_path / "data")
    buffer.restore(journal.recover())
    buffer.attach(journal)
    try:
        for i in range(50):
            buffer.write(item(f"q{i}", 0))
        views: list[bool] = []  # for each group a snapshot looks at: whether under the lock
        view: Callable[[Any], Any] = core_snapshots._view

        def counted(group: Any) -> Any:
            views.append(lock.held())
            return view(group)

        monkeypatch.setattr(core_snapshots, "_view", counted)
        monkeypatch.setattr(open_table, "FOLD_SLICE", 4)
        holds = lock.holds
        capture = buffer.snapshot()
        position, records = capture.position, (piece.record for piece in capture.pieces)
        assert lock.holds - holds == 2  # one fold (nothing to fold), one capture
        assert not lock.held()
        for i in range(30):
            buffer.write(item(f"q{i}", 1))  # meanwhile: 30 groups replaced, 30 written anew
        holds = lock.holds
        kept: Iterator[bytes | None] = iter(records)
        encoded = list(kept)
        assert views == [False] * 50  # every group made into a record outside the lock
        # the task, its open groups, its window's instances, its state, the uids, the buffer's
        assert len(encoded) == 1 + 50 + 1 + 1 + 1 + 1
        assert lock.holds - holds >= 1 + 60 // 4  # the release, then the fold: 60 changes, 4 a slice
        assert [group.instance_id for group in buffer._tasks["default"].open.values()] == [
            *(f"q{i}" for i in range(30, 50)),
            *(f"q{i}" for i in range(30)),
        ]
        assert position <= journal.position()
    finally:
        journal.close()


def test_a_capture_dropped_unread_is_released_and_the_next_one_taken(
    tmp_path: Path, clock: FakeClock
) -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=4, group_timeout_s=60), clock=clock)
    journal = Journal(tmp_path / "data")
    buffer.restore(journal.recover())
    buffer.attach(journal)
    try:
        buffer.write(item("q1", 0))
        records = buffer.snapshot().pieces
        buffer.write(item("q1", 1))
        with pytest.raises(RuntimeError, match="being read"):
            buffer.snapshot()
        del records  # a compaction that failed before reading it
        buffer.write(item("q2", 0))
        again = buffer.snapshot().pieces
        assert sum(1 for piece in again if piece.record and b'"open"' in piece.record) == 2
    finally:
        journal.close()
