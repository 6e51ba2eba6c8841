"""The example run (``rollout_buffer_example.sh``): a policy server, the buffer, a math
rollout, and a trainer that polls the buffer for a few steps.

The policy server is, in order: ``--engine-url`` (``ENGINE_URL``) when given; SGLang
(``python -m sglang.launch_server``) when ``--sglang-model-path`` (``SGLANG_MODEL_PATH``) is
given and sglang is installed; else the simulated server, ``python -m buffer.simulator``.
Every process it starts binds 127.0.0.1 and is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from buffer import processes
from buffer.paths import ROOT
from buffer.processes import free_port, wait_ready

DEFAULT_DATA = ROOT / "generator" / "data" / "math.jsonl"


@contextlib.contextmanager
def started(command: Sequence[str], name: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``processes.started``, saying where its log is once it is stopped."""
    try:
        with processes.started(command, name, log) as process:
            yield process
    finally:
        print(f"stopped {name} (log: {log})")


def engine(args: argparse.Namespace, stack: contextlib.ExitStack, logs: Path) -> str:
    if args.engine_url:
        print(f"policy server: {args.engine_url} (ENGINE_URL)")
        return str(args.engine_url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.sglang_model_path:
        if importlib.util.find_spec("sglang") is None:
            raise SystemExit(
                "SGLANG_MODEL_PATH is set but sglang is not installed (pip install -e '.[sglang]')"
            )
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.sglang_model_path]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        process = stack.enter_context(started(command, "sglang", logs / "sglang.log"))
        print(f"policy server: SGLang serving {args.sglang_model_path} at {url}")
        wait_ready(f"{url}/health", process, 900, "sglang")
        return url
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--latency-mean-s", str(args.sim_latency_s), "--latency", "uniform"]
    command += ["--latency-jitter-s", str(args.sim_latency_s / 2), "--accuracy", str(args.sim_accuracy)]
    command += ["--abort-rate", "0.05", "--error-rate", "0.02", "--seed", "0", "--log-level", "warning"]
    process = stack.enter_context(started(command, "simulated policy server", logs / "simulator.log"))
    print(f"policy server: simulated at {url} (accuracy {args.sim_accuracy}, 5% aborts, 2% errors)")
    wait_ready(f"{url}/health", process, 60, "the simulated policy server")
    return url


def train(client: httpx.Client, args: argparse.Namespace) -> None:
    """Act as the trainer: each step takes ``--groups-per-step`` whole groups."""
    for step in range(1, args.steps + 1):
        started_at = time.monotonic()
        items: list[dict[str, Any]] = []
        deadline = started_at + args.step_timeout_s
        while len(items) < args.groups_per_step * args.group_size:
            if time.monotonic() > deadline:
                raise SystemExit(f"step {step}: no full batch within {args.step_timeout_s:.0f} s")
            wanted = args.groups_per_step * args.group_size - len(items)
            response = client.post("/get_rollout_data", json={"batch_size": wanted, "wait_s": 5})
            response.raise_for_status()
            body = response.json()
            if body["success"]:
                items.extend(body["data"]["data"])
        elapsed = time.monotonic() - started_at
        groups = len({item["instance_id"] for item in items})
        raw = [item["raw_reward"] for item in items if "raw_reward" in item]
        mean = sum(raw) / len(raw) if raw else float("nan")
        print(
            f"step {step}: {groups} groups, {len(items)} samples, "
            f"mean raw reward {mean:.3f}, {len(items) / elapsed:.1f} samples/s"
        )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="rollout_buffer_example.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=int(env("STEPS", "5")), help="trainer steps (STEPS)")
    parser.add_argument(
        "--engine-url", default=env("ENGINE_URL"), help="an OpenAI-compatible server (ENGINE_URL)"
    )
    parser.add_argument(
        "--sglang-model-path", default=env("SGLANG_MODEL_PATH"), help="launch SGLang on this model"
    )
    parser.add_argument("--input-file", default=str(DEFAULT_DATA), help="JSONL data set in slime's format")
    parser.add_argument(
        "--group-size", type=int, default=8, help="samples per prompt (num_repeat_per_sample)"
    )
    parser.add_argument("--groups-per-step", type=int, default=8, help="prompts per trainer step")
    parser.add_argument("--num-process", type=int, default=64, help="trajectories in flight")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sim-latency-s", type=float, default=0.2, help="simulated server: mean latency")
    parser.add_argument(
        "--sim-accuracy", type=float, default=0.6, help="simulated server: share of right answers"
    )
    parser.add_argument("--step-timeout-s", type=float, default=120.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logs = Path(os.environ.get("LOG_DIR", ROOT / ".example-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            engine_url = engine(args, stack, logs)
            port = free_port()
            buffer_url = f"http://127.0.0.1:{port}"
            command = [
                sys.executable,
                "buffer.py",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "info",
                "--input-roots",  # the data set may lie anywhere: the demo names it
                str(Path(args.input_file).resolve().parent),
            ]
            process = stack.enter_context(started(command, "rollout buffer", logs / "buffer.log"))
            wait_ready(f"{buffer_url}/health", process, 60, "the rollout buffer")
            print(f"rollout buffer: {buffer_url}")
            client = stack.enter_context(httpx.Client(base_url=buffer_url, timeout=60.0, trust_env=False))
            payload = {  # slime's trainer payload, numbers as strings
                "task_type": "math",
                "input_file": args.input_file,
                "remote_engine_url": engine_url,
                "remote_buffer_url": buffer_url,
                "num_repeat_per_sample": str(args.group_size),
                "num_process": str(args.num_process),
                "num_epoch": "100",
                "max_tokens": str(args.max_tokens),
                "sampling_params": {"max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0},
                "skip_instance_ids": [],
            }
            started_rollout = client.post("/start_rollout", json=payload)
            started_rollout.raise_for_status()
            job_id = started_rollout.json()["job_id"]
            print(f"started the math rollout: {job_id}")
            train(client, args)
            job = client.get(f"/jobs/{job_id}").json()["data"]
            done = job["progress"]
            print(
                f"generator: {done.get('completed', 0)} trajectories, {done.get('failed', 0)} failed, "
                f"{done.get('trajectories_per_s', 0)}/s; job {job['status']}"
            )
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
