"""Connections: headers bounded in size and time, and slow clients that cannot lock others out.

Each test starts ``python -m buffer`` on a free loopback port and talks to it over raw sockets,
a bounded number of them.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from buffer.paths import ROOT
from buffer.processes import free_port, stop, wait_ready

Start = Callable[..., tuple[str, int]]


@pytest.fixture
def server(tmp_path: Path, generator_dir: Path) -> Iterator[Start]:
    """Start the service with extra flags and, optionally, a low open-file limit (soft and
    hard, so it cannot raise it); returns its host and port."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(*flags: str, descriptors: int | None = None) -> tuple[str, int]:
        port = free_port()
        command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--generator-dir", str(generator_dir), "--log-level", "warning", *flags]

        def limit() -> None:
            if descriptors is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

        log = open(tmp_path / f"buffer-{port}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=limit)
        log.close()
        processes.append(process)
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the rollout buffer")
        return "127.0.0.1", port

    yield start
    for process in processes:
        stop(process)


def connect(address: tuple[str, int], timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    return sock


def answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (b"" when it closes at once)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def health(address: tuple[str, int], timeout_s: float = 30.0) -> int:
    host, port = address
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        return client.get(f"http://{host}:{port}/health").status_code


def test_headers_past_the_limit_get_431_and_the_connection_closes(server: Start) -> None:
    address = server("--max-header-bytes", "8192")
    with connect(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(64):  # 1 MiB, far past the limit, in pieces: never a whole header
                sock.sendall(b"a" * 16384)
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 431 "), response[:100]
    # Headers within the limit are served as ever.
    with connect(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 4000 + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_connection_that_does_not_finish_its_headers_in_time_is_closed(server: Start) -> None:
    address = server("--header-timeout-seconds", "3")
    with connect(address) as silent, connect(address) as slow:
        slow.sendall(b"POST /buffer/write HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for sock in (silent, slow):
            assert answer(sock) == b""  # closed: one left open would time out in 30 s, an error
    # A keep-alive connection gets the same time again for each next request: used for 4 s,
    # past the 3 s, it is never closed (its port on this side stays the same).
    host, port = address
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=30, trust_env=False) as client:
        ports = set()
        for _ in range(4):
            response = client.get("/health")
            assert response.status_code == 200
            ports.add(response.extensions["network_stream"].get_extra_info("client_addr"))
            time.sleep(1.0)
    assert len(ports) == 1, ports


def test_slow_connections_past_the_descriptor_limit_do_not_lock_other_clients_out(server: Start) -> None:
    # 128 descriptors, so at most 64 connections; the timeout is long, so only the cap can help.
    address = server("--header-timeout-seconds", "300", descriptors=128)
    slow: list[socket.socket] = []
    try:
        for _ in range(200):
            sock = connect(address)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(sock)
        assert health(address) == 200
        assert health(address) == 200
        # The oldest slow connections were closed to make room.
        slow[0].settimeout(30)
        assert answer(slow[0]) == b""
    finally:
        for sock in slow:
            sock.close()
    assert health(address) == 200
