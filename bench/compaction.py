"""Durable writes through compactions of a large store: the write latency while a compaction of
a million trajectories is staged, installed and cleaned up, and the folder's size against what
it holds (issue 26).

1. A store (``--data-dir``'s SQLite journal, ``--durability sync``) is filled with ``--fill``
   small trajectories (default 1,000,000 of ~``--size`` bytes), in-process through the buffer's
   bulk path (``write_many`` in batches of 1,000, one commit each), and compacted once, so it
   starts as a service restarted on a large folder would: a snapshot and few events.
2. ``--writers`` threads (16) each write one trajectory at a time and wait until it is durable
   (``wait_durable_blocking``, what an acknowledged ``POST /buffer/write`` waits for), while a
   thread runs ``--compactions`` compactions one after the other (the journal's own, as the
   writer starts them when the log grows; by hand here so that a run needs minutes, not
   hours). The run ends when the last compaction is installed and its cleanup done.
3. Reported: the writes' latency percentiles and the longest, the rate, the time each
   compaction took and what it wrote (``stagings``: whole or a delta, pieces, MB, seconds), and
   the folder's largest size (sampled every 100 ms) against the bytes the database holds then
   (``held``: the snapshot, the events after it, the export, by the journal's own counts,
   checked against a scan of the database at the end: ``held_at_end_gb``).

Run from the repository root with the dev venv; ``--code DIR`` measures another checkout's
store (e.g. ``git worktree add /tmp/before HEAD``) with the same bench:

    .venv/bin/python bench/compaction.py                         # 1M, 3 compactions
    .venv/bin/python bench/compaction.py --fill 100000 --compactions 2
    .venv/bin/python bench/compaction.py --code /tmp/before
    .venv/bin/python bench/compaction.py --back-to-back --interval 20   # 20 s of change each
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def held_bytes(database: Path) -> int:
    """What the database holds: the snapshot installed (its live rows; or the whole ``snapshot``
    table of the former format), the events after it, the export."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'snapshot_through'").fetchone()
        through = int(row[0]) if row else 0
        size = "coalesce(sum(length(header) + length(payload)), 0)"
        row = db.execute("SELECT value FROM meta WHERE key = 'snapshot_generation'").fetchone()
        if row is None:
            snapshot = db.execute(f"SELECT {size} FROM snapshot").fetchone()[0]
        else:
            live = "born <= ?1 AND (died IS NULL OR died > ?1)"
            snapshot = db.execute(f"SELECT {size} FROM snap WHERE {live}", (int(row[0]),)).fetchone()[0]
        events = db.execute(f"SELECT {size} FROM events WHERE id > ?", (through,)).fetchone()[0]
        export = db.execute("SELECT coalesce(sum(length(trajectory)), 0) FROM delivered").fetchone()[0]
    return int(snapshot + events + export)


