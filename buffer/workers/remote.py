"""``rollout-buffer worker``: run a generator on this machine for a buffer elsewhere.

The same code as a job's worker process (``child.run``), started by hand: the generator file's
``run_rollout(data)`` runs here, and what it writes goes over HTTP to ``--buffer`` (batched,
deduplicated by ``uid``, slowed by 429s; the key from ``ROLLOUT_BUFFER_API_KEY``). Unless told
``--no-configure``, the task is configured first (``PUT /tasks/{name}``, retried with backoff for
``CONFIGURE_RETRY_S`` while the buffer is down or out of reach) with the data's group
size and timeout (and ``evaluation``: its groups kept as written, as ``/start_rollout`` keeps
them), so its groups fill as the generator means them to, even with a buffer run with
``--strict-tasks``. ``--worker-index``/``--num-workers`` split the plan between several
such workers, a fixed share each; with ``--leases`` the buffer hands the work out instead, as
it does to a job's own workers (``buffer.workers.leases``), so the share of a worker that stops
is made by the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_before_delay, wait_random_exponential

from buffer.keys import key_or_env
from buffer.lease_terms import lease_settings
from buffer.logs import configure_logging
from buffer.workers import child
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

#: How long ``PUT /tasks/{name}`` is retried while the buffer does not answer it (a restart, a
#: partition): a worker started meanwhile waits for it rather than exit.
CONFIGURE_RETRY_S = 300.0

_TASK_FIELDS = (
    "num_repeat_per_sample",
    "group_timeout_seconds",
    "min_valid_group_size_ratio",
    "min_valid_item_size_ratio",
    "min_timeout_group_size_ratio",
    "reward_key",
    "evaluation",
)


def main(argv: Sequence[str]) -> int:
    return run(_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the generator ``args`` name (``rollout-buffer worker``'s options) until it ends."""
    configure_logging(args.log_level)
    data = _data(args)
    buffer = args.buffer.rstrip("/")
    data.update(task_type=args.task, remote_buffer_url=buffer)
    data.setdefault("generator_task_type", args.task)
    data.setdefault("evaluation", False)  # as a job of /start_rollout sees it
    if args.configure:
        _configure(buffer, args.task, data)
    index, count = args.worker_index, args.num_workers
    if args.leases:  # the buffer hands out the work: every worker walks the whole plan
        name = f"{socket.gethostname()}-{os.getpid()}"
        data["leases"] = lease_settings(
            name, args.lease_ttl_s, data.get("num_process", 100), url=buffer, index=index, count=count
        )
        index, count = 0, 1
    spec = WorkerSpec(
        job_id=f"worker-{os.getpid()}",
        task_type=args.task,
        generator_file=str(Path(args.generator).resolve()),
        data=data,
        buffer_url=buffer,
        index=index,
        count=count,
        log_level=args.log_level,
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = child.run(spec)
    logger.info("worker for %s on %s: %s", args.task, buffer, {0: "done", 2: "cancelled"}.get(code, "failed"))
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-buffer worker",
        description="Run a generator here, writing to a rollout buffer elsewhere.",
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--buffer", required=True, help="the buffer's URL, e.g. http://10.0.0.5:8889")
    parser.add_argument("--task", required=True, help="the buffer task to write to")
    parser.add_argument("--generator", required=True, help="the generator file (*_generator.py) to run")
    parser.add_argument(
        "--data",
        default="{}",
        help="the /start_rollout payload as JSON, or @file.json (input_file, remote_engine_url, ...)",
    )
    parser.add_argument("--worker-index", type=int, default=0, help="which of --num-workers this is")
    parser.add_argument("--num-workers", type=int, default=1, help="how many workers share the plan")
    parser.add_argument(
        "--leases",
        action="store_true",
        help="take work from the buffer as leases: a worker that stops has its share made by the others "
        "(toolkit generators)",
    )
    parser.add_argument(
        "--lease-ttl-s", type=float, default=30.0, help="a worker silent this long loses its leases"
    )
    parser.add_argument(
        "--configure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="configure the task on the buffer first (PUT /tasks/NAME) from the data's group settings",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def _data(args: argparse.Namespace) -> dict[str, Any]:
    text = Path(args.data[1:]).read_text() if args.data.startswith("@") else args.data
    data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit("--data must be a JSON object")
    if not 0 <= args.worker_index < args.num_workers:
        raise SystemExit("--worker-index must be from 0 to --num-workers - 1")
    return data


def _configure(buffer: str, task: str, data: dict[str, Any], retry_s: float = CONFIGURE_RETRY_S) -> None:
    body = {name: data[name] for name in _TASK_FIELDS if data.get(name) is not None}
    headers = {}
    if key := key_or_env(None):
        headers["authorization"] = f"Bearer {key}"
    retrying = Retrying(
        stop=stop_before_delay(retry_s),
        wait=wait_random_exponential(multiplier=0.2, max=5.0),
        retry=retry_if_exception(_unanswered),
        before_sleep=lambda state: logger.warning(
            "configuring task %s on %s: %r; retrying",
            task,
            buffer,
            state.outcome.exception() if state.outcome else None,
        ),
        reraise=True,
    )
    try:
        response = retrying(_put, f"{buffer}/tasks/{task}", body, headers)
    except httpx.HTTPError as exc:
        raise SystemExit(f"configuring task {task} on {buffer} failed for {retry_s:g} s: {exc!r}") from exc
    if response.status_code != 200:
        raise SystemExit(
            f"configuring task {task} on {buffer} failed: HTTP {response.status_code} {response.text}"
        )
    logger.info("task %s configured on %s: %s", task, buffer, response.json()["data"]["settings"])


def _put(url: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    response = httpx.put(url, json=body, headers=headers, timeout=30.0, trust_env=False)
    if response.status_code in (429, 502, 503, 504):  # starting, restarting, or a proxy without it
        response.raise_for_status()
    return response


def _unanswered(exc: BaseException) -> bool:
    """The buffer did not answer the request (down, out of reach) or said to come back."""
    return isinstance(exc, httpx.TransportError | httpx.HTTPStatusError)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
