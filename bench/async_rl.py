"""A scripted asynchronous RL run against the simulator: versions, pause/resume, staleness.

The service (``python buffer.py``) runs the math generator against the simulated SGLang
server; this script plays the trainer. Each step it gathers ``--groups-per-step`` groups,
checks every served sample's version lag, then pauses generation (``abort``: the simulator
aborts what is in flight, the toolkit continues it after the resume), "trains" for
``--train-s``, updates the simulator's weights and resumes at the next version.

Printed (``--json`` for one JSON object): the largest lag served, stale and filtered groups
(``stale_share``: the groups made in full and then set aside as stale, over all made in full;
``cancelled_stale_groups``: those cancelled in flight instead, nothing of them written),
failed / refused / left-aborted trajectories (lost ones), aborted replies served, whether every
step got a full batch, and where the engines' time went between pauses: ``slot_breakdown``
splits the slots' open time (``--num-process`` x seconds not paused) into requests at the
engine, samples holding a slot off the engine (reward, write), and free slots by what the run
waited on: admission's round trip, the staleness bound (no room), the plan's claims, other
(``buffer.policy.slots``). A worker process takes its admission from its socket to the service
(``buffer.policy.channel``): the service counts the bound from the moment the worker began to
wait, if it had no room then, so the round trip is the grant's way back to the run (and a wait
the service had room for); over HTTP it was counted from the ask's arrival.
``generation_vs_slots``: the engine share of it all (mean requests in flight over
``--num-process``); ``generation_vs_ideal``: the engine share of what the bound left,
``engine / (1 - staleness_bound)`` (1.0: no slot idle while the trainer would have taken
another group in time); ``mean_step_s``: how long the trainer waited for each batch. Run as
``python bench/async_rl.py``; the README's figures come from it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from buffer.processes import free_port, started, wait_ready  # noqa: E402


def math_rows(path: Path, count: int) -> Path:
    rows = [
        {"instance_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(
    *,
    steps: int = 50,
    max_staleness: int = 1,
    groups_per_step: int = 4,
    group_size: int = 2,
    num_process: int | None = None,
    latency_s: float = 0.05,
    accuracy: float = 0.5,
    abort_rate: float = 0.0,
    train_s: float = 0.1,
    pause_mode: str = "abort",
    isolation: str = "process",
    declare_batch: bool = False,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """One run; returns its figures. ``accuracy`` 0.5 with ``group_size`` 2 makes half the
    groups zero-variance (both right or both wrong), which the default filter drops."""
    own = tempfile.TemporaryDirectory() if workdir is None else None
    folder = Path(own.name) if own is not None else workdir
    assert folder is not None
    num_process = num_process or groups_per_step * group_size
    try:
        sim_port, buffer_port = free_port(), free_port()
        sim_url, buffer_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{buffer_port}"
        sim = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(sim_port)]
        sim += ["--latency-mean-s", str(latency_s), "--accuracy", str(accuracy), "--seed", "7"]
        sim += ["--abort-rate", str(abort_rate), "--log-level", "warning"]
        service = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(buffer_port)]
        service += ["--log-level", "warning", "--input-roots", str(folder), "--job-isolation", isolation]
        with (
            started(sim, "simulator", folder / "simulator.log") as sim_process,
            started(service, "buffer", folder / "buffer.log") as buffer_process,
        ):
            wait_ready(f"{sim_url}/health", sim_process, 60, "the simulator")
            wait_ready(f"{buffer_url}/health", buffer_process, 60, "the buffer")
            with httpx.Client(base_url=buffer_url, timeout=60, trust_env=False) as client:
                return _trainer(
                    client,
                    sim_url,
                    math_rows(folder / "math.jsonl", 64),
                    steps=steps,
                    max_staleness=max_staleness,
                    groups_per_step=groups_per_step,
                    group_size=group_size,
                    num_process=num_process,
                    train_s=train_s,
                    pause_mode=pause_mode,
                    declare_batch=declare_batch,
                )
    finally:
        if own is not None:
            own.cleanup()


def _trainer(
    client: httpx.Client,
    sim_url: str,
    input_file: Path,
    *,
    steps: int,
    max_staleness: int,
    groups_per_step: int,
    group_size: int,
    num_process: int,
    train_s: float,
    pause_mode: str,
    declare_batch: bool,
) -> dict[str, Any]:
    version = 0
    declared = {"rollout_batch_size": groups_per_step} if declare_batch else {}
    client.post("/policy", json={"version": version, **declared}).raise_for_status()
    epochs = math.ceil(steps * groups_per_step * 4 / 64) + 1  # room for the filter's drops
    started_job = client.post(
        "/start_rollout",
        json={
            "task_type": "math",
            "input_file": str(input_file),
            "remote_engine_url": sim_url,
            "num_repeat_per_sample": str(group_size),
            "num_epoch": str(epochs),
            "num_process": str(num_process),
            "max_staleness": max_staleness,
            "max_continuations": 1000,
            "abort_retry_delay_s": 0.0,
            "sampling_params": {"max_tokens": 64, "temperature": 1.0},
        },
    )
    started_job.raise_for_status()
    job_id = started_job.json()["job_id"]
    lags: Counter[int] = Counter()
    served_samples = 0
    served_groups = 0
    aborted_served = 0
    unknown_version = 0
    full_batches = 0
    step_s: list[float] = []
    began = time.monotonic()
    for _ in range(steps):
        step_began = time.monotonic()
        groups = 0
        deadline = time.monotonic() + 120
        while groups < groups_per_step and time.monotonic() < deadline:
            want = (groups_per_step - groups) * group_size
            answer = client.post(
                "/get_rollout_data", json={"task_type": "math", "batch_size": want, "wait_s": 5}
            ).json()
            items = answer["data"]["data"]
            got = len({item["instance_id"] for item in items if "padded_from" not in item["extra_info"]})
            groups += got
            served_groups += got
            for item in items:
                served_samples += 1
                info = item["extra_info"]
                low = info.get("policy_version_min")
                if low is None:
                    unknown_version += 1
                else:
                    lags[version - int(low)] += 1
                if info.get("finish_reason") == "abort" or any(
                    turn.get("finish_reason") == "abort" for turn in item.get("turns") or []
                ):
                    aborted_served += 1
        full_batches += groups >= groups_per_step
        step_s.append(time.monotonic() - step_began)
        client.post("/policy/pause", json={"mode": pause_mode, "engine_urls": [sim_url]}).raise_for_status()
        time.sleep(train_s)  # the trainer trains and syncs the weights
        version += 1
        httpx.post(f"{sim_url}/update_weights_from_disk", json={"weight_version": str(version)}, timeout=30)
        client.post("/policy/resume", json={"version": version}).raise_for_status()
    elapsed = time.monotonic() - began
    policy = client.get("/policy").json()["data"]
    client.post(f"/jobs/{job_id}/cancel")
    job = client.get(f"/jobs/{job_id}").json()["data"]
    progress = job.get("progress", {})
    stats = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["math"]
    discarded = stats.get("discarded_groups", {})
    gate = policy["gate"]
    admission = policy["admission"].get("math") or {}
    # Every group made in full: served, discarded (filtered or stale), or still ready at the end.
    generated = served_groups + sum(discarded.values()) + stats.get("ready_groups", 0)
    slots = _slot_breakdown(progress)
    return {
        "steps": steps,
        "max_staleness": max_staleness,
        "groups_per_step": groups_per_step,
        "group_size": group_size,
        "num_process": num_process,
        "pause_mode": pause_mode,
        "elapsed_s": round(elapsed, 2),
        "full_batches": full_batches,
        "served_samples": served_samples,
        "max_lag": max(lags) if lags else None,
        "lag_histogram": {str(lag): count for lag, count in sorted(lags.items())},
        "samples_without_version": unknown_version,
        "aborted_replies_served": aborted_served,
        "stale_groups": discarded.get("stale", 0),
        "generated_groups": generated,
        "stale_share": round(discarded.get("stale", 0) / generated, 4) if generated else None,
        "cancelled_stale_groups": admission.get("cancelled_stale", 0),
        "cancelled_stale_samples": progress.get("cancelled_stale", 0),
        "filtered_groups": sum(count for reason, count in discarded.items() if reason != "stale"),
        "discarded_groups": discarded,
        "trajectories_completed": progress.get("completed"),
        "trajectories_lost": progress.get("completed", 0) - stats["total_written"],
        "trajectories_failed": progress.get("failed"),
        "trajectories_refused": progress.get("rejected"),
        "trajectories_left_aborted": progress.get("aborted"),
        "paused_s": progress.get("gate_paused_s", gate["paused_s"]),
        "open_s": progress.get("gate_open_s", gate["open_s"]),
        "generation_vs_slots": _vs_slots(gate, progress, num_process),
        "generation_vs_ideal": _vs_admitted(slots),
        "slot_breakdown": slots,
        "mean_step_s": round(sum(step_s) / len(step_s), 4) if step_s else None,
        "admission": admission,
    }


def _vs_slots(gate: dict[str, Any], progress: dict[str, Any], num_process: int) -> float:
    """Mean engine requests in flight while open, over ``num_process``: from the generator's own
    gate when it runs in a worker process (its progress), else from the service's."""
    if progress.get("gate_open_s"):
        return round(progress["gate_busy_s"] / progress["gate_open_s"] / num_process, 4)
    return round(gate["mean_in_flight_open"] / num_process, 4)


