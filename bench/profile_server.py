"""Where the server's CPU time goes under one benchmark's load, sampled with py-spy.

Starts a server on a free loopback port, attaches ``py-spy record`` to it, drives one load
(``--duration`` seconds for write and batch), and prints the share of samples by package (of
the innermost Python frame), the functions with the most self time, and the project's functions
by inclusive time.
Percentages are of the samples taken while the server was running Python code (idle time in the
event loop is not sampled); C work shows up in the Python function that called it.

Loads (``--load``):

- ``write``: wrk posting single ~2 KB trajectories, each a new group (as in write_rate.py).
- ``batch``: one httpx client posting batches of 1,000 (as in write_batch.py).
- ``read``: before sampling starts, fill ``--reads`` x 1,000 ready groups of 8; then read them
  1,000 groups at a time with ``POST /get_rollout_data`` (``{"batch_size": 8000}``).

Needs py-spy (``.venv/bin/pip install py-spy``); ``--save`` keeps the collapsed stacks.

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/profile_server.py --load write
    .venv/bin/python bench/profile_server.py --load batch --duration 10
    .venv/bin/python bench/profile_server.py --load read --reads 20 --save /tmp/read.folded
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import common
import httpx
import orjson
import write_rate

FRAME = re.compile(r"^(?P<name>.*) \((?P<path>.*?):(?P<line>\d+)\)$")


def frame_key(frame: str) -> tuple[str, str]:
    """``(function [file], package)`` for one py-spy frame ``name (path:line)``."""
    match = FRAME.match(frame)
    if match is None:
        return frame, "?"
    path = match["path"]
    if str(common.REPO) in path:
        path = path.split(str(common.REPO) + "/", 1)[1]
    path = path.split("site-packages/")[-1]
    package = "project" if path.startswith(("buffer/", "default_func")) else path.split("/")[0]
    return f"{match['name']} [{path}]", package


def report(folded: Path, only: str | None, top: int) -> None:
    total = 0
    by_package: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or (only and only not in stack):
            continue
        n = int(count)
        total += n
        frames = [frame_key(frame) for frame in stack.split(";")]
        self_time[frames[-1][0]] += n
        by_package[frames[-1][1]] += n
        for name in {name for name, package in frames if package == "project"}:
            inclusive[name] += n
    if not total:
        print("no samples")
        return
    print(f"\n{total:,} samples" + (f" under {only!r}" if only else ""))
    print("\nself time by package (innermost Python frame):")
    for name, n in by_package.most_common(10):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("\nself time by function:")
    for name, n in self_time.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("\nproject functions, inclusive:")
    for name, n in inclusive.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")


def load_write(server: common.Server, args: argparse.Namespace, workdir: Path) -> None:
    script = workdir / "write.lua"
    script.write_text(write_rate.lua_script(f"prof-{uuid.uuid4().hex[:6]}-", common.DEFAULT_TRAJECTORY_BYTES))
    wrk_args = write_rate.build_parser().parse_args(["--connections", str(args.connections)])
    result = write_rate.run_wrk(wrk_args, server.url, script, args.duration)
    print(f"  wrk: {result['rate']:,.0f} writes/s")


def load_batch(server: common.Server, args: argparse.Namespace) -> None:
    tag = uuid.uuid4().hex[:6]
    headers = {"content-type": "application/json"}
    sent = 0
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        start = time.perf_counter()
        while time.perf_counter() - start < args.duration:
            body = orjson.dumps(
                [
                    common.make_trajectory(f"{tag}-{sent + i}", f"{tag}-{sent + i}", 0.5, seed=i)
                    for i in range(1000)
                ]
            )
            client.post("/buffer/write_batch", content=body, headers=headers).raise_for_status()
            sent += 1000
    print(f"  wrote {sent:,} trajectories in batches of 1,000")


def fill_ready(server: common.Server, args: argparse.Namespace) -> None:
    """Before sampling starts: ``--reads`` x 1,000 ready groups of 8, rewards varied."""
    rng = random.Random(7)
    tag = uuid.uuid4().hex[:6]
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        common.fill(
            client,
            (
                common.make_trajectory(f"{tag}-{g}", f"{tag}-{g}-{i}", rng.random(), seed=g * 8 + i)
                for g in range(1000 * args.reads)
                for i in range(8)
            ),
        )


def load_read(server: common.Server, args: argparse.Namespace) -> None:
    """Reads of 1,000 groups each (``batch_size`` 8,000: the same work as ``{}`` on 1,000)."""
    with common.RawClient(server.port) as raw:
        for _ in range(args.reads):
            status, _, total_s, _ = raw.request("POST", "/get_rollout_data", b'{"batch_size": 8000}')
            print(f"  read: {status}, {total_s * 1000:.1f} ms")


def main() -> None:
    common.raise_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", choices=["write", "batch", "read"], default="write")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load (default 15)")
    parser.add_argument("--rate", type=int, default=None, help="py-spy samples/s (default 250; read: 1000)")
    parser.add_argument("--reads", type=int, default=10, help="reads of 1,000 groups for --load read")
    parser.add_argument("--connections", type=int, default=16, help="wrk -c for --load write")
    parser.add_argument(
        "--only", default=None, help="count only stacks containing this (read: get_rollout_data)"
    )
    parser.add_argument("--top", type=int, default=20, help="functions listed (default 20)")
    parser.add_argument("--save", type=Path, default=None, help="keep the collapsed stacks here")
    parser.add_argument(
        "--py-spy", default=str(Path(sys.executable).with_name("py-spy")), help="py-spy binary"
    )
    args = parser.parse_args()
    spy_bin = args.py_spy if Path(args.py_spy).exists() else shutil.which("py-spy")
    if spy_bin is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    rate = args.rate or (1000 if args.load == "read" else 250)
    with tempfile.TemporaryDirectory(prefix="bench-prof-") as tmp, common.Server(8) as server:
        if args.load == "read":
            fill_ready(server, args)
        folded = args.save or Path(tmp) / "stacks.folded"
        spy_cmd = [spy_bin, "record", "--pid", str(server.pid), "--rate", str(rate), "--format", "raw"]
        spy = subprocess.Popen(
            [*spy_cmd, "--nonblocking", "--output", str(folded)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            time.sleep(1.0)  # let py-spy attach
            print(f"profiling the {args.load} load (server pid {server.pid})")
            if args.load == "write":
                load_write(server, args, Path(tmp))
            elif args.load == "batch":
                load_batch(server, args)
            else:
                load_read(server, args)
        finally:
            spy.send_signal(signal.SIGINT)
            try:
                _, errors = spy.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, errors = spy.communicate()
        if not folded.exists():
            raise SystemExit(f"py-spy wrote nothing:\n{errors.decode(errors='replace')}")
        report(folded, args.only, args.top)


if __name__ == "__main__":
    main()
