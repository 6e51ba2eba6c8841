"""Generation soak: a job's plan made exactly once through SIGKILLs of the service, partitions
and kills of remote workers (issue 22's test of exactly once for generation).

What runs, on loopback:

- the simulated policy server (``python -m buffer.simulator``, ``--latency-s`` a request, so a
  plan takes a while);
- the service (``buffer.py --data-dir D``, jobs in worker processes), with a generator this
  script writes to a folder of its own: the toolkit's ``run_rollouts`` over a JSONL of
  ``--rows`` rows, ``--repeats`` samples each, ``--epochs`` epochs (every trajectory says its
  ``extra_info.epoch`` and ``repeat``; this generator adds ``extra_info.writer``, the worker that
  made it, and keeps every group whole, so each plan item is delivered);
- ``/start_rollout`` of that plan with 2 worker processes, and 2 remote workers
  (``rollout-buffer worker --leases``) taking work from the same lease board through a TCP
  relay of this script's, which now and then stops forwarding (``stall``) or drops every
  connection (``drop``) for up to ``--partition-s`` (below their lease, ``--lease-ttl-s``), and
  whose workers are SIGKILLed now and then and started again;
- a reader long-polling ``/get_rollout_data`` all along.

The service is SIGKILLed ``--kills`` times and started again on the same folder and port; each
kill is timed either right after the service started a worker process (``resume``: the job it
resumed by itself; ``start``: a ``/start_rollout`` re-posted after the crash-loop guard gave the
job up, as the docs say to) or to a read in flight (``read``, as ``bench/soak.py
--kill-on-read``). Then the job runs to its end, the task's open groups are timed out (``PUT
/tasks``) so that nothing made stays unread, and the buffer is drained. Checked:

- every plan item (instance, epoch, repeat) delivered exactly once (``GET /buffer/export``, which
  also holds what a read cut off by a kill delivered): ``made_twice``, ``never_made``,
  ``unexpected``;
- every delivered ``uid`` once, and every one a reader got in the export;
- no process of a job outlives its service: every process carrying this run's marker (an
  environment variable the service and its workers inherit) but the service alive and the
  remote workers is an ``orphan`` once it has run 5 s on;
- the job finished; at least ``--kills`` kills.

Exit status 1 when a check fails; the evidence (which items, who made each copy, when, what
happened just before) goes to stderr. Run (from the repository root, with the dev venv):

    .venv/bin/python bench/generation_soak.py              # 30 kills: 3-4 minutes on a busy 2-core machine
    .venv/bin/python bench/generation_soak.py --kills 5 --rows 16 --json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import httpx
import orjson

TASK = "gensoak"
MARKER = "GENERATION_SOAK_RUN"
#: A process of the run still alive this long after its service died is an orphan.
ORPHAN_GRACE_S = 5.0

# The toolkit's loop; a random reward (no group of equal rewards); every group kept whole, so
# every item made is delivered; each trajectory names the worker that made it.
GENERATOR = '''
import os
import random

from buffer.toolkit import run_rollouts
from buffer.toolkit.sink import open_sink

TASK_TYPE = "gensoak"


def filter_item(item, task_type):
    return True


def is_valid_group(group, min_valid_group_size, task_type):
    finished = len(group[1]) >= min_valid_group_size
    return finished, finished


class Signed:
    """The job's sink, adding ``extra_info.writer``: which worker made the trajectory."""

    def __init__(self, sink, writer):
        self.sink, self.writer = sink, writer

    async def write(self, trajectory):
        trajectory["extra_info"]["writer"] = self.writer
        await self.sink.write(trajectory)

    async def aclose(self):
        await self.sink.aclose()


async def run_rollout(data):
    worker = (data.get("leases") or {}).get("worker", "?")
    sink = Signed(await open_sink(data.get("remote_buffer_url")), f"{worker}@{os.getpid()}")
    try:
        await run_rollouts(data, reward=lambda sample, episode: random.random(), sink=sink)
    finally:
        await sink.aclose()
