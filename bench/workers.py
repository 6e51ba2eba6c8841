"""Generation in worker processes: throughput at C in flight and latency L, and memory.

Three kinds of processes: the simulated policy server (every request takes L), the rollout
buffer, and the job's worker processes (``num_workers``, C trajectories in flight split between
them). A generator with a trivial reward, so the figure is the plumbing's. This script plays the
trainer, draining ``/get_rollout_data`` every second, and reports over ``--trajectories``:

- steady state: trajectories per second between 20% and 80% of the run, against the ideal C/L;
- overall: all of them, from ``/start_rollout`` to the last, against C/L;
- the service's RSS and each worker's (peak sampled every second).

    .venv/bin/python bench/workers.py                                  # C=2000, L=1 s, 2 workers
    .venv/bin/python bench/workers.py --concurrency 256 --latency-s 0.5 --workers 1
"""

from __future__ import annotations

import argparse
import json
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
    with simulator, service, httpx.Client(base_url=service.url, timeout=60.0) as client:
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
        while True:
            client.post("/get_rollout_data", json={"task_type": "bench", "batch_size": -1})
            state = client.get(f"/jobs/{job['id']}").json()["data"]
            times.append((time.monotonic() - started, state["counters"]["written"]))
            peak_service = max(peak_service, common.rss_bytes(service.pid))
            for worker in state["workers"]:
                if worker["rss_bytes"]:
                    peak_workers[worker["index"]] = max(
                        peak_workers.get(worker["index"], 0), worker["rss_bytes"]
                    )
            if state["status"] != "running":
                break
            time.sleep(1.0)
        total = times[-1][1]
        elapsed = times[-1][0]
        low = next(t for t in times if t[1] >= 0.2 * total)
        high = next(t for t in times if t[1] >= 0.8 * total)
        steady = (high[1] - low[1]) / (high[0] - low[0]) if high[0] > low[0] else float("nan")
        ideal = concurrency / latency_s
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
