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


class NoBatch(Exception):
    """A trainer step waited its whole ``--step-timeout-s``."""


def why_no_batch(client: httpx.Client, job_id: str, engine_url: str, model: str | None, log: Path) -> str:
    """What the job says (its status, error, progress), and whether the engine answers and
    serves the model asked for: the usual reasons a batch never comes."""
    job = client.get(f"/jobs/{job_id}").json()["data"]
    lines = [f"the job {job_id} is {job['status']}"]
    if job.get("error"):
        lines[0] += f": {job['error']}" + (f" (at {job['where']})" if job.get("where") else "")
    progress = job.get("progress") or {}
    if progress:
        lines.append(
            f"its generator made {progress.get('completed', 0)} trajectories, "
            f"{progress.get('failed', 0)} failed"
        )
    served = engine_models(engine_url)
    if served is None:
        lines.append(f"the engine at {engine_url} does not answer GET /v1/models")
    elif model is not None and model not in served:
        lines.append(f"the engine serves {', '.join(served) or 'no model'}, not {model!r}: give --model")
    lines.append(f"the buffer's log has the details: {log}")
    return "; ".join(lines)


def engine_models(engine_url: str) -> list[str] | None:
    """The ids the engine's ``GET /v1/models`` lists; None if it does not answer."""
    try:
        answer = httpx.get(f"{engine_url.rstrip('/')}/v1/models", timeout=10.0, trust_env=False)
        answer.raise_for_status()
        return [str(entry["id"]) for entry in answer.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def model_for(args: argparse.Namespace, engine_url: str) -> str | None:
    """``--model``; else, for an engine of one's own (``--engine-url``), the one it serves
    (vLLM answers 404 to any other name); else none, and the generator sends its default."""
    if args.model or not args.engine_url:
        return str(args.model) if args.model else None
    served = engine_models(engine_url)
    if served is not None and len(served) == 1:
        print(f"model: {served[0]} (the only one the engine serves; --model to name another)")
        return served[0]
    return None


def train(client: httpx.Client, args: argparse.Namespace, job_id: str) -> None:
    """Act as the trainer: each step takes ``--groups-per-step`` whole groups; a step stops
    at once when the generator's job has ended (a misconfigured engine fails it fast)."""
    for step in range(1, args.steps + 1):
        started_at = time.monotonic()
        items: list[dict[str, Any]] = []
        deadline = started_at + args.step_timeout_s
        while len(items) < args.groups_per_step * args.group_size:
            if time.monotonic() > deadline:
                raise NoBatch(f"step {step}: no full batch within {args.step_timeout_s:.0f} s")
            wanted = args.groups_per_step * args.group_size - len(items)
            response = client.post("/get_rollout_data", json={"batch_size": wanted, "wait_s": 5})
            response.raise_for_status()
            body = response.json()
            if body["success"]:
                items.extend(body["data"]["data"])
            elif client.get(f"/jobs/{job_id}").json()["data"]["status"] != "running":
                raise NoBatch(f"step {step}: no full batch, and the generator's job has ended")
        elapsed = time.monotonic() - started_at
        groups = len({item["instance_id"] for item in items})
        raw = [item["raw_reward"] for item in items if "raw_reward" in item]
        mean = sum(raw) / len(raw) if raw else float("nan")
        print(
            f"step {step}: {groups} groups, {len(items)} samples, "
            f"mean raw reward {mean:.3f}, {len(items) / elapsed:.1f} samples/s"
        )


def closing_line(client: httpx.Client, job_id: str) -> str:
    """The generator's counts once the trainer is done: its job is stopped first, so they are
    its last (its workers' final reports), not those of a second ago."""
    client.post(f"/jobs/{job_id}/cancel").raise_for_status()  # returns once its workers are gone
    job = client.get(f"/jobs/{job_id}").json()["data"]
    done = job["progress"]
    completed = done.get("completed", 0)
    rate = completed / job["duration_s"] if job["duration_s"] else 0.0
    return (
        f"generator: {completed} trajectories ({job['counters']['written']} written), "
        f"{done.get('failed', 0)} failed, {rate:.1f}/s; job {job['status']} after the trainer's steps"
    )


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse(argv: Sequence[str] | None, prog: str = "rollout_buffer_example.sh") -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=_WithDefaults,
    )
    parser.add_argument(
        "--steps", type=int, metavar="N", default=int(env("STEPS", "5")), help="trainer steps (STEPS)"
    )
    parser.add_argument(
        "--engine-url",
        metavar="URL",
        default=env("ENGINE_URL"),
        help="an OpenAI-compatible server (ENGINE_URL)",
    )
    parser.add_argument(
        "--sglang-model-path",
        metavar="PATH",
        default=env("SGLANG_MODEL_PATH"),
        help="launch SGLang on this model (SGLANG_MODEL_PATH)",
    )
    parser.add_argument(
        "--model",
        default=env("MODEL"),
        metavar="NAME",
        help="the model name the engine is asked for (MODEL; the /start_rollout field model): vLLM "
        "serves only its --served-model-name or model path; default: the engine's only model, if it "
        "serves one, else 'default'",
    )
    parser.add_argument(
        "--input-file", metavar="PATH", default=str(DEFAULT_DATA), help="JSONL data set in slime's format"
    )
    parser.add_argument(
        "--group-size", type=int, metavar="N", default=8, help="samples per prompt (num_repeat_per_sample)"
    )
    parser.add_argument(
        "--groups-per-step", type=int, metavar="N", default=8, help="prompts per trainer step"
    )
    parser.add_argument("--num-process", type=int, metavar="N", default=64, help="trajectories in flight")
    parser.add_argument("--max-tokens", type=int, metavar="N", default=256, help="tokens per answer at most")
    parser.add_argument(
        "--sim-latency-s", type=float, metavar="SECONDS", default=0.2, help="simulated server: mean latency"
    )
    parser.add_argument(
        "--sim-accuracy",
        type=float,
        metavar="P",
        default=0.6,
        help="simulated server: share of right answers",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        metavar="SECONDS",
        default=120.0,
        help="a step without its batch by then stops the run",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "rollout_buffer_example.sh") -> int:
    """The example run (``rollout-buffer demo`` passes its own name as ``prog``)."""
    args = parse(argv, prog)
    logs = Path(os.environ.get("LOG_DIR", ".example-logs"))  # in the working folder
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            engine_url = engine(args, stack, logs)
            port = free_port()
            buffer_url = f"http://127.0.0.1:{port}"
            command = [
                sys.executable,
                "-m",  # not buffer.py: an installed copy has none
                "buffer",
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
            if (model := model_for(args, engine_url)) is not None:
                payload["model"] = model
            started_rollout = client.post("/start_rollout", json=payload)
            started_rollout.raise_for_status()
            job_id = started_rollout.json()["job_id"]
            print(f"started the math rollout: {job_id}")
            try:
                train(client, args, job_id)
            except NoBatch as exc:
                why = why_no_batch(client, job_id, engine_url, model, logs / "buffer.log")
                raise SystemExit(f"{exc}: {why}") from None
            print(closing_line(client, job_id))
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
