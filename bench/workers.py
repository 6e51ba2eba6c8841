"""Generation in worker processes: throughput at C in flight and latency L, and memory.

Three kinds of processes: the simulated policy server (every request takes L), the rollout
buffer, and the job's worker processes (``num_workers``, C trajectories in flight split between
them). A generator with a trivial reward, so the figure is the plumbing's. This script plays the
trainer, draining ``/get_rollout_data`` every second, and reports over ``--trajectories``:

- steady state: trajectories per second between 20% and 80% of the run, against the ideal C/L;
- overall: all of them, from ``/start_rollout`` to the last, against C/L;
- the service's RSS and each worker's (peak sampled every second);
- each worker's CPU time per trajectory, read from /proc every 50 ms while it runs (robust to
  other load on the machine, unlike the rates): ``worker_cpu_ms`` over the whole run, start-up
  included, and ``worker_steady_cpu_ms`` from the poll that first saw trajectories written;
- ``first_write_s``: seconds from ``/start_rollout`` to the first trajectory in the buffer
  (worker start-up, imports and the plan, plus one engine latency L).

    .venv/bin/python bench/workers.py                                  # C=2000, L=1 s, 2 workers
    .venv/bin/python bench/workers.py --concurrency 256 --latency-s 0.5 --workers 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
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


class CpuWatch:
    """The last CPU time read of each worker process, every 50 ms from a thread of its own (a
    process's /proc entry goes when it exits: the last reading is at most 50 ms before)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for pid in list(self.pids):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    self.last[pid] = common.cpu_seconds(pid)


def measure(concurrency: int, latency_s: float, workers: int, trajectories: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    generators = folder / "generator"
    (generators / "data").mkdir(parents=True)
    (generators / "bench_generator.py").write_text(GENERATOR)
    repeats = 8
    rows = trajectories // repeats
    with (generators / "data" / "rows.jsonl").open("w") as out:
        for index in range(rows):
            out.write(json.dumps({"instance_id": f"q{index}", "prompt": f"What is {index} + 1?"}) + "\n")
    simulator = common.Server(
        module="buffer.simulator", extra_args=["--latency-mean-s", str(latency_s), "--seed", "0"]
    )
    service = common.Server(group_size=repeats, extra_args=["--generator-dir", str(generators)])
    with simulator, service, httpx.Client(base_url=service.url, timeout=60.0) as client, CpuWatch() as cpu:
        payload = {
            "task_type": "bench",
            "input_file": str(generators / "data" / "rows.jsonl"),
            "remote_engine_url": simulator.url,
            "num_repeat_per_sample": repeats,
            "num_process": concurrency,
            "num_workers": workers,
            "max_tokens": 16,
        }
        started = time.monotonic()
        job = client.post("/start_rollout", json=payload).json()["job"]
        times: list[tuple[float, int]] = []
        peak_service = 0
        peak_workers: dict[int, int] = {}
        first_seen: tuple[int, float] | None = None  # (written, workers' CPU s) at the first write
        while True:
            client.post("/get_rollout_data", json={"task_type": "bench", "batch_size": -1})
            state = client.get(f"/jobs/{job['id']}").json()["data"]
            times.append((time.monotonic() - started, state["counters"]["written"]))
            cpu.pids.update(worker["pid"] for worker in state["workers"] if worker["pid"])
            if first_seen is None and times[-1][1] > 0:
                first_seen = (times[-1][1], sum(cpu.last.values()))
            peak_service = max(peak_service, common.rss_bytes(service.pid))
            for worker in state["workers"]:
                if worker["rss_bytes"]:
                    peak_workers[worker["index"]] = max(
                        peak_workers.get(worker["index"], 0), worker["rss_bytes"]
                    )
            if state["status"] != "running":
                break
            time.sleep(1.0 if first_seen else 0.1)  # finer until the first write, for first_write_s
        total = times[-1][1]
        elapsed = times[-1][0]
        low = next(t for t in times if t[1] >= 0.2 * total)
        high = next(t for t in times if t[1] >= 0.8 * total)
        steady = (high[1] - low[1]) / (high[0] - low[0]) if high[0] > low[0] else float("nan")
        ideal = concurrency / latency_s
        first_write_s = next(t for t, count in times if count > 0)
        cpu_s = sum(cpu.last.values())
        steady_cpu_ms = float("nan")
        if first_seen is not None and total > first_seen[0]:
            steady_cpu_ms = 1000 * (cpu_s - first_seen[1]) / (total - first_seen[0])
        return {
            "C": concurrency,
            "L_s": latency_s,
            "workers": workers,
            "status": state["status"],
            "trajectories": total,
            "steady_per_s": round(steady, 1),
            "steady_pct": round(100 * steady / ideal, 1),
            "overall_per_s": round(total / elapsed, 1),
            "overall_pct": round(100 * total / elapsed / ideal, 1),
            "service_rss_mb": round(peak_service / 2**20),
            "worker_rss_mb": [round(peak_workers[index] / 2**20) for index in sorted(peak_workers)],
            "worker_cpu_ms": round(1000 * cpu_s / total, 3) if total else float("nan"),
            "worker_steady_cpu_ms": round(steady_cpu_ms, 3),
            "first_write_s": round(first_write_s, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=2000)
    parser.add_argument("--latency-s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=8000)
    args = parser.parse_args()
    result = measure(args.concurrency, args.latency_s, args.workers, args.trajectories)
    print(common.table(list(result), [list(result.values())]))


if __name__ == "__main__":
    main()