'''


#: The options: flag, type, default, what it sets.
OPTIONS: tuple[tuple[str, type, Any, str], ...] = (
    ("--kills", int, 30, "SIGKILLs of the service"),
    ("--rows", int, 64, "rows of the data set"),
    ("--repeats", int, 4, "num_repeat_per_sample"),
    ("--epochs", int, 2, "num_epoch"),
    ("--latency-s", float, 1.5, "the simulator's mean latency of a request"),
    ("--in-flight", int, 4, "trajectories in flight per worker (num_process)"),
    ("--life-s", float, 1.5, "a kill timed to a read comes about this long after the start before"),
    ("--start-share", float, 0.5, "the share of kills timed to a worker's start"),
    ("--start-delay-ms", float, 200.0, "a kill timed to a worker's start comes up to this long after it"),
    ("--lease-ttl-s", float, 8.0, "the remote workers' --lease-ttl-s"),
    ("--partition-s", float, 3.0, "the longest partition of the relay (keep it below the lease)"),
    ("--chaos-every-s", float, 4.0, "a partition or a remote worker's kill about this often"),
    ("--finish-s", float, 120.0, "how long the job may take to finish after the last kill"),
    ("--remote-exit-s", float, 20.0, "how long the remote workers may take to end after the job"),
    ("--seed", int, 0, "the seed of the kills and the chaos"),
)


@dataclass
class Tally:
    received_uids: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    read_failures: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    restart_s: list[float] = field(default_factory=list)
    partitions: Counter[str] = field(default_factory=Counter)
    remote_kills: int = 0
    remote_exits: list[str] = field(default_factory=list)
    reposts: list[str] = field(default_factory=list)  # why each /start_rollout after the first
    job_errors: list[str] = field(default_factory=list)  # failed jobs other than the guard's
    orphans: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (wall time, what)

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))


# -- /proc ----------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The live children of ``pid`` (every thread's)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    return ""


def marked(token: str) -> list[int]:
    """The live processes whose environment carries this run's marker."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def is_worker(pid: int) -> bool:
    """Whether ``pid`` is a job's worker process (its bootstrap imports ``buffer.workers.child``)."""
    with contextlib.suppress(OSError):
        return b"buffer.workers.child" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


# -- the relay the remote workers reach the service through ----------------------------------


class Relay:
    """A TCP relay from a port of its own to ``upstream_port``, on a thread and event loop of
    its own (a restart of the service blocks nothing of it). ``partition(mode, s)``: ``stall``
    stops forwarding for ``s`` (connections stay open, what was sent arrives after, as TCP
    retransmits across a partition); ``drop`` resets every connection and refuses new ones."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._flowing = asyncio.Event()
        self._refusing = False
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> Relay:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://{common.HOST}:{self.port}"

    def partition(self, mode: str, seconds: float) -> None:
        asyncio.run_coroutine_threadsafe(self._partition(mode, seconds), self._loop)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, common.HOST, 0))
        self.port = int(server.sockets[0].getsockname()[1])
        self._flowing.set()
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _partition(self, mode: str, seconds: float) -> None:
        if mode == "drop":
            self._refusing = True
            for writer in list(self._writers):
                writer.transport.abort()
        else:
            self._flowing.clear()
        await asyncio.sleep(seconds)
        self._refusing = False
        self._flowing.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(common.HOST, self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._writers |= pair
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for end in pair:
                end.transport.abort()
            self._writers -= pair

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                await self._flowing.wait()
                sink.write(data)
                await sink.drain()


# -- the remote workers ---------------------------------------------------------------------


class RemoteWorkers:
    """``rollout-buffer worker --leases`` processes, started from the main thread (they get
    SIGTERM if it ends: ``PR_SET_PDEATHSIG``)."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path, count: int) -> None:
        self.command = command
        self.env = env
        self.log = log
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * count

    def start(self, index: int) -> None:
        with self.log.open("ab") as output:
            self.processes[index] = subprocess.Popen(
                [*self.command, "--worker-index", str(index)],
                cwd=common.REPO,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=common._die_with_parent,
            )

    def pids(self) -> set[int]:
        return {process.pid for process in self.processes if process is not None and process.poll() is None}

    def kill(self, index: int) -> None:
        process = self.processes[index]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def running(self) -> bool:
        return any(process is not None and process.poll() is None for process in self.processes)

    def stop(self) -> None:
        for index in range(len(self.processes)):
            self.kill(index)


# -- the run --------------------------------------------------------------------------------


class Run:
    def __init__(
        self,
        args: argparse.Namespace,
        service: common.Server,
        relay: Relay,
        remote: RemoteWorkers,
        payload: dict[str, Any],
        token: str,
    ) -> None:
        self.args = args
        self.service = service
        self.relay = relay
        self.remote = remote
        self.payload = payload
        self.token = token
        self.tally = Tally()
        self.rng = random.Random(args.seed)
        self.up = asyncio.Event()
        self.reading = asyncio.Event()
        self.chaos_on = True
        self.finished = False  # the job succeeded
        self.posted = False  # the first /start_rollout was answered
        self.orphan_pids: set[int] = set()
        self.suspects: dict[int, float] = {}  # marked processes not ours, since when

    @property
    def url(self) -> str:
        return self.service.url

    # -- the service's lives ------------------------------------------------------------

    async def kill_service(self, kind: str) -> None:
        process = self.service.process
        assert process is not None
        self.up.clear()
        process.kill()
        await asyncio.to_thread(process.wait)
        self.tally.kills[kind] += 1
        self.tally.note(f"SIGKILL of the service ({kind}) pid {process.pid}")

    async def restart(self, watch_workers: bool = False) -> int | None:
        """Start the service again on its folder and port. With ``watch_workers``, return the
        pid of its first worker process as soon as it has one, or None if it has none a second
        after it answers; else None once it answers."""
        started = time.monotonic()
        self.service.launch()  # on the main thread: the service lives as long as it
        deadline = started + self.service.startup_timeout_s
        answered_at = None
        while time.monotonic() < deadline:
            if watch_workers and (worker := self.first_worker()) is not None:
                return worker
            if answered_at is None:
                answered = await asyncio.to_thread(self.service.answers)
                if answered is False:
                    raise RuntimeError(
                        f"the service exited at its start; its log:\n{self.service.log_text()}"
                    )
                if answered:
                    answered_at = time.monotonic()
                    self.tally.restart_s.append(answered_at - started)
                    self.tally.note(f"service up, pid {self.service.pid}")
                    self.up.set()
            if answered_at is not None and (not watch_workers or time.monotonic() - answered_at > 1.0):
                return None
            await asyncio.sleep(0.003)
        raise RuntimeError(f"the service did not start again; its log:\n{self.service.log_text()}")

    def first_worker(self) -> int | None:
        return next((pid for pid in children(self.service.pid) if is_worker(pid)), None)

    async def wait_worker(self, timeout_s: float) -> int | None:
        """The first worker process of the live service within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (worker := self.first_worker()) is not None:
                return worker
            await asyncio.sleep(0.003)
        return None

    # -- the job ------------------------------------------------------------------------

    async def job(self) -> dict[str, Any] | None:
        """The task's latest job in this life of the service (None: none); ``httpx.HTTPError``
        when the service does not answer."""
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            response = await client.get(f"{self.url}/jobs")
            response.raise_for_status()
        jobs = response.json()["data"]["jobs"]
        ours = [job for job in jobs if job["task_type"] == TASK]
        return max(ours, key=lambda job: job["started_at"]) if ours else None

    async def start_job(self, why: str) -> bool:
        """``/start_rollout`` with the plan's payload; whether it was answered 200."""
        try:
            async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
                answer = await client.post(f"{self.url}/start_rollout", json=self.payload)
        except httpx.HTTPError:
            return False
        if answer.status_code != 200:
            raise RuntimeError(f"/start_rollout refused: {answer.status_code} {answer.text[:300]}")
        self.posted = True
        if why:
            self.tally.reposts.append(why)
            guard = "not resumed" in why
            self.tally.note(f"/start_rollout again ({'the guard gave the job up' if guard else why[:100]})")
        return True

    async def keep_job_going(self) -> str:
        """The job's state now: ``running``, ``succeeded``, ``started`` (it had failed or was
        missing, and was posted again), or ``unknown`` (the service did not answer)."""
        try:
            job = await self.job()
        except httpx.HTTPError:
            return "unknown"
        if job is not None and job["status"] in ("running", "succeeded"):
            self.finished = job["status"] == "succeeded"
            return str(job["status"])
        if job is None and not self.posted:
            why = ""  # the first start
        elif job is None:
            why = "no job of the task after the restart"
        else:
            why = f"{job['status']}: {job['error']}"
            if "not resumed" not in str(job["error"]):
                self.tally.job_errors.append(why)
        return "started" if await self.start_job(why) else "unknown"

    # -- the kills ----------------------------------------------------------------------

    async def killer(self) -> None:
        """``--kills`` SIGKILLs, each drawn at random: right after a worker starts, or at a read.

        A start-timed kill watches the service's children from the moment it is started again
        (it resumes the job by itself, before it answers); if it answers and starts none (the
        crash-loop guard gave the job up), the job is posted again and its start watched."""
        args, rng, tally = self.args, self.rng, self.tally
        at_start = rng.random() < args.start_share
        worker: int | None = None
        while sum(tally.kills.values()) < args.kills and not self.finished:
            kind = "read"
            if at_start:
                if worker is not None:
                    kind = "resume"
                elif await self.keep_job_going() == "started":
                    kind, worker = "start", await self.wait_worker(10.0)
            if at_start and worker is not None:
                await asyncio.sleep(rng.uniform(0, args.start_delay_ms / 1000))
                tally.note(f"worker {worker} started")
            else:  # a read: after a while of generation
                kind = "read"
                await asyncio.sleep(rng.uniform(0.5, 1.5) * args.life_s)
                if await self.keep_job_going() == "succeeded":
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.reading.wait(), 2.0)
                await asyncio.sleep(rng.uniform(0, 0.004))
            await self.kill_service(kind)
            at_start = rng.random() < args.start_share
            worker = await self.restart(watch_workers=at_start)
            if not at_start:  # (else the next kill posts it again, if need be, and watches)
                await self.keep_job_going()
        await self.until_up()

    async def until_up(self) -> None:
        """Wait until the service started last answers (a restart that returned at its first
        worker did not wait for it)."""
        deadline = time.monotonic() + self.service.startup_timeout_s
        while not self.up.is_set():
            if await asyncio.to_thread(self.service.answers):
                self.up.set()
            elif time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start again; its log:\n{self.service.log_text()}")
            await asyncio.sleep(0.05)

    # -- the readers and the chaos around the remote workers ----------------------------

    async def reader(self, stop: asyncio.Event) -> None:
        tally = self.tally
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            while not stop.is_set():
                if not self.up.is_set():  # the service is down, or starting
                    await asyncio.sleep(0.05)
                    continue
                self.reading.set()
                try:
                    body = {"task_type": TASK, "batch_size": -1, "wait_s": 0.5}
                    response = await client.post(f"{self.url}/get_rollout_data", json=body)
                    response.raise_for_status()
                except httpx.HTTPError:
                    tally.read_failures += 1
                    await asyncio.sleep(0.05)
                    continue
                finally:
                    self.reading.clear()
                answer = response.json()
                if answer["success"]:
                    tally.reads += 1
                    for item in answer["data"]["data"]:
                        tally.received_uids[item["uid"]] += 1

    async def chaos(self) -> None:
        """Partitions of the relay and SIGKILLs of remote workers, and remote workers started
        again when they exited before the job's end."""
        args, rng, remote = self.args, self.rng, self.remote
        next_at = time.monotonic() + rng.uniform(0.5, 1.5) * args.chaos_every_s
        while True:
            await asyncio.sleep(0.2)
            for index, process in enumerate(remote.processes):
                if process is None or (code := process.poll()) is None:
                    continue
                self.tally.remote_exits.append(f"worker {index} exited {code}")
                self.tally.note(f"remote worker {index} exited {code}")
                remote.processes[index] = None  # exited 0: its walk of the plan ended
                if code != 0 and self.chaos_on:
                    remote.start(index)
            if not self.chaos_on or time.monotonic() < next_at:
                continue
            next_at = time.monotonic() + rng.uniform(0.5, 1.5) * args.chaos_every_s
            if rng.random() < 0.6:
                mode, seconds = rng.choice(["stall", "drop"]), rng.uniform(0.5, args.partition_s)
                self.relay.partition(mode, seconds)
                self.tally.partitions[mode] += 1
                self.tally.note(f"relay partition {mode} for {seconds:.1f}s")
            else:
                index = rng.randrange(len(remote.processes))
                if remote.processes[index] is None:  # its walk ended, or it waits for the job's end
                    continue
                remote.kill(index)
                self.tally.remote_kills += 1
                self.tally.note(f"SIGKILL of remote worker {index}")
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                remote.start(index)

    async def orphan_watch(self) -> None:
        """Every second: a process of this run that is neither the service, below it, nor a
        remote worker, alive ``ORPHAN_GRACE_S`` on, is an orphan (noted once)."""
        while True:
            await asyncio.to_thread(self.check_orphans, ORPHAN_GRACE_S)
            await asyncio.sleep(1.0)

    def check_orphans(self, grace_s: float) -> None:
        now = time.monotonic()
        service = self.service.process.pid if self.service.process is not None else 0
        ours = self.remote.pids() | {service}
        live = set()
        for pid in marked(self.token):
            ancestor, hops = pid, 0
            while ancestor > 1 and ancestor not in ours and hops < 20:
                ancestor, hops = parent(ancestor), hops + 1
            if ancestor in ours:
                continue
            live.add(pid)
            first = self.suspects.setdefault(pid, now)
            if now - first >= grace_s and pid not in self.orphan_pids:
                self.orphan_pids.add(pid)
                self.tally.orphans.append(f"pid {pid} (parent {parent(pid)}): {cmdline(pid)}")
                self.tally.note(f"orphan pid {pid}")
        for pid in set(self.suspects) - live:
            del self.suspects[pid]

    # -- the end ------------------------------------------------------------------------

    async def finish(self) -> str | None:
        """After the kills: the job to its end, the remote workers' exits, the open groups timed
        out and read. The reason it could not, if any."""
        deadline = time.monotonic() + self.args.finish_s
        while not self.finished:
            if time.monotonic() > deadline:
                return f"the job did not finish within {self.args.finish_s:g}s of the last kill"
            await self.keep_job_going()
            await asyncio.sleep(0.5)
        self.tally.note("the job succeeded")
        left = None
        deadline = time.monotonic() + self.args.remote_exit_s
        while self.remote.running():
            if time.monotonic() > deadline:
                left = f"remote workers still running {self.args.remote_exit_s:g}s after the job's end"
                self.tally.note(left)
                break
            await asyncio.sleep(0.2)
        self.chaos_on = False
        self.remote.stop()
        settings = {
            "num_repeat_per_sample": self.payload["num_repeat_per_sample"],
            "group_timeout_seconds": 1,
            "min_timeout_group_size_ratio": 0.0,
            "min_valid_item_size_ratio": 0.0,
        }
        async with httpx.AsyncClient(base_url=self.url, timeout=30.0, trust_env=False) as client:
            (await client.put(f"/tasks/{TASK}", json=settings)).raise_for_status()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                stats = (await client.get("/buffer/stats")).json()["data"]["meta_info"]["tasks"].get(TASK, {})
                if not stats.get("pending_groups") and not stats.get("ready_groups"):
                    break
        return left


def key_of(item: dict[str, Any]) -> tuple[str, int, int]:
    extra = item.get("extra_info") or {}
    return str(item["instance_id"]), int(extra.get("epoch", -1)), int(extra.get("repeat", -1))


def exported(url: str) -> list[dict[str, Any]]:
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        response = client.get(f"{url}/buffer/export", params={"task_type": TASK})
        response.raise_for_status()
        return [orjson.loads(line)["trajectory"] for line in response.content.splitlines()]


def account(run: Run, export: list[dict[str, Any]], plan: set[tuple[str, int, int]]) -> dict[str, Any]:
    tally = run.tally
    items = Counter(key_of(item) for item in export)
    uids = Counter(item["uid"] for item in export)
    twice = sorted(key for key, count in items.items() if count > 1)
    never = sorted(plan - set(items))
    unexpected = sorted(set(items) - plan)
    figures: dict[str, Any] = {
        "plan_items": len(plan),
        "exported": len(export),
        "made_twice": len(twice),
        "never_made": len(never),
        "unexpected": len(unexpected),
        "uids_exported_twice": sum(1 for count in uids.values() if count > 1),
        "uids_received_twice": sum(1 for count in tally.received_uids.values() if count > 1),
        "received_not_exported": len(set(tally.received_uids) - set(uids)),
        "cut_off_by_kill": len(set(uids) - set(tally.received_uids)),
        "kills": sum(tally.kills.values()),
        "kills_by_kind": dict(tally.kills),
        "restart_s_max": round(max(tally.restart_s), 2) if tally.restart_s else None,
        "reads": tally.reads,
        "read_failures": tally.read_failures,
        "partitions": dict(tally.partitions),
        "remote_kills": tally.remote_kills,
        "remote_exits": len(tally.remote_exits),
        "reposts": len(tally.reposts),
        "guard_gave_up": sum(1 for why in tally.reposts if "not resumed" in why),
        "job_errors": len(tally.job_errors),
        "orphans": len(tally.orphans),
    }
    failures = [
        name
        for name in (
            "made_twice",
            "never_made",
            "unexpected",
            "uids_exported_twice",
            "uids_received_twice",
            "received_not_exported",
            "job_errors",
            "orphans",
        )
        if figures[name]
    ]
    if figures["kills"] < run.args.kills:
        failures.append("kills")
    figures["ok"] = not failures
    figures["failures"] = failures
    figures["evidence"] = evidence(run, export, twice, never, unexpected)
    return figures


def evidence(
    run: Run,
    export: list[dict[str, Any]],
    twice: list[tuple[str, int, int]],
    never: list[tuple[str, int, int]],
    unexpected: list[tuple[str, int, int]],
) -> list[str]:
    """Lines saying what went wrong: each item made twice, with who made each copy, when, and
    what the run did just before; the items never made; the orphans; failed jobs."""
    tally = run.tally
    times = [at for at, _ in tally.events]
    copies: defaultdict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for item in export:
        copies[key_of(item)].append(item)
    started = tally.events[0][0] if tally.events else 0.0

    def before(at: float) -> str:
        index = bisect.bisect_right(times, at) - 1
        if index < 0:
            return "nothing"
        event_at, what = tally.events[index]
        return f"{what} ({at - event_at:.1f}s before)"

    lines = []
    for key in twice[:20]:
        made = []
        for item in copies[key]:
            extra = item["extra_info"]
            at = float(extra.get("timestamp", 0))
            made.append(f"by {extra.get('writer')} at +{at - started:.1f}s after {before(at)}")
        lines.append(f"made twice {key}: " + "; ".join(made))
    if len(twice) > 20:
        lines.append(f"... and {len(twice) - 20} more made twice")
    if never:
        lines.append(f"never made ({len(never)}): {never[:20]}")
    if unexpected:
        lines.append(f"not in the plan ({len(unexpected)}): {unexpected[:20]}")
    lines += [f"orphan: {orphan}" for orphan in tally.orphans]
    lines += [f"job failed: {error}" for error in tally.job_errors]
    lines += [f"/start_rollout again {n} times: {why}" for why, n in Counter(tally.reposts).items()]
    lines += [f"remote {what} {n} times" for what, n in Counter(tally.remote_exits).items()]
    return lines


def log_lines(text: str) -> list[str]:
    """The service's log lines worth reading after a failure."""
    words = ("resuming", "not resumed", "lost", "lease board", "Traceback", " ERROR ")
    return [line for line in text.splitlines() if any(word in line for word in words)][-60:]


@contextlib.contextmanager
def folder(keep: bool) -> Iterator[Path]:
    if keep:
        yield Path(tempfile.mkdtemp(prefix="generation-soak-"))
    else:
        with tempfile.TemporaryDirectory(prefix="generation-soak-") as name:
            yield Path(name)


def prepare(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The generator folder (the generator and its rows), returns (folder, generator file)."""
    generators = root / "generator"
    (generators / "data").mkdir(parents=True)
    generator = generators / f"{TASK}_generator.py"
    generator.write_text(GENERATOR)
    rows = generators / "data" / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"instance_id": f"q{i}", "prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n"
            for i in range(args.rows)
        )
    )
    return generators, generator


async def soak(run: Run) -> str | None:
    stop = asyncio.Event()
    run.up.set()
    run.tally.note("start")
    for index in range(len(run.remote.processes)):
        run.remote.start(index)
    helpers = [
        asyncio.create_task(run.reader(stop)),
        asyncio.create_task(run.chaos()),
        asyncio.create_task(run.orphan_watch()),
    ]
    try:
        await run.killer()
        run.tally.note("the last kill")
        run.chaos_on = False
        left = await run.finish()
        stop.set()
        await helpers[0]
        return left
    finally:
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's folder (logs, data) and print its path"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line of figures")
    args = parser.parse_args(argv)
    common.raise_on_sigterm()
    token = uuid.uuid4().hex
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(folder(args.keep))
        generators, generator = prepare(root, args)
        rows = generators / "data" / "rows.jsonl"
        simulator = stack.enter_context(
            common.Server(
                module="buffer.simulator", extra_args=["--latency-mean-s", str(args.latency_s), "--seed", "0"]
            )
        )
        plan_fields = {
            "input_file": str(rows),
            "remote_engine_url": simulator.url,
            "num_repeat_per_sample": args.repeats,
            "num_epoch": args.epochs,
            "max_tokens": 16,
            "group_timeout_seconds": 3600,
        }
        payload = {"task_type": TASK, **plan_fields, "num_process": 2 * args.in_flight, "num_workers": 2}
        # The job's lease term is the remote workers': a resumed job's board settles that long,
        # for every remote worker to claim back what it had in flight (docs/workers.md).
        payload["lease_ttl_s"] = args.lease_ttl_s
        service_args = ["--data-dir", str(root / "data"), "--generator-dir", str(generators)]
        service_args += ["--input-roots", str(generators / "data"), "--log-level", "info", "--no-access-log"]
        service = stack.enter_context(
            common.Server(
                group_size=args.repeats, extra_args=service_args, port=common.free_port(), env={MARKER: token}
            )
        )
        relay = stack.enter_context(Relay(service.port))
        remote_data = {**plan_fields, "num_process": args.in_flight}
        command = [sys.executable, "-m", "buffer", "worker", "--buffer", relay.url, "--task", TASK]
        command += ["--generator", str(generator), "--data", json.dumps(remote_data), "--num-workers", "2"]
        command += ["--leases", "--lease-ttl-s", str(args.lease_ttl_s), "--log-level", "warning"]
        remote = RemoteWorkers(command, {MARKER: token}, root / "remote-workers.log", 2)
        stack.callback(remote.stop)
        run = Run(args, service, relay, remote, payload, token)
        plan = {
            (f"q{i}", epoch, repeat)
            for i in range(args.rows)
            for epoch in range(args.epochs)
            for repeat in range(args.repeats)
        }
        started = time.monotonic()
        try:
            left = asyncio.run(soak(run))
            export = exported(service.url)
        except BaseException:
            print(f"the service's log:\n{service.log_text()[-20000:]}", file=sys.stderr)
            raise
        elapsed = time.monotonic() - started
        service_log = service.log_text()
        service.stop()
        remote.stop()
        run.check_orphans(0.0)  # everything stopped: whatever still carries the marker
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while run.suspects and time.monotonic() < deadline:
            time.sleep(0.2)
            run.check_orphans(ORPHAN_GRACE_S)
        figures = account(run, export, plan)
        if left:
            figures["failures"].append("remote_left_running")
            figures["ok"] = False
        figures["elapsed_s"] = round(elapsed, 1)
        lines = figures.pop("evidence")
        if not figures["ok"]:
            lines += ["the service's log, lines of note:", *log_lines(service_log)]
            with contextlib.suppress(OSError):
                remote_log = (root / "remote-workers.log").read_text(errors="replace")
                lines += ["the remote workers' log, lines of note:", *log_lines(remote_log)]
        if args.keep:
            (root / "service.log").write_text(service_log)
            begun = run.tally.events[0][0] if run.tally.events else 0.0
            (root / "events.log").write_text(
                "".join(f"+{at - begun:7.2f}s {what}\n" for at, what in run.tally.events)
            )
            lines.append(f"the run's folder: {root}")
    if args.json:
        print(orjson.dumps(figures).decode())
    else:
        print(common.table(["figure", "value"], figures.items()))
    for line in lines:
        print(line, file=sys.stderr)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
