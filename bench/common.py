"""Shared helpers for the benchmarks in this folder (not a benchmark itself).

- ``Server``: starts ``python buffer.py`` on 127.0.0.1 on a free port, waits for ``/health``,
  and always stops it (on error, Ctrl-C, SIGTERM, and, through ``PR_SET_PDEATHSIG``, even if
  the benchmark process itself is killed).
- ``make_trajectory``: a trajectory of about ``size`` bytes of JSON.
- ``rss_bytes`` / ``cpu_seconds``: read a process's resident memory and CPU time from /proc.
- ``fill``: write trajectories through ``POST /buffer/write_batch``.

The scripts import this as ``common``: run them as ``python bench/<script>.py`` (Python puts the
script's folder first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CPUS = os.cpu_count() or 1
DEFAULT_TRAJECTORY_BYTES = 2000


# -- the server under test ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the benchmark process dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """``python buffer.py --host 127.0.0.1 --port <free> --log-level warning --group-size N``.

    Use as a context manager; ``url``, ``pid`` and ``port`` are set once it answers ``/health``.
    The server's output goes to a temporary log file, printed if it fails to start.
    """

    def __init__(
        self,
        group_size: int = 8,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 30.0,
        python: str = sys.executable,
        entry: Path = REPO / "buffer.py",
        module: str | None = None,
        port: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        """``module`` runs ``python -m module --host --port ...extra_args`` instead (e.g. the
        simulated policy server, ``buffer.simulator``). ``port``: this one at every start
        (a restart on the same address, as its clients expect), else a free one each time;
        ``env``: variables added to the process's environment."""
        self.entry = entry
        self.module = module
        self.fixed_port = port
        self.env = env
        self.group_size = group_size
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self._log: Any = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> Server:
        try:
            for attempt in range(3):  # a free port can be taken between probing and binding
                if self._start():
                    return self
                if attempt == 2:
                    raise RuntimeError(f"the server did not start; its log:\n{self.log_text()}")
        except BaseException:
            self.stop()
            self.close_log()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close_log()

    def _start(self) -> bool:
        self.launch()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            answered = self.answers()
            if answered is not None:
                return answered
            time.sleep(0.05)
        return False

    def launch(self) -> None:
        """Start the process (stopping the one before, if any) without waiting for it: poll
        ``answers()`` until it does. Call from the thread that lives as long as the server: the
        server gets SIGTERM when that thread ends (``PR_SET_PDEATHSIG``)."""
        self.stop()
        self.port = self.fixed_port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        program = (
            ["-m", self.module] if self.module else [str(self.entry), "--group-size", str(self.group_size)]
        )
        cmd = [self.python, *program, "--host", HOST, "--port", str(self.port), "--log-level", "warning"]
        cmd += self.extra_args
        if self._log is None:  # one log for every start: a restart's reasons stay readable
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close_log())
        self.process = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env} if self.env else None,
            start_new_session=True,  # Ctrl-C reaches the benchmark, which then stops the server
            preexec_fn=_die_with_parent,
        )

    def answers(self) -> bool | None:
        """One probe of ``/health``: True when it answers 200, False when the process has exited,
        None while it starts."""
        if self.process is None or self.process.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return True
        return None

    def log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return str(self._log.read().decode(errors="replace"))

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark passes on to the buffer it starts."""
    parser.add_argument("--group-size", type=int, default=8, help="the server's --group-size (default 8)")
    parser.add_argument(
        "--server-args", default="", help='extra flags for buffer.py, e.g. "--dedup-window 0"'
    )


def server_args(text: str) -> list[str]:
    """``--server-args "--dedup-window 0"``: extra flags for ``buffer.py``."""
    return shlex.split(text)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into ``KeyboardInterrupt`` so ``finally`` blocks stop the servers."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# -- /proc ----------------------------------------------------------------------------------


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (or ``VmHWM``, the peak) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def machine_cpu() -> list[int]:
    """The machine-wide ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq steal..."""
    return [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def machine_shares(before: list[int], after: list[int]) -> dict[str, float]:
    """Of all CPU time (both cores) between two ``machine_cpu()`` readings: the busy, idle and
    stolen (hypervisor) shares."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta[:8]) or 1
    idle = delta[3] + delta[4]
    steal = delta[7] if len(delta) > 7 else 0
    return {"busy": (total - idle - steal) / total, "idle": idle / total, "steal": steal / total}


# -- trajectories ---------------------------------------------------------------------------

