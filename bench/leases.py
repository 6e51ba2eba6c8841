"""CPU per trajectory of a job's worker processes and of the service, leases and all.

A job with ``--workers`` worker processes (the toolkit, a trivial reward) makes
``--trajectories`` against the simulated policy server while this script drains the buffer.
Reported: CPU microseconds per trajectory of the service itself (``utime + stime``) and of its
worker processes together (the ``cutime + cstime`` the service collects when it reaps them).
CPU time, not wall time: it barely changes with whatever else the machine runs.

``--tree`` runs the service (and so its workers) from another checkout of this repository, to
compare, e.g. the commit before the job's workers took their work from the lease board:

    .venv/bin/python bench/leases.py
    git archive 44aa614 | tar -x -C /tmp/before && .venv/bin/python bench/leases.py --tree /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import httpx

GENERATOR = """
from buffer.toolkit import run_rollouts
TASK_TYPE = "bench"

async def run_rollout(data):
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat % 2))
"""

_TICKS = os.sysconf("SC_CLK_TCK")


def own_and_children_cpu_s(pid: int) -> tuple[float, float]:
    """A process's own CPU seconds, and those of its children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / _TICKS
    children = (int(fields[13]) + int(fields[14])) / _TICKS
    return own, children


def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-leases-"))
    generators = folder / "generator"
    (generators / "data").mkdir(parents=True)
    (generators / "bench_generator.py").write_text(GENERATOR)
    repeats = 8
    with (generators / "data" / "rows.jsonl").open("w") as out:
        for index in range(args.trajectories // repeats):
            out.write(json.dumps({"instance_id": f"q{index}", "prompt": f"What is {index} + 1?"}) + "\n")
    simulator = common.Server(
        module="buffer.simulator", extra_args=["--latency-mean-s", str(args.latency_s), "--seed", "0"]
    )
    entry = Path(args.tree).resolve() / "buffer.py"
    extra = ["--generator-dir", str(generators), "--input-roots", str(generators / "data")]
    service = common.Server(group_size=repeats, entry=entry, extra_args=extra)
    with simulator, service, httpx.Client(base_url=service.url, timeout=60.0) as client:
        payload = {
            "task_type": "bench",
            "input_file": str(generators / "data" / "rows.jsonl"),
            "remote_engine_url": simulator.url,
            "num_repeat_per_sample": repeats,
            "num_process": args.concurrency,
            "num_workers": args.workers,
            "max_tokens": 16,
        }
        own_before, _ = own_and_children_cpu_s(service.pid)
        started = time.monotonic()
        job = client.post("/start_rollout", json=payload).json()["job"]
        while True:
            client.post("/get_rollout_data", json={"task_type": "bench", "batch_size": -1})
            state = client.get(f"/jobs/{job['id']}").json()["data"]
            if state["status"] != "running":
                break
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        time.sleep(0.5)  # the workers are reaped
        own_after, workers_cpu = own_and_children_cpu_s(service.pid)
        written = state["counters"]["written"]
        return {
            "tree": str(args.tree),
            "workers": args.workers,
            "C": args.concurrency,
            "status": state["status"],
            "trajectories": written,
            "wall_s": round(elapsed, 1),
            "service_us_per_traj": round(1e6 * (own_after - own_before) / written, 1),
            "workers_us_per_traj": round(1e6 * workers_cpu / written, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", default=str(common.REPO), help="the checkout whose service runs")
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--latency-s", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=8000)
    args = parser.parse_args()
    result = measure(args)
    print(common.table(list(result), [list(result.values())]))


if __name__ == "__main__":
    main()
