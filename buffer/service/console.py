"""``rollout-buffer status`` and ``rollout-buffer tail``: a running buffer, from a terminal.

``status`` prints the tasks, jobs, write rates and failed generators once; ``tail`` follows the
trajectories as they are written, one line each, until Ctrl-C. Both exit 1 with one line on
stderr when the buffer cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import httpx

from buffer.trainer.client import RolloutBufferClient
from buffer.trainer.client.errors import BufferClientError
from buffer.trainer.client.models import BufferStats, JobInfo

DEFAULT_URL = "http://127.0.0.1:8889"
TIMEOUT_S = 5.0
PAGE = 1000  # /buffer/tail's largest limit
PRESENT = 2**53  # an ``after`` beyond any sequence number: /buffer/tail answers with the newest


class Unreachable(Exception):
    """The buffer did not answer usably; the message is the one line to show."""


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """``status`` or ``tail`` with its flags (``rollout-buffer`` dispatches here)."""
    args = _parser().parse_args(argv)
    return run(args, out)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        if args.command == "status":
            return status(args.url, args.api_key, sample_s=args.sample_s, out=out)
        return tail(
            args.url,
            args.api_key,
            task_type=args.task,
            interval_s=args.interval_s,
            limit=args.limit,
            from_start=args.from_start,
            out=out,
        )
    except Unreachable as exc:
        sys.stderr.write(f"rollout-buffer {args.command}: {exc}\n")
        return 1
    except BrokenPipeError:  # ``| head``: the reader has gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _add_connection_arguments(parser)
    parser.add_argument(
        "--sample-s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="measure write rates over this long (0: from the jobs)",
    )


def add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    _add_connection_arguments(parser)
    parser.add_argument("--task", metavar="TASK_TYPE", help="only this task's trajectories")
    parser.add_argument("--interval-s", type=float, default=1.0, metavar="SECONDS", help="poll this often")
    parser.add_argument("--limit", type=int, metavar="N", help="stop after this many lines")
    parser.add_argument("--from-start", action="store_true", help="first the recent ones still kept")


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the buffer (default {DEFAULT_URL})")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ROLLOUT_BUFFER_API_KEY"),
        metavar="KEY",
        help="the buffer's API key (default: $ROLLOUT_BUFFER_API_KEY)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-buffer")
    commands = parser.add_subparsers(dest="command", required=True)
    add_status_arguments(commands.add_parser("status", help="tasks, jobs, rates and failed generators"))
    add_tail_arguments(commands.add_parser("tail", help="follow the trajectories as they are written"))
    return parser


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


# -- status ------------------------------------------------------------------------------


def status(url: str, api_key: str | None, *, sample_s: float, out: TextIO) -> int:
    url = url.rstrip("/")
    with RolloutBufferClient(url, api_key=api_key, timeout_s=TIMEOUT_S, max_attempts=1) as client:
        try:
            health = client.health()
            first, first_at = client.stats(), time.monotonic()
            if sample_s > 0:
                time.sleep(sample_s)
                second, elapsed_s = client.stats(), time.monotonic() - first_at
            else:
                second, elapsed_s = first, 0.0
            jobs = client.jobs()
        except BufferClientError as exc:
            raise Unreachable(f"cannot reach the buffer at {url}: {exc.message}") from exc
    generators = _get(url, "/generators", api_key, {})
    lines = _summary(url, health, first, second, elapsed_s)
    lines += ["", "Tasks", *_indent(_tasks_table(first, second, elapsed_s))]
    lines += ["", "Jobs", *_indent(_jobs_table(jobs))]
    lines += ["", "Failed generators", *_indent(_generator_errors(generators))]
    out.write("\n".join(lines) + "\n")
    return 0


def _summary(
    url: str, health: dict[str, Any], first: BufferStats, second: BufferStats, elapsed_s: float
) -> list[str]:
    rate = _rate(second.total_written - first.total_written, elapsed_s)
    measured = f"{rate}/s over {elapsed_s:.1f} s" if elapsed_s else "not measured"
    return [
        f"Buffer {url} (version {health.get('version', '?')}, current task: {second.current_task or '-'})",
        f"  written {second.total_written}, read {second.total_read}, ready {second.current_size} items, "
        f"pending {second.pending_items} items, duplicates {second.duplicates}; writes {measured}",
    ]


def _tasks_table(first: BufferStats, second: BufferStats, elapsed_s: float) -> list[str]:
    if not second.tasks:
        return ["none yet"]
    header = ["task", "group", "pending", "ready", "delivered", "discarded", "written", "rate/s", "reward"]
    rows = []
    for name, task in second.tasks.items():
        written = int(task.get("total_written", 0))
        before = int(first.tasks.get(name, {}).get("total_written", written))
        discarded = task.get("discarded_groups") or {}
        count = int(task.get("reward_count", 0))
        reward = f"{task.get('reward_mean', 0.0):.3f} ± {task.get('reward_std', 0.0):.3f}" if count else "-"
        rows.append(
            [
                name,
                str(task.get("group_size", "?")),
                str(task.get("pending_groups", 0)),
                str(task.get("ready_groups", 0)),
                str(task.get("delivered_groups", 0)),
                str(sum(discarded.values()) if isinstance(discarded, dict) else discarded),
                str(written),
                _rate(written - before, elapsed_s) if elapsed_s else "-",
                reward,
            ]
        )
    return _table(header, rows, left={0, 8})


def _jobs_table(jobs: list[JobInfo]) -> list[str]:
    if not jobs:
        return ["none"]
    header = ["id", "task", "status", "completed", "failed", "rate/s", "error"]
    rows = []
    for job in jobs:
        progress = job.progress
        completed = progress.get("completed", job.counters.get("written", "-"))
        rate = progress.get("trajectories_per_s")
        rows.append(
            [
                job.id,
                job.task_type,
                job.status,
                str(completed),
                str(progress.get("failed", "-")),
                "-" if rate is None else str(rate),
                _error_cell(job.error, job.where) if job.error else "-",
            ]
        )
    return _table(header, rows, left={0, 1, 2, 6})


def _generator_errors(generators: dict[str, Any]) -> list[str]:
    data = generators.get("data") or {}
    errors = data.get("errors") or []
    if not errors:
        found = len(data.get("generators") or [])
        return [f"none ({found} generator{'' if found == 1 else 's'} loaded)"]
    rows = [
        [str(error.get("task_type", "?")), str(error.get("kind", "?")), str(error.get("file", "?")),
         _error_cell(str(error.get("error", "")), error.get("where"))]
        for error in errors
    ]  # fmt: skip
    return _table(["task", "kind", "file", "error"], rows, left={0, 1, 2, 3})


def _error_cell(error: str, where: str | None) -> str:
    """The error's first line, and where it happened (``generator/x_generator.py:3 in run_rollout``)."""
    return f"{_first_line(error)} ({where})" if where else _first_line(error)