_SENTENCE = (
    "the model should reason step by step about each part of the problem before it writes "
    "an answer and then check the result against the constraints given in the question so "
    "that a wrong intermediate value is caught early rather than carried into the final line"
)
_WORDS = _SENTENCE.split()
_rng = random.Random(1234)
_CORPUS = " ".join(_rng.choice(_WORDS) for _ in range(20_000))


def _text(length: int, seed: int) -> str:
    if length <= 0:
        return ""
    start = (seed * 7919) % (len(_CORPUS) - length - 1) if length < len(_CORPUS) - 1 else 0
    return _CORPUS[start : start + length]


def make_trajectory(
    instance_id: str | int,
    uid: str | None,
    reward: float = 0.5,
    size: int = DEFAULT_TRAJECTORY_BYTES,
    seed: int = 0,
) -> dict[str, Any]:
    """A chat trajectory whose compact JSON is ``size`` bytes (or a few more, if ids are long).

    Message contents are ASCII text taken at a ``seed``-dependent place, so trajectories differ.
    """
    trajectory: dict[str, Any] = {"instance_id": instance_id}
    if uid is not None:
        trajectory["uid"] = uid
    trajectory["messages"] = [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ]
    trajectory["reward"] = reward
    trajectory["extra_info"] = {"finish_reason": "stop", "timestamp": 1700000000.0, "label": "42"}
    room = max(0, size - len(orjson.dumps(trajectory)))
    system, user = room * 15 // 100, room * 35 // 100
    lengths = (system, user, room - system - user)
    for salt, (message, length) in enumerate(zip(trajectory["messages"], lengths, strict=True), start=1):
        message["content"] = _text(length, seed * 3 + salt)
    return trajectory


def fill(
    client: httpx.Client,
    trajectories: Iterable[dict[str, Any]],
    batch_size: int = 1000,
) -> int:
    """POST the trajectories to ``/buffer/write_batch`` in batches; returns how many were written."""
    written = 0
    batch: list[dict[str, Any]] = []

    def send() -> None:
        nonlocal written
        response = client.post(
            "/buffer/write_batch", content=orjson.dumps(batch), headers={"content-type": "application/json"}
        )
        response.raise_for_status()
        written += int(response.json()["data"]["written"])
        batch.clear()

    for trajectory in trajectories:
        batch.append(trajectory)
        if len(batch) >= batch_size:
            send()
    if batch:
        send()
    return written


class RawClient:
    """A minimal HTTP/1.1 client over one keep-alive socket, for timing large responses with as
    little client work as possible: no parsing beyond the status line and Content-Length, and the
    body read with ``recv_into`` into one preallocated buffer."""

    def __init__(self, port: int, host: str = HOST) -> None:
        self.host = host
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, float, float, bytes]:
        """Returns ``(status, seconds to the end of the headers, seconds in all, body)``."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        self.sock.sendall(head + body)
        received = bytearray()
        while b"\r\n\r\n" not in received:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            received += chunk
        headers_at = time.perf_counter()
        header_bytes, _, rest = bytes(received).partition(b"\r\n\r\n")
        lines = header_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:])
        }
        if "content-length" not in fields:
            raise ConnectionError("RawClient needs a Content-Length response")
        length = int(fields["content-length"])
        content = bytearray(length)
        view = memoryview(content)
        view[: len(rest)] = rest
        filled = len(rest)
        while filled < length:
            n = self.sock.recv_into(view[filled:])
            if not n:
                raise ConnectionError("the server closed the connection mid-body")
            filled += n
        return status, headers_at - start, time.perf_counter() - start, bytes(content)


def buffer_stats(client: httpx.Client, task: str = "default") -> dict[str, Any]:
    """``/buffer/stats``' counters, with the task's own (``pending_groups``, ``ready_groups``...)
    under ``task``."""
    response = client.get("/buffer/stats")
    response.raise_for_status()
    data = response.json()["data"]
    counters = dict(data["data"][0])
    counters["task"] = data["meta_info"]["tasks"].get(task, {})
    return counters


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    what: str = "a condition",
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def settle(read: Callable[[], int], quiet_s: float = 0.3, timeout_s: float = 30.0) -> int:
    """Poll ``read`` until it stops changing for ``quiet_s``; returns the last value."""
    last = read()
    still_since = time.monotonic()
    deadline = still_since + timeout_s
    while time.monotonic() - still_since < quiet_s:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
        value = read()
        if value != last:
            last, still_since = value, time.monotonic()
    return last


# -- reporting ------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain, right-aligned text table."""
    cells = [list(map(str, headers)), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    """Print ``label ...`` and how long it took."""
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    yield
    print(f" {time.perf_counter() - start:.1f}s", flush=True)
