"""Soak: concurrent writers and readers for a while, with exact accounting of every ``uid``.

Writers each write whole groups, one ``POST /buffer/write`` per trajectory, and retry a write
until it is acknowledged (a retry of one that landed is recognised by its ``uid``), so every
group they start is eventually complete. Readers long-poll ``/get_rollout_data``. When the
time is up the writers stop, and the readers drain the buffer. Then:

- every acknowledged ``uid`` was delivered, and none twice;
- with ``--data-dir`` (the default), the export (``GET /buffer/export``) lists every
  delivered ``uid`` exactly once.

With ``--kill-every S`` the server is killed with SIGKILL every S seconds and restarted on
the same data folder, in the middle of the traffic; with ``--kill-on-read`` each kill waits for
a read in flight and lands within a few milliseconds of it (between a read's record and its
export, when they were two writes); ``--compact-bytes`` makes compaction frequent. A read in
flight at a kill may have been delivered (made durable) without its answer reaching the
reader; such trajectories are found in the export, and the check becomes: every acknowledged
``uid`` was delivered exactly once, by an answer or, for the answer a kill cut off, by the export alone.

Exit status 1 when the accounting fails. Run (from the repository root, with the dev venv):

    .venv/bin/python bench/soak.py                        # 30 s, durability sync
    .venv/bin/python bench/soak.py --kill-every 5          # SIGKILL every 5 s
    .venv/bin/python bench/soak.py --seconds 120 --kill-every 1 --kill-on-read --compact-bytes 1048576
    .venv/bin/python bench/soak.py --memory                # no --data-dir
    .venv/bin/python bench/soak.py --json                  # one JSON line of figures
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import httpx
import orjson


@dataclass
class Ledger:
    acked: set[str] = field(default_factory=set)
    received: Counter[str] = field(default_factory=Counter)
    write_latencies_s: list[float] = field(default_factory=list)
    write_retries: int = 0
    read_failures: int = 0
    reads: int = 0
    kills: int = 0
    restart_s: list[float] = field(default_factory=list)
    compactions: int = 0  # summed over the server's lives


class Target:
    """The server and its current URL; a kill-and-restart changes the URL."""

    def __init__(self, server: common.Server) -> None:
        self.server = server
        self.url = server.url
        self.up = asyncio.Event()
        self.up.set()
        self.reading = asyncio.Event()  # a read is in flight


def writing(args: argparse.Namespace, ledger: Ledger, deadline: float) -> bool:
    """Until ``--seconds`` have passed, and then until ``--min-acked`` writes are acknowledged
    and ``--kills`` kills made: a slow machine takes longer, never does less."""
    return time.monotonic() < deadline or len(ledger.acked) < args.min_acked or ledger.kills < args.kills


async def writer(
    index: int, target: Target, args: argparse.Namespace, ledger: Ledger, deadline: float
) -> None:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        number = 0
        while writing(args, ledger, deadline):
            instance_id = f"w{index}-{number}"
            number += 1
            for k in range(args.group_size):
                uid, reward = f"{instance_id}-{k}", float(k % 2)
                item = common.make_trajectory(instance_id, uid, reward, args.trajectory_bytes, seed=k)
                body = orjson.dumps(item)
                while True:  # until acknowledged: the same uid, so a retry is never counted twice
                    await target.up.wait()
                    started = time.monotonic()
                    try:
                        response = await client.post(
                            f"{target.url}/buffer/write",
                            content=body,
                            headers={"content-type": "application/json"},
                        )
                    except httpx.HTTPError:
                        response = None
                    if response is not None and response.status_code == 200:
                        ledger.write_latencies_s.append(time.monotonic() - started)
                        ledger.acked.add(item["uid"])
                        break
                    if response is not None and response.status_code not in (429, 503):
                        raise RuntimeError(f"write refused: {response.status_code} {response.text[:300]}")
                    ledger.write_retries += 1
                    await asyncio.sleep(0.05)


async def reader(target: Target, ledger: Ledger, stop: asyncio.Event, every_s: float) -> None:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        while not stop.is_set():
            if every_s:  # fewer, larger reads: each one a longer export
                await asyncio.sleep(every_s)
            await target.up.wait()
            target.reading.set()
            try:
                response = await client.post(f"{target.url}/get_rollout_data", json={"wait_s": 0.5})
                response.raise_for_status()
            except httpx.HTTPError:
                ledger.read_failures += 1
                await asyncio.sleep(0.05)
                continue
            finally:
                target.reading.clear()
            answer = response.json()
            if answer["success"]:
                ledger.reads += 1
                ledger.received.update(item["uid"] for item in answer["data"]["data"])


async def killer(target: Target, ledger: Ledger, args: argparse.Namespace, deadline: float) -> None:
    every_s = args.kill_every
    while ledger.kills < args.kills if args.kills else time.monotonic() + every_s < deadline:
        await asyncio.sleep(every_s)
        ledger.compactions += await asyncio.to_thread(compactions, target.url)
        if args.kill_on_read:  # within a few milliseconds of a read reaching the server
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(target.reading.wait(), 2.0)
            await asyncio.sleep(random.uniform(0.0, args.kill_delay_ms / 1000))
        target.up.clear()
        started = time.monotonic()
        target.server.process.kill()  # type: ignore[union-attr]
        target.server.process.wait()  # type: ignore[union-attr]
        # A new process on the same data folder, started from this thread: the server dies with
        # the thread that started it (PR_SET_PDEATHSIG), and a worker thread's end would kill it.
        # Nothing else runs meanwhile anyway: writers and readers wait for ``up``.
        target.server.__enter__()
        target.url = target.server.url
        ledger.kills += 1
        ledger.restart_s.append(time.monotonic() - started)
        target.up.set()


async def soak(target: Target, args: argparse.Namespace) -> Ledger:
    ledger = Ledger()
    deadline = time.monotonic() + args.seconds
    stop = asyncio.Event()
    readers = [
        asyncio.create_task(reader(target, ledger, stop, args.read_every)) for _ in range(args.readers)
    ]
    jobs = [writer(i, target, args, ledger, deadline) for i in range(args.writers)]
    if args.kill_every:
        jobs.append(killer(target, ledger, args, deadline))
    await asyncio.gather(*jobs)
    drain_deadline = time.monotonic() + args.drain_s
    while time.monotonic() < drain_deadline and not ledger.acked <= set(ledger.received):
        await asyncio.sleep(0.2)
        if args.kill_every:  # what a cut-off answer delivered is only in the export
            exported = await asyncio.to_thread(exported_uids, target.url)
            if ledger.acked <= set(ledger.received) | set(exported):
                break
    stop.set()
    await asyncio.gather(*readers)
    return ledger


def compactions(url: str) -> int:
    """The compactions this life of the server has made."""
    with contextlib.suppress(httpx.HTTPError, KeyError, TypeError):
        health = httpx.get(f"{url}/health", timeout=5.0, trust_env=False).json()
        return int(health["storage"]["compactions"])
    return 0


def exported_uids(url: str) -> Counter[str]:
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        response = client.get(f"{url}/buffer/export")
        response.raise_for_status()
        return Counter(orjson.loads(line)["trajectory"]["uid"] for line in response.content.splitlines())


def account(ledger: Ledger, exported: Counter[str] | None, seconds: float) -> dict[str, Any]:
    received = set(ledger.received)
    twice = sorted(uid for uid, count in ledger.received.items() if count > 1)
    figures: dict[str, Any] = {
        "seconds": seconds,
        "acked": len(ledger.acked),
        "acked_per_s": round(len(ledger.acked) / seconds),
        "write_p50_ms": round(statistics.median(ledger.write_latencies_s) * 1000, 2),
        "write_p99_ms": round(statistics.quantiles(ledger.write_latencies_s, n=100)[98] * 1000, 2),
        "write_retries": ledger.write_retries,
        "reads": ledger.reads,
        "read_failures": ledger.read_failures,
        "received": len(received),
        "received_twice": len(twice),
        "kills": ledger.kills,
        "compactions": ledger.compactions,
        "restart_s_max": round(max(ledger.restart_s), 2) if ledger.restart_s else None,
    }
    delivered = received
    if exported is not None:
        exported_set = set(exported)
        figures["exported"] = len(exported_set)
        figures["exported_twice"] = sum(1 for count in exported.values() if count > 1)
        figures["received_not_exported"] = len(received - exported_set)
        figures["cut_off_by_kill"] = len(exported_set - received)
        delivered = received | exported_set
    figures["lost"] = len(ledger.acked - delivered)
    figures["unexpected"] = len(delivered - ledger.acked)
    failures = [
        name
        for name in ("lost", "unexpected", "received_twice", "exported_twice", "received_not_exported")
        if figures.get(name)
    ]
    if exported is not None and not ledger.kills and figures["cut_off_by_kill"]:
        failures.append("cut_off_by_kill")  # without a kill, every delivery reached its reader
    figures["ok"] = not failures
    figures["failures"] = failures
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the writers write (default 30)")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--trajectory-bytes", type=int, default=2000)
    parser.add_argument("--durability", choices=["sync", "flush"], default="sync")
    parser.add_argument("--memory", action="store_true", help="no --data-dir: the buffer in memory only")
    parser.add_argument("--kill-every", type=float, default=0.0, help="SIGKILL and restart every S seconds")
    parser.add_argument("--kill-on-read", action="store_true", help="time each kill to a read in flight")
    parser.add_argument(
        "--kill-delay-ms", type=float, default=4.0, help="with --kill-on-read: kill up to this long after"
    )
    parser.add_argument(
        "--read-every", type=float, default=0.0, help="seconds each reader waits between reads"
    )
    parser.add_argument(
        "--compact-bytes", type=int, default=0, help="the server's --journal-compact-bytes (min 1 MiB)"
    )
    parser.add_argument(
        "--code", type=Path, default=None, help="run the service checked out in this folder (e.g. main's)"
    )
    parser.add_argument("--drain-s", type=float, default=30.0, help="how long readers may take to drain")
    parser.add_argument(
        "--kills",
        type=int,
        default=0,
        help="with --kill-every: this many kills, however long they take",
    )
    parser.add_argument(
        "--min-acked", type=int, default=0, help="write past --seconds until this many are acknowledged"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    if args.kills and not args.kill_every:
        parser.error("--kills needs --kill-every")
    if args.kill_every and args.memory:
        parser.error("--kill-every needs the data folder (without --memory)")
    common.raise_on_sigterm()
    with contextlib.ExitStack() as stack:
        server_args = ["--group-timeout-seconds", "3600"]
        if not args.memory:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
            server_args += ["--data-dir", str(data_dir), "--durability", args.durability]
            if args.compact_bytes:
                server_args += ["--journal-compact-bytes", str(args.compact_bytes)]
        entry = (args.code or common.REPO).resolve() / "buffer.py"
        server = stack.enter_context(
            common.Server(group_size=args.group_size, extra_args=server_args, entry=entry)
        )
        target = Target(server)
        started = time.monotonic()
        try:
            ledger = asyncio.run(soak(target, args))
            elapsed = time.monotonic() - started
            exported = None if args.memory else exported_uids(target.url)
            ledger.compactions += 0 if args.memory else compactions(target.url)
        except BaseException:
            print(f"the server's log:\n{server.log_text()}", file=sys.stderr)
            raise
        figures = account(ledger, exported, args.seconds)
        figures["elapsed_s"] = round(elapsed, 1)
        figures["mode"] = "memory" if args.memory else f"data-dir, durability {args.durability}"
    if args.json:
        print(orjson.dumps(figures).decode())
    else:
        print(common.table(["figure", "value"], figures.items()))
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
