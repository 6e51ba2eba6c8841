"""The store contract (``buffer.store.base.Store``): what every backend must do, run on each.

One fixture, ``backend``, over every backend: ``sqlite`` (a data folder in a tmp folder) and
``memory``. A new backend is one more entry there, and passes these tests before the service
may use it. The tests run at the interface (records, reads and their export, counters) and
through ``RolloutBuffer``, where a "restart" is closing the store and restoring a new buffer
from the same data: a new ``Journal`` on the folder, the same ``MemoryStore`` object.
What only one backend does (SQLite's WAL, damaged files, ``check --repair``, the migration)
is tested in that backend's own file.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer.core.hooks import Hooks
from buffer.core.records import decode, encode
from buffer.core.task import TaskSettings
from buffer.errors import InvalidInput, StorageFailed
from buffer.store import export
from buffer.store import sqlite as sqlite_store
from buffer.store.base import Counters, Store
from buffer.store.memory import MemoryStore
from buffer.store.sqlite import Journal
from tests.support.factories import FakeClock, group, trajectory
from tests.support.stores import Opened, fill, state


@dataclass
class Backend:
    name: str
    #: A store over this test's data, for the next buffer: on the first call with ``options``.
    make: Callable[..., Store]
    #: While entered, the store cannot keep anything (None: the backend cannot be made to fail).
    failing: Callable[[], contextlib.AbstractContextManager[None]] | None = None


def sqlite_backend(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    @contextlib.contextmanager
    def failing() -> Iterator[None]:
        """Every commit raises a full disk until the block ends; then the writer's next try
        (every 50 ms) succeeds."""
        on = threading.Event()
        on.set()
        commit = Journal._commit

        def failing_commit(journal: Journal, batch: list[Any], first: int) -> None:
            if on.is_set():
                raise OSError(28, "No space left on device")
            commit(journal, batch, first)

        monkeypatch.setattr(sqlite_store, "RETRY_INTERVAL_S", 0.05)
        monkeypatch.setattr(Journal, "_commit", failing_commit)
        try:
            yield
        finally:
            on.clear()

    return Backend("sqlite", lambda **options: Journal(folder, sync=False, **options), failing)


def memory_backend() -> Backend:
    stores: list[MemoryStore] = []

    def make(**options: Any) -> Store:
        if not stores:
            stores.append(MemoryStore(**options))
        return stores[0]

    return Backend("memory", make)


@pytest.fixture(params=["sqlite", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    if request.param == "sqlite":
        return sqlite_backend(tmp_path / "data", monkeypatch)
    return memory_backend()


@pytest.fixture
def restart(backend: Backend, clock: FakeClock) -> Iterator[Callable[..., Opened]]:
    """Close the buffer open (if any) and open a new one on the same data, as a restart does."""
    opened: list[Opened] = []

    def restart_(**options: Any) -> Opened:
        for service in opened:  # one buffer at a time
            service.close()
        opened.append(Opened(backend.make(**options), clock))
        return opened[-1]

    yield restart_
    for service in opened:
        service.close()


def started(store: Store) -> Store:
    """A store taking appends, with nothing restored (the interface alone)."""
    for _ in store.recover():
        pass
    store.start()
    return store


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the interface -------------------------------------------------------------------------


def test_records_come_back_in_the_order_they_were_appended(backend: Backend) -> None:
    store = started(backend.make())
    records = [encode({"e": "w", "i": i}, [b"x" * i, b'{"y":1}']) for i in range(50)]
    records.append(encode({"e": "dup"}))
    for record in records:
        store.append(record)
    assert store.position() == 51
    store.wait_durable_blocking(5)
    store.close()
    again = backend.make()
    events = list(again.recover())
    assert events == [decode(record) for record in records]
    assert events[7].parts() == [b"x" * 7, b'{"y":1}']
    assert again.position() == 51
    again.close()


def test_a_read_and_its_export_rows_are_kept_together(backend: Backend) -> None:
    store = started(backend.make())
    now = time.time()
    rows = [(1, now, "math", "q1", b'{"a":1}'), (1, now, "math", "q1", b'{"a":2}')]
    undone: list[int] = []
    store.read(encode({"e": "read", "id": 1}), lambda: rows, lambda: undone.append(1))
    store.wait_durable_blocking(5)
    assert list(store.exported()) == rows
    store.close()
    again = backend.make()
    assert [event.header for event in again.recover()] == [{"e": "read", "id": 1}]
    assert list(again.exported()) == rows
    assert undone == []  # kept: never taken back
    again.close()


def test_the_export_is_filtered_by_time_and_task_oldest_first(backend: Backend) -> None:
    store = started(backend.make())
    at = time.time() - 100
    for read_id, task_type in enumerate(["math", "code", "math"], 1):
        row = (read_id, at + read_id, task_type, f"q{read_id}", b"{}")
        store.read(encode({"e": "read", "id": read_id}), lambda row=row: [row], lambda: None)
    store.wait_durable_blocking(5)

    def ids(**bounds: Any) -> list[int]:
        return [row[0] for row in store.exported(**bounds)]

    assert ids() == [1, 2, 3]
    assert ids(since=at + 2) == [2, 3]
    assert ids(until=at + 3) == [1, 2]
    assert ids(task_type="math") == [1, 3]
    assert ids(since=at + 2, task_type="math") == [3]
    store.close()


def test_exports_past_the_retention_are_dropped(backend: Backend) -> None:
    store = started(backend.make(retention_s=3600))
    now = time.time()
    store.read(encode({"e": "read", "id": 1}), lambda: [(1, now - 7200, "t", "old", b"{}")], lambda: None)
    store.read(encode({"e": "read", "id": 2}), lambda: [(2, now, "t", "new", b"{}")], lambda: None)
    store.wait_durable_blocking(5)
    assert [row[3] for row in store.exported()] == ["new"]
    store.close()


def test_an_infinite_export_retention_is_refused(backend: Backend) -> None:
    with pytest.raises(ValueError, match="finite"):
        backend.make(retention_s=math.inf)


def test_one_store_serves_one_buffer_at_a_time(backend: Backend) -> None:
    store = started(backend.make())
    with pytest.raises(RuntimeError, match="in use by another rollout buffer"):
        list(backend.make().recover())
    store.close()
    started(backend.make()).close()  # once closed, the next may


def test_counters_say_what_was_kept(restart: Callable[..., Opened]) -> None:
    service = restart()
    empty = service.store.counters()
    assert set(empty) == Counters.__required_keys__
    assert empty["failed"] is None
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.store.wait_durable_blocking(5)
    counters = service.store.counters()
    assert counters["bytes_written"] > empty["bytes_written"]
    assert counters["commits"] > empty["commits"]
    assert counters["bytes_since_snapshot"] > 0
    assert service.buffer.stats()["journal"] == service.store.counters()
    service.store.compact()
    service.store.wait_durable_blocking(5)
    assert service.store.counters()["compactions"] == 1
    service.close()
    assert service.store.counters()["failed"]  # closed: it keeps nothing more


# -- through the buffer ---------------------------------------------------------------------


def test_a_restart_restores_everything_a_client_can_see(
    restart: Callable[..., Opened], clock: FakeClock
) -> None:
    first = restart()
    fill(first.buffer, clock)
    before = state(first.buffer)
    second = restart()
    assert second.restored > 0
    assert state(second.buffer) == before
    assert second.buffer.crashes_if_resumed("custom") == 0  # paused by a clean stop
    assert second.buffer.crashes_if_resumed("math") == 1
    # and it goes on the same way: the next read returns the same groups and statistics
    assert second.buffer.read().meta_info == first.buffer.read().meta_info


def test_a_group_delivered_is_never_delivered_again(restart: Callable[..., Opened]) -> None:
    first = restart()
    for i in range(4):
        first.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
    delivered = [g.instance_id for g in first.buffer.read(max_items=8).groups]
    second = restart()
    remaining = [g.instance_id for g in second.buffer.read().groups]
    assert delivered == ["q0", "q1"]
    assert remaining == ["q2", "q3"]
    assert restart().buffer.read().groups == []


def test_finished_groups_not_yet_reported_survive_a_restart(
    restart: Callable[..., Opened], clock: FakeClock
) -> None:
    first = restart()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.buffer.read()
    first.buffer.write(trajectory("q2", 1))
    clock.advance(120)  # q2 times out, too small: discarded, to be reported with the next read
    first.buffer.expire()
    first.buffer.write_many(group("q3", [0, 1, 0, 1]))
    meta = restart().buffer.read().meta_info
    assert meta["finished_groups"] == ["q2", "q3"]
    assert meta["discarded_groups"] == {"timeout_too_small": 1}


def test_an_open_group_keeps_its_age_across_a_restart(
    restart: Callable[..., Opened], clock: FakeClock
) -> None:
    first = restart()
    first.buffer.write_many(group("q1", [1, 1, 1]))
    clock.advance(50)
    second = restart()
    second.buffer.expire()
    assert second.buffer.stats()["pending_items"] == 3  # 50 s of 60: still open
    clock.advance(11)
    second.buffer.expire()
    assert second.buffer.stats()["pending_items"] == 0


def test_retried_writes_are_recognised_after_a_restart(restart: Callable[..., Opened]) -> None:
    items = group("q1", [0, 1, 0, 1])
    restart().buffer.write_many(items[:2])
    second = restart()
    results = second.buffer.write_many(items)
    assert [r.duplicate for r in results] == [True, True, False, False]
    assert len(second.buffer.read().groups[0].items) == 4


def test_reads_are_exported_with_their_time_and_read_id(
    restart: Callable[..., Opened], clock: FakeClock
) -> None:
    service = restart()
    service.buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    service.buffer.write_many(group("q1", [0, 1], task_type="math"))
    service.buffer.write_many(group("q2", [1, 1, 0, 0], task_type="default"))
    first = service.buffer.read("math")
    clock.advance(1)
    second = service.buffer.read("default")
    service.store.wait_durable_blocking(5)
    lines = [orjson.loads(line) for chunk in export.read(service.store) for line in chunk.splitlines()]
    assert [(x["read_id"], x["task_type"], x["instance_id"]) for x in lines] == [
        (1, "math", "q1"),
        (1, "math", "q1"),
        *[(2, "default", "q2")] * 4,
    ]
    delivered = [orjson.loads(item) for result in (first, second) for g in result.groups for item in g.items]
    assert [x["trajectory"] for x in lines] == delivered
    since = lines[2]["delivered_at"]
    later = b"".join(export.read(service.store, since=since))
    assert [orjson.loads(line)["read_id"] for line in later.splitlines()] == [2, 2, 2, 2]
    only_math = b"".join(export.read(service.store, task_type="math"))
    assert len(only_math.splitlines()) == 2
    assert b"".join(export.read(restart().store)) == b"".join(export.read(service.store))  # kept


def test_a_change_is_kept_once_its_wait_returns(restart: Callable[..., Opened]) -> None:
    service = restart()

    async def write_and_wait() -> None:
        service.buffer.write_many(group("q1", [0, 1, 0, 1]))
        await service.buffer.wait_durable()

    asyncio.run(write_and_wait())
    service.buffer.write(trajectory("q2", 1.0))
    service.store.wait_durable_blocking(5)  # the same, for a thread
    assert restart().kinds() == ["task", "w", "w", "w", "w", "fin", "w"]


def test_compaction_keeps_the_state(restart: Callable[..., Opened], clock: FakeClock) -> None:
    first = restart()
    fill(first.buffer, clock)
    first.store.compact()
    first.buffer.write(trajectory("after", 1.0, task_type="math"))  # after the snapshot
    first.store.wait_durable_blocking(5)
    before = state(first.buffer)
    second = restart()
    assert state(second.buffer) == before
    assert "state" in second.kinds()  # the snapshot's records, replayed...
    assert second.kinds().count("w") == 1  # ...and after them only the write that followed
    second.store.compact()  # a snapshot of a restored buffer restores the same again
    second.store.wait_durable_blocking(5)
    assert state(restart().buffer) == before


def test_compaction_runs_by_itself_as_the_log_grows(restart: Callable[..., Opened]) -> None:
    service = restart(compact_bytes=64 * 1024)
    for i in range(200):  # ~1 KB a trajectory, 4 a group: well past 64 KB
        service.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
        if i % 50 == 49:
            service.buffer.read()
    service.store.wait_durable_blocking(5)
    wait_until(lambda: service.store.counters()["compactions"] >= 1)
    service.store.wait_durable_blocking(5)
    before = state(service.buffer)
    assert state(restart().buffer) == before


def test_what_could_not_be_read_back_is_refused_before_anything_changes(
    restart: Callable[..., Opened],
) -> None:
    service = restart()
    with pytest.raises(InvalidInput, match="finite"):
        service.buffer.configure_task("math", TaskSettings(group_size=2, group_timeout_s=math.nan), Hooks())
    assert not service.buffer.has_task("math")
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    assert [g.instance_id for g in restart().buffer.read().groups] == ["q1"]  # it still starts


def test_a_closed_store_refuses_changes_and_keeps_none_after(restart: Callable[..., Opened]) -> None:
    first = restart()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.close()
    assert first.store.failure is not None
    with pytest.raises(StorageFailed):
        first.buffer.write(trajectory("q2", 1.0))  # refused before anything changes
    first.store.append(encode({"e": "dup"}))  # a straggler appending anyway...
    with pytest.raises(StorageFailed):
        first.store.wait_durable_blocking(5)  # ...is told it was not kept
    second = restart()
    assert second.store.failure is None
    assert second.buffer.stats()["duplicates"] == 0
    assert [g.instance_id for g in second.buffer.read().groups] == ["q1"]


def test_a_read_the_store_cannot_keep_is_taken_back(backend: Backend, restart: Callable[..., Opened]) -> None:
    if backend.failing is None:
        pytest.skip(f"{backend.name} keeps every change as it is made: it cannot fail")
    service = restart()
    for name in ("q1", "q1", "q2"):  # a second group of q1: the read passes it over
        service.buffer.write_many(group(name, [0, 1, 0, 1]))
    service.store.wait_durable_blocking(5)
    before = state(service.buffer)
    queue = [(g.instance_id, g.seq) for g in service.buffer._tasks["default"].ready]
    with backend.failing():
        assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2"]
        with pytest.raises(StorageFailed):
            service.store.wait_durable_blocking(5)  # the reader gets a 503...
        assert state(service.buffer) == before  # ...and the read is as if it had never been
        assert [(g.instance_id, g.seq) for g in service.buffer._tasks["default"].ready] == queue
        assert service.buffer.buffered_items() == 12
        assert service.store.failure is not None
    wait_until(lambda: service.store.failure is None)
    restarted = restart()
    assert state(restarted.buffer) == before
    assert list(restarted.store.exported()) == []  # never exported
