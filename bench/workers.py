"""Generation throughput, issue 13's figure: a finite job, from ``/start_rollout`` to its last trajectory.

Three kinds of processes: the simulated policy server (every request takes L), the rollout
buffer, and the job's worker processes (``--workers``; C trajectories in flight split between
them). This script plays the trainer, draining ``/get_rollout_data`` as it polls, and reports
over ``--trajectories`` (the data set has trajectories / 8 rows, 8 samples each, one epoch):

- steady state: trajectories per second between 20% and 80% of the run, against the ideal C/L;
- overall: all of them, from ``/start_rollout`` to the last one written, against C/L (worker
  start-up and the first L, when nothing can finish yet, included);
- each process's CPU per trajectory in ms (the simulator, the service, the workers together; from
  /proc, so other load on the machine barely changes it) and peak resident memory; for the
  workers also from their first write on (``workers_steady_cpu_ms``: start-up left out);
- ``first_write_s``: seconds from ``/start_rollout`` to the first trajectory in the buffer
  (worker start-up, imports and the plan, plus one engine latency L).

``--generator trivial`` is a generator with a constant-time reward, so the figure is the
plumbing's; ``--generator math`` is the shipped math task (``generator/base_generator.py``,
math-verify rewards). ``--abort-rate`` makes the engine abort that share of replies, which the
toolkit continues from their tokens.

    .venv/bin/python bench/workers.py                                  # C=2000, L=1 s, 2 workers
    .venv/bin/python bench/workers.py --concurrency 256 --latency-s 0.5 --workers 1 --generator math
    .venv/bin/python bench/workers.py --concurrency 64 --latency-s 0.2 --abort-rate 0.1 --workers 1 \
        --generator math
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

TRIVIAL = """
from buffer.toolkit import run_rollouts
TASK_TYPE = "bench"

async def run_rollout(data):
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat % 2))
"""
REPEATS = 8


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


def _data(folder: Path, rows: int) -> Path:
    """``rows`` distinct arithmetic questions with their answers (what both generators read)."""
    path = folder / "rows.jsonl"
    with path.open("w") as out:
        for index in range(rows):
            question = f"What is {index} + {index % 97 + 1}?"
            label = str(index + index % 97 + 1)
            out.write(json.dumps({"instance_id": f"q{index}", "prompt": question, "label": label}) + "\n")
    return path


def measure(
    concurrency: int,
    latency_s: float,
    workers: int,
    trajectories: int,
    generator: str = "trivial",
    abort_rate: float = 0.0,
    poll_s: float = 0.25,
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    if generator == "trivial":
        generators = folder / "generator"
        generators.mkdir()
        (generators / "bench_generator.py").write_text(TRIVIAL)
        task, max_tokens = "bench", 16
    else:
        generators, task, max_tokens = common.REPO / "generator", "math", 256
    data = _data(folder, trajectories // REPEATS)
    simulator = common.Server(
        module="buffer.simulator",
        extra_args=["--latency-mean-s", str(latency_s), "--abort-rate", str(abort_rate), "--seed", "0"],
    )
    service = common.Server(
        group_size=REPEATS,
        extra_args=["--generator-dir", str(generators), "--input-roots", str(folder)],
    )
    with (
        simulator,
        service,
        httpx.Client(base_url=service.url, timeout=60.0) as client,
        CpuWatch() as cpu,
    ):
        payload = {
            "task_type": task,
            "input_file": str(data),
            "remote_engine_url": simulator.url,
            "num_repeat_per_sample": REPEATS,
            "num_process": concurrency,
            "num_workers": workers,
            "num_epoch": 1,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0},
        }
        processes = {"simulator": simulator.pid, "service": service.pid}
        cpu_before = {name: common.cpu_seconds(pid) for name, pid in processes.items()}
        started = time.monotonic()
        answer = client.post("/start_rollout", json=payload)
        answer.raise_for_status()
        job = answer.json()["job"]
        times: list[tuple[float, int]] = []
        peak_service = 0
        peak_workers: dict[int, int] = {}
        first_seen: tuple[int, float] | None = None  # (written, workers' CPU s) at the first write
        while True:
            client.post("/get_rollout_data", json={"task_type": task, "batch_size": -1})
            state = client.get(f"/jobs/{job['id']}").json()["data"]
            times.append((time.monotonic() - started, state["counters"]["written"]))
            cpu.pids.update(worker["pid"] for worker in state["workers"] if worker["pid"])
            if first_seen is None and times[-1][1] > 0:
                first_seen = (times[-1][1], sum(cpu.last.values()))
            peak_service = max(peak_service, common.rss_bytes(service.pid))
            for worker in state["workers"]:
                if worker["rss_bytes"]:
                    index = worker["index"]
                    peak_workers[index] = max(peak_workers.get(index, 0), worker["rss_bytes"])
            if state["status"] != "running":
                break
            time.sleep(poll_s if first_seen else 0.1)  # finer until the first write, for first_write_s
        cpu_after = {name: common.cpu_seconds(pid) for name, pid in processes.items()}
        total = times[-1][1]
        finished = next(t for t in times if t[1] >= total)[0]  # the first poll that saw the last one
        low = next(t for t in times if t[1] >= 0.2 * total)
        high = next(t for t in times if t[1] >= 0.8 * total)
        steady = (high[1] - low[1]) / (high[0] - low[0]) if high[0] > low[0] else float("nan")
        ideal = concurrency / latency_s
        first_write_s = next(t for t, count in times if count > 0)
        workers_cpu_s = sum(cpu.last.values())
        steady_cpu_ms = float("nan")
        if first_seen is not None and total > first_seen[0]:
            steady_cpu_ms = 1000 * (workers_cpu_s - first_seen[1]) / (total - first_seen[0])
        per_trajectory_ms = {
            name: round(1000 * (cpu_after[name] - cpu_before[name]) / max(1, total), 3) for name in processes
        }
        return {
            "C": concurrency,
            "L_s": latency_s,
            "aborts": abort_rate,
            "generator": generator,
            "workers": workers,
            "status": state["status"],
            "trajectories": total,
            "steady_per_s": round(steady, 1),
            "steady_pct": round(100 * steady / ideal, 1),
            "overall_per_s": round(total / finished, 1),
            "overall_pct": round(100 * total / finished / ideal, 1),
            "simulator_cpu_ms": per_trajectory_ms["simulator"],
            "service_cpu_ms": per_trajectory_ms["service"],
            "workers_cpu_ms": round(1000 * workers_cpu_s / max(1, total), 3),
            "workers_steady_cpu_ms": round(steady_cpu_ms, 3),
            "first_write_s": round(first_write_s, 2),
            "service_rss_mb": round(peak_service / 2**20),
            "worker_rss_mb": [round(peak_workers[index] / 2**20) for index in sorted(peak_workers)],
        }


def main() -> None:
    common.raise_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=2000)
    parser.add_argument("--latency-s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=40_000)
    parser.add_argument("--generator", choices=["trivial", "math"], default="trivial")
    parser.add_argument("--abort-rate", type=float, default=0.0, help="share of replies the engine aborts")
    parser.add_argument("--repeat", type=int, default=1, help="runs, one after another")
    parser.add_argument("--json", action="store_true", help="one JSON line per run instead of a table")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        result = measure(
            args.concurrency,
            args.latency_s,
            args.workers,
            args.trajectories,
            args.generator,
            args.abort_rate,
        )
        if args.json:
            print(json.dumps(result), flush=True)
        rows.append(result)
    if not args.json:
        print(common.table(list(rows[0]), [list(row.values()) for row in rows]))


if __name__ == "__main__":
    main()