def _vs_admitted(slots: dict[str, float]) -> float | None:
    """The slots' open time at the engine, over the open time the staleness bound left them
    (not free for want of room): 1.0, no slot idle while the trainer would take more in time."""
    if not slots or slots["staleness_bound"] >= 1:
        return None
    return round(slots["engine"] / (1 - slots["staleness_bound"]), 4)


def _slot_breakdown(progress: dict[str, Any]) -> dict[str, float]:
    """The share of the slots' open time (``--num-process`` x seconds not paused) each spent:
    at the engine, held by a sample off the engine (its reward, its write, between requests),
    free while waiting on admission's round trip, free while the staleness bound had no room,
    free otherwise (``buffer.policy.slots``)."""
    slots = progress.get("slot_s") or {}
    total = slots.get("open") or 0.0
    if not total:
        return {}
    engine = progress.get("gate_busy_s", 0.0)
    parts = {
        "engine": engine,
        "sample_off_engine": slots["held"] - engine,
        "admission_round_trip": slots["admission"],
        "staleness_bound": slots["bound"],
        "plan_claims": slots.get("plan", 0.0),
        "other_free": slots["other"],
    }
    return {name: round(value / total, 4) for name, value in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--num-process", type=int, default=None)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--accuracy", type=float, default=0.5)
    parser.add_argument("--train-s", type=float, default=0.1)
    parser.add_argument("--pause-mode", choices=("abort", "drain"), default="abort")
    parser.add_argument(
        "--isolation", choices=("process", "inline"), default="process", help="where the generator runs"
    )
    parser.add_argument(
        "--declare-batch",
        action="store_true",
        help="say the batch (rollout_batch_size) in POST /policy; else admission learns it from reads",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = run(
        steps=args.steps,
        max_staleness=args.max_staleness,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        num_process=args.num_process,
        latency_s=args.latency_s,
        accuracy=args.accuracy,
        train_s=args.train_s,
        pause_mode=args.pause_mode,
        isolation=args.isolation,
        declare_batch=args.declare_batch,
    )
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