def held_now(journal: Any, database: Path) -> int:
    """What the database holds now, by the journal's own counts (the snapshot's bytes, the
    events' since) and the export's size: ``held_bytes`` without its scan of the snapshot,
    whose read transaction would hold back the WAL's checkpoints and grow the folder it
    measures. The run checks the counts against ``held_bytes`` at its end."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        export = db.execute("SELECT coalesce(sum(length(trajectory)), 0) FROM delivered").fetchone()[0]
    return int(journal._snapshot_bytes + journal._since_snapshot + export)


def trajectory(index: int, size: int) -> dict[str, Any]:
    return {
        "instance_id": f"q{index}",
        "uid": f"u{index}",
        "messages": [{"role": "user", "content": "x" * max(0, size - 120)}],
        "reward": 0.5,
    }


def cleanup_done(journal: Any) -> bool:
    """Whether the journal has nothing left of a compaction to clean up (always, for a store
    that cleans up inside the install)."""
    return not getattr(journal, "cleanup_pending", False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    rollout_buffer = importlib.import_module("buffer.core.rollout_buffer")
    task = importlib.import_module("buffer.core.task")
    sqlite_store = importlib.import_module("buffer.store.sqlite")
    print(f"compaction: the store of {Path(str(sqlite_store.__file__)).parent}")
    with tempfile.TemporaryDirectory(prefix="bench-compaction-", dir=args.tmp) as tmp:
        folder = Path(tmp) / "data"
        journal = sqlite_store.Journal(folder, sync=True, retention_s=0.0, compact_bytes=2**62)
        buffer = rollout_buffer.RolloutBuffer(task.TaskSettings(group_size=8, group_timeout_s=1e9))
        captures: list[tuple[float, float]] = []  # when the buffer's lock was held for a snapshot
        snapshot = buffer.snapshot

        def timed_snapshot(**options: Any) -> Any:
            began = time.monotonic()
            try:
                return snapshot(**options)
            finally:
                captures.append((began, time.monotonic()))

        stagings: list[dict[str, Any]] = []  # what each compaction wrote (incremental snapshots)
        with contextlib.suppress(ImportError):
            table = importlib.import_module("buffer.store.snapshot_table")
            stage = table.Staging.stage

            def timed_stage(staging: Any, pieces: Any) -> Any:
                began = time.monotonic()
                staged = stage(staging, pieces)
                took = time.monotonic() - began
                stagings.append(
                    {"full": staged.full, "pieces": staged.pieces, "mb": staged.written / 1e6, "s": took}
                )
                return staged

            table.Staging.stage = timed_stage

        buffer.snapshot = timed_snapshot  # what attach hands the journal
        buffer.restore(journal.recover())
        buffer.attach(journal)
        started = time.monotonic()
        for first in range(0, args.fill, 1000):
            buffer.write_many([trajectory(i, args.size) for i in range(first, min(first + 1000, args.fill))])
            journal.wait_durable_blocking(600)
        fill_s = time.monotonic() - started
        journal.compact()
        journal.wait_durable_blocking(600)
        while not cleanup_done(journal):
            time.sleep(0.1)
        first_compactions = journal.compactions
        if args.gc == "service":  # as ``rollout-buffer serve`` sets it, and freezes after the restore
            gc.set_threshold(50_000, 20, 20)
            gc.freeze()
        journal.compact_bytes = args.compact_bytes
        # --back-to-back: compactions by hand only; a control (--compactions 0): none
        journal._no_compaction = args.back_to_back or args.compactions == 0
        print(f"filled {args.fill:,} in {fill_s:.0f} s; {folder_bytes(folder) / 1e9:.2f} GB")

        stop = threading.Event()
        latencies: list[tuple[float, float]] = []
        peak = {"folder": 0, "held": 1, "ratio": 0.0}

        def writer(index: int) -> None:
            n = 0
            while not stop.is_set():
                item = trajectory(10**9 + index * 10**7 + n, args.size)
                n += 1
                began = time.monotonic()
                buffer.write(item)
                journal.wait_durable_blocking(600)
                latencies.append((began, time.monotonic()))

        def bulk() -> None:  # generators' batches: the log grows, compactions start by themselves
            n = 0
            while not stop.is_set():
                items = [trajectory(2 * 10**9 + n + i // 8, args.size) for i in range(1000)]
                for i, item in enumerate(items):
                    item["uid"] = f"b{n}-{i}"
                n += 125
                buffer.write_many(items)
                journal.wait_durable_blocking(600)

        def reader() -> None:  # the trainer: what the batches complete is delivered
            while not stop.is_set():
                if not buffer.read(max_items=2000).groups:
                    time.sleep(0.01)

        def sampler() -> None:  # at each new largest folder, what the database holds then
            while not stop.wait(0.1):
                size = folder_bytes(folder)
                if size > peak["folder"]:
                    held = held_now(journal, folder / "buffer.sqlite3")
                    peak.update(folder=size, held=held, ratio=size / held)

        def compactor() -> None:  # --back-to-back: one compaction after the other
            while not stop.is_set() and journal.compactions < first_compactions + args.compactions:
                if stop.wait(args.interval):
                    return
                journal.compact()
                journal.wait_durable_blocking(600)
                while not cleanup_done(journal) and not stop.is_set():
                    time.sleep(0.05)

        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(args.writers)]
        targets = [compactor] if args.back_to_back else [bulk, reader]
        threads += [threading.Thread(target=target, daemon=True) for target in (*targets, sampler)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        if args.compactions == 0:  # a control: the same load, as long, without a compaction
            time.sleep(args.interval * 3)
        while journal.compactions < first_compactions + args.compactions or not cleanup_done(journal):
            time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - began
        journal.wait_durable_blocking(600)
        held_check = (held_now(journal, folder / "buffer.sqlite3"), held_bytes(folder / "buffer.sqlite3"))
        journal.close()
    windows = captures[1:]

    def overlaps(write: tuple[float, float]) -> bool:
        return any(write[0] < end and start < write[1] for start, end in windows)

    def figures(writes: list[tuple[float, float]]) -> dict[str, float]:
        ordered = sorted(end - start for start, end in writes)

        def at(fraction: float) -> float:
            return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000

        return {
            "writes": len(ordered),
            "p50_ms": at(0.5),
            "p99_ms": at(0.99),
            "p999_ms": at(0.999),
            "max_ms": ordered[-1] * 1000,
            "over_200ms": sum(1 for x in ordered if x > 0.2),
        }

    result = {
        "code": str(args.code or "."),
        "gc": args.gc,
        "fill": args.fill,
        "seconds": elapsed,
        "rate": len(latencies) / elapsed,
        "compactions": journal.compactions - first_compactions,
        "interval_s": args.interval if args.back_to_back else None,
        "all": figures(latencies),
        "outside_capture": figures([w for w in latencies if not overlaps(w)]),
        "capture_s": [round(end - start, 2) for start, end in windows],
        "stagings": [{k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()} for s in stagings],
        "peak_folder_gb": peak["folder"] / 1e9,
        "held_then_gb": peak["held"] / 1e9,
        "peak_ratio": peak["ratio"],
        "held_at_end_gb": {"counted": held_check[0] / 1e9, "scanned": held_check[1] / 1e9},
    }
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fill", type=int, default=1_000_000, help="trajectories in the store first")
    parser.add_argument("--size", type=int, default=200, help="bytes per trajectory, about")
    parser.add_argument("--writers", type=int, default=16, help="threads writing one at a time")
    parser.add_argument(
        "--compactions",
        type=int,
        default=3,
        help="0: a control, the same writes for 3 x --interval seconds and no compaction",
    )
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="compactions one after the other, by hand, and no other load (default: generator batches "
        "and a trainer's reads grow the log, and the journal compacts when it has grown as large as "
        "the snapshot, as in service)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="with --back-to-back: seconds of writes before each compaction (an incremental "
        "snapshot writes what changed meanwhile; 0: none, the compactions end within a second)",
    )
    parser.add_argument(
        "--compact-bytes", type=int, default=256 * 2**20, help="the journal's --compact-bytes"
    )
    parser.add_argument(
        "--gc",
        choices=["service", "default"],
        default="service",
        help="the collector as the service sets it (thresholds; frozen after the fill) or Python's default",
    )
    parser.add_argument("--code", type=Path, default=None, help="the checkout whose store to measure")
    parser.add_argument("--tmp", default=None, help="where the folder is made (default: the system's)")
    return parser


if __name__ == "__main__":
    run(build_parser().parse_args())
