"""bench/gateway.py's engine and agents in C: nginx answers the raw engine's answer, and wrk's
script sends each thread's calls to its gateway process, in the sessions that process owns,
each call's body different."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any

import httpx
import orjson
import pytest

from tests.support.bench import bench_module


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    with bench_module("gateway") as module:
        yield module


@pytest.mark.skipif(
    shutil.which("nginx", path="/usr/sbin:/usr/bin:/usr/local/sbin") is None, reason="no nginx"
)
def test_the_nginx_engine_answers_a_chat_completion_with_the_raw_answer(bench: ModuleType) -> None:
    with bench.NginxEngine() as engine:
        assert len(engine.pids) == 2  # the master and its one worker: both counted
        response = httpx.post(f"{engine.url}/v1/chat/completions", json={"model": "policy"}, trust_env=False)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == bench.raw_answer()


@pytest.fixture
def recorders() -> Iterator[list[tuple[ThreadingHTTPServer, list[tuple[str, str, bytes]]]]]:
    """Two stand-in gateway processes that record each call (path, key, body) and answer {}."""
    made = []
    for _ in range(2):
        seen: list[tuple[str, str, bytes]] = []

        class Recorder(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            calls = seen

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                self.calls.append((self.path, self.headers["authorization"], body))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append((server, seen))
    yield made
    for server, _ in made:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(shutil.which("wrk") is None, reason="no wrk")
def test_wrk_calls_each_process_in_its_own_sessions_and_never_repeats_a_call(
    bench: ModuleType, recorders: list[tuple[ThreadingHTTPServer, list[tuple[str, str, bytes]]]]
) -> None:
    ports = [server.server_address[1] for server, _ in recorders]
    sessions = [
        {"base_url": f"http://127.0.0.1:{ports[index % 2]}/sessions/s{index}/v1", "api_key": f"key-{index}"}
        for index in range(4)
    ]
    counts = bench.run_wrk(bench.wrk_script(sessions, ports, "run"), ports, connections=4, duration_s=1)

    calls = [call for _, seen in recorders for call in seen]
    assert counts["requests"] > 0
    assert counts["requests"] <= len(calls) <= counts["requests"] + 4
    assert counts["cpu_s"] > 0
    for port_index, (_, seen) in enumerate(recorders):
        owned = {
            f"/sessions/s{index}/v1/chat/completions": f"Bearer key-{index}"
            for index in (port_index, port_index + 2)
        }
        assert {path for path, _, _ in seen} == set(owned)  # both its sessions, no other's
        assert all(owned[path] == key for path, key, _ in seen)
    bodies = [orjson.loads(body) for _, _, body in calls]
    assert len({body["messages"][-1]["content"] for body in bodies}) == len(calls)
    assert all(body["messages"][0] == bench.MESSAGES[0] for body in bodies)
