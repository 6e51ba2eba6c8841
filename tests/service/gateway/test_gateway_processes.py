"""``rollout-buffer gateway``: sessions recorded in gateway processes, written to the one buffer.

Real processes on loopback ports: the buffer, the simulated engine (or the loopback stand-in),
gateway processes. Nothing waits on the clock: each step polls for its condition."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from buffer.processes import free_port, started, stop, wait_ready
from tests.support.calls import wait_for
from tests.support.gateway import (
    TOOLS,
    assert_token_faithful,
    calculator_agent,
    engine_log,
    serving,
    session_trajectories,
    turns_as_calls,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

QUESTION = {"role": "user", "content": "Compute 2 + 3."}


def ports_in_a_row(count: int) -> int:
    """A free loopback port followed by ``count - 1`` more free ones (``--processes`` takes ``P + i``)."""
    for _ in range(50):
        first = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    probe = stack.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} free ports in a row")


class Services:
    """Starts processes for one test and stops them all at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.stack = contextlib.ExitStack()
        self.logs = 0

    def start(self, args: list[str], port: int, name: str, ready: bool = True) -> Any:
        self.logs += 1
        command = [sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)]
        running = self.stack.enter_context(started(command, name, self.tmp_path / f"{name}-{self.logs}.log"))
        if ready:
            wait_ready(f"http://127.0.0.1:{port}/health", running, 60, name)
        return running

    def buffer(self, port: int, *extra: str) -> Any:
        args = ["buffer.py", "--group-size", "2", "--log-level", "warning", *extra]
        return self.start(args, port, "buffer")

    def gateway(self, port: int, buffer_port: int, *extra: str, ready: bool = True) -> Any:
        args = ["-m", "buffer", "gateway", "--buffer-url", f"http://127.0.0.1:{buffer_port}", *extra]
        return self.start([*args, "--log-level", "warning"], port, "gateway", ready)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    running = Services(tmp_path)
    with running.stack:
        yield running


