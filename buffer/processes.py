"""Local processes for the example run, the benchmarks and the tests: a free loopback port, a
child process that lives for a block, readiness by polling, a graceful stop."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from buffer.paths import ROOT


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_ready(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float, name: str) -> None:
    """Poll ``url`` until it answers 200; fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise SystemExit(f"{name} exited with code {process.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(0.1)
    raise SystemExit(f"{name} was not ready at {url} within {timeout_s:.0f} s")


@contextlib.contextmanager
def started(command: Sequence[str], name: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (from ``ROOT``) for the duration of the block; its output goes to ``log``.
    ``name`` is what ``wait_ready`` and the caller's messages call it."""
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if ``process`` is not gone within ``timeout_s``; returns once it is."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