def _table(header: list[str], rows: list[list[str]], *, left: set[int]) -> list[str]:
    """Columns padded to their widest cell: the ``left`` ones left-aligned, numbers right."""
    widths = [max(len(row[index]) for row in [header, *rows]) for index in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.ljust(width) if index in left else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _indent(lines: list[str]) -> list[str]:
    return [f"  {line}" for line in lines]


def _rate(count: int, elapsed_s: float) -> str:
    return f"{count / elapsed_s:.1f}" if elapsed_s > 0 else "-"


def _first_line(text: str, width: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


# -- tail --------------------------------------------------------------------------------


def tail(
    url: str,
    api_key: str | None,
    *,
    task_type: str | None,
    interval_s: float,
    limit: int | None,
    from_start: bool,
    out: TextIO,
) -> int:
    """Print each trajectory written as it comes, until Ctrl-C or ``limit`` lines."""
    printed = 0
    try:
        for item in _follow(url.rstrip("/"), api_key, interval_s=interval_s, from_start=from_start):
            if task_type is not None and item.get("task_type") != task_type:
                continue
            out.write(_line(item) + "\n")
            out.flush()
            printed += 1
            if limit is not None and printed >= limit:
                break
    except KeyboardInterrupt:
        pass
    return 0


def _follow(
    url: str, api_key: str | None, *, interval_s: float, from_start: bool
) -> Iterator[dict[str, Any]]:
    """The trajectories written from now on (or from the oldest kept), forever.

    Unreachable at the start raises ``Unreachable``; later, a note on stderr and polling goes on."""
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=TIMEOUT_S, trust_env=False) as client:
        newest = int(_tail_page(client, PRESENT)["last_seq"])  # also: is the buffer there at all?
        after = 0 if from_start else newest
        sys.stderr.write(f"following {url} after trajectory {after} (Ctrl-C to stop)\n")
        sys.stderr.flush()
        lost = False
        while True:
            try:
                page = _tail_page(client, after)
            except Unreachable as exc:
                if not lost:
                    sys.stderr.write(f"rollout-buffer tail: {exc}; still trying\n")
                lost = True
                time.sleep(interval_s)
                continue
            lost = False
            items: list[dict[str, Any]] = page["items"]
            yield from items
            last_seq = int(page["last_seq"])
            if items:
                after = last_seq
                if len(items) >= PAGE:
                    continue  # more are waiting: no pause
            elif last_seq < after:
                after = 0  # the buffer started again: everything it holds is new
                continue
            time.sleep(interval_s)


def _tail_page(client: httpx.Client, after: int) -> dict[str, Any]:
    answer = _request(client, "/buffer/tail", {"after": after, "limit": PAGE})
    data = answer.get("data")
    if not isinstance(data, dict) or "items" not in data or "last_seq" not in data:
        where = client.base_url.join("/buffer/tail")
        raise Unreachable(f"{where} answered without items: is this a rollout buffer?")
    return data


def _line(item: dict[str, Any]) -> str:
    wall = float(item.get("time", 0.0))
    stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall % 1 * 1000):03d}"
    reward = item.get("reward")
    shown = f"{reward:.4f}" if isinstance(reward, (int, float)) else str(reward)
    task, instance = str(item.get("task_type")), str(item.get("instance_id"))
    return f"{stamp}  {task:<12}  {instance:<16}  {item.get('uid')}  reward {shown}"


# -- HTTP ---------------------------------------------------------------------------------


def _get(url: str, path: str, api_key: str | None, params: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=TIMEOUT_S, trust_env=False) as client:
        return _request(client, path, params)


def _request(client: httpx.Client, path: str, params: dict[str, Any]) -> dict[str, Any]:
    """The decoded JSON of ``GET path``; ``Unreachable`` with one line on any failure."""
    where = str(client.base_url.join(path))
    try:
        response = client.get(path, params=params)
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise Unreachable(f"cannot reach the buffer at {where}: {reason}") from exc
    try:
        answer = response.json()
    except ValueError as exc:
        raise Unreachable(f"{where} answered HTTP {response.status_code} with no JSON") from exc
    if response.is_error or not isinstance(answer, dict):
        message = answer.get("message") if isinstance(answer, dict) else None
        raise Unreachable(f"{where} answered HTTP {response.status_code}: {message or response.text[:200]}")
    return answer