@pytest.fixture(scope="module")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["-m", "buffer.simulator", "--engine", "vllm", "--served-model-name", "policy"]
    args += ["--latency-mean-s", "0.01"]
    with serving(tmp_path_factory, "sim", *args) as url:
        yield url


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def agent(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def test_sessions_opened_at_the_buffer_run_in_two_gateway_processes_and_are_trained_once_each(
    services: Services, simulator: str
) -> None:
    first = ports_in_a_row(2)
    buffer_port = free_port()
    gateways = [url(first), url(first + 1)]
    services.buffer(buffer_port, *[arg for g in gateways for arg in ("--gateway-url", g)])
    services.gateway(
        first, buffer_port, "--processes", "2", "--data-dir", str(services.tmp_path / "gw"), ready=False
    )
    for gateway in gateways:
        wait_ready(f"{gateway}/health", None, 60, "a gateway process")
    buffer = url(buffer_port)
    opened = []
    for index in range(4):
        body = {"task_type": "agent", "instance_id": f"q{index}", "remote_engine_url": simulator}
        answer = httpx.post(f"{buffer}/sessions", json=body)
        assert answer.status_code == 200, answer.text
        opened.append(answer.json()["data"])
    # handed out in turn: two sessions in each process, each answering its own calls
    assert sorted(s["base_url"].split("/sessions/")[0] for s in opened) == sorted(gateways * 2)
    for index, session in enumerate(opened):  # streamed or not: each answer one write of its process
        with agent(session) as client:
            assert "5" in calculator_agent(client, "Compute 2 + 3.", stream=bool(index % 2))
    for session in opened:  # ended at the buffer: forwarded to the process that owns it
        ended = httpx.post(f"{buffer}/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()
        assert ended["data"]["written"], ended
        again = httpx.post(f"{buffer}/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()
        assert again["data"]["duplicate"], again  # a retried end writes nothing twice
    items = session_trajectories(buffer, *[f"q{index}" for index in range(4)])
    assert sorted(item["uid"] for item in items) == sorted(f"session-{s['session_id']}" for s in opened)
    for item in items:
        assert len(item["turns"]) == 2
        assert_token_faithful(item, turns_as_calls(item))
    (counters,) = httpx.get(f"{buffer}/buffer/stats").json()["data"]["data"]
    assert counters["total_written"] == 8, counters  # four sessions, four companions


def test_an_end_is_written_once_across_restarts_of_the_buffer(services: Services, loopback: str) -> None:
    """An end while the buffer is down waits for it; an end replayed from a gateway that
    crashed after the buffer took the write (its data folder from before) is counted once."""
    buffer_port, gateway_port = free_port(), free_port()
    buffer_args = ("--data-dir", str(services.tmp_path / "buffer"))
    buffer_process = services.buffer(buffer_port, *buffer_args)
    data = services.tmp_path / "gw"
    gateway_process = services.gateway(gateway_port, buffer_port, "--data-dir", str(data))
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": loopback}
    session = httpx.post(f"{url(gateway_port)}/sessions", json=body).json()["data"]
    with agent(session) as client:
        client.chat.completions.create(model="policy", messages=[QUESTION], tools=TOOLS)
    end = f"{url(gateway_port)}/sessions/{session['session_id']}/end"
    httpx.post(end.removesuffix("/end") + "/reward", json={"reward": 1.0}).raise_for_status()
    gateway_process.kill()  # its state before the end, kept for the replay below
    gateway_process.wait()
    shutil.copytree(data, services.tmp_path / "gw-before-end")
    services.gateway(gateway_port, buffer_port, "--data-dir", str(data))

    stop(buffer_process)  # the end comes while the buffer is down: it waits for it
    answers: list[httpx.Response] = []
    ending = threading.Thread(target=lambda: answers.append(httpx.post(end, json={}, timeout=120)))
    ending.start()
    services.buffer(buffer_port, *buffer_args)
    ending.join(120)
    assert answers
    first_end = answers[0].json()["data"]
    assert (first_end["written"], first_end["duplicate"]) == (True, False), answers[0].text

    stop(buffer_process := services.buffer(buffer_port, *buffer_args))  # a restart of the buffer
    services.buffer(buffer_port, *buffer_args)
    services.stack.close()  # the gateway too: one with the data folder from before the end
    replay = Services(services.tmp_path)
    with replay.stack:
        replay.buffer(buffer_port, *buffer_args)
        replay.gateway(gateway_port, buffer_port, "--data-dir", str(services.tmp_path / "gw-before-end"))
        replayed = httpx.post(end, json={}).json()
        assert replayed["data"]["written"], replayed
        assert replayed["data"]["duplicate"], replayed  # as the buffer answered: counted once
        items = session_trajectories(url(buffer_port), "q1")
        assert [item["uid"] for item in items] == [f"session-{session['session_id']}"]
        (counters,) = httpx.get(f"{url(buffer_port)}/buffer/stats").json()["data"]["data"]
        assert counters["total_written"] == 2, counters  # the session once, and its companion
        assert counters["duplicates"] == 1, counters  # the replayed end's


def test_a_killed_gateway_process_is_started_again_with_every_answered_call(
    services: Services, loopback: str
) -> None:
    first = ports_in_a_row(2)
    buffer_port = free_port()
    services.buffer(buffer_port)
    data = services.tmp_path / "gw"
    services.gateway(first, buffer_port, "--processes", "2", "--data-dir", str(data), ready=False)
    gateway = url(first + 1)
    wait_ready(f"{gateway}/health", None, 60, "gateway process 1")
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": loopback}
    session = httpx.post(f"{gateway}/sessions", json=body).json()["data"]
    before = len(engine_log(loopback))
    with agent(session) as client:
        answer = client.chat.completions.create(model="policy", messages=[QUESTION], tools=TOOLS)
        pid = httpx.get(f"{gateway}/health").json()["data"]["pid"]
        os.kill(pid, signal.SIGKILL)  # no shutdown: only what was acknowledged is on disk
        wait_for(lambda: _pid(gateway) not in (None, pid), 60, "gateway process 1 started again")
        assert (data / "1").is_dir()
        reply = answer.choices[0].message
        history = [
            QUESTION,
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"},
        ]
        client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
    ended = httpx.post(f"{gateway}/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()
    assert ended["data"]["written"], ended
    (trajectory,) = session_trajectories(url(buffer_port), "q1")
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, engine_log(loopback)[before:])


def _pid(gateway: str) -> int | None:
    try:
        pid: int = httpx.get(f"{gateway}/health", timeout=2).json()["data"]["pid"]
    except httpx.HTTPError:
        return None
    return pid


def test_calls_wait_while_the_buffer_s_policy_is_paused(services: Services, loopback: str) -> None:
    buffer_port, gateway_port = free_port(), free_port()
    services.buffer(buffer_port)
    services.gateway(gateway_port, buffer_port)
    gateway, buffer = url(gateway_port), url(buffer_port)
    policy = lambda: httpx.get(f"{gateway}/health").json()["data"]["policy"]  # noqa: E731
    wait_for(lambda: policy()["heard"], 60, "the gateway's policy mirror")
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": loopback}
    session = httpx.post(f"{gateway}/sessions", json=body).json()["data"]
    httpx.post(f"{buffer}/policy/pause", json={}, timeout=60).raise_for_status()
    wait_for(lambda: policy()["paused"], 60, "the pause mirrored")
    answered = threading.Event()

    def call() -> None:
        with agent(session) as client:
            client.chat.completions.create(model="policy", messages=[QUESTION], timeout=120)
        answered.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert not answered.wait(1.0)  # held while paused (answered at once otherwise)
    assert len(httpx.get(f"{gateway}/sessions/{session['session_id']}").json()["data"]["parents"]) == 0
    httpx.post(f"{buffer}/policy/resume", json={"version": 3}).raise_for_status()
    caller.join(120)
    assert answered.is_set()
    ended = httpx.post(f"{gateway}/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()
    assert ended["data"]["written"], ended
    (trajectory,) = session_trajectories(buffer, "q1")
    assert trajectory["turns"][0]["weight_versions"] == [[3, len(trajectory["turns"][0]["output_ids"])]]


def test_an_open_at_the_buffer_with_no_gateway_process_answering_is_a_503(services: Services) -> None:
    buffer_port = free_port()
    services.buffer(buffer_port, "--gateway-url", url(free_port()))
    answer = httpx.post(f"{url(buffer_port)}/sessions", json={"task_type": "agent", "instance_id": "q1"})
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert "no gateway process answers" in answer.json()["message"]
