from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port, started, wait_ready
from buffer.service.app import create_app
from buffer.service.settings import Settings
from tests.support.factories import FakeClock


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """The service and the toolkit run on asyncio (uvicorn's loop); trio is installed only
    because selenium needs it."""
    return "asyncio"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def generator_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "generator"
    directory.mkdir()
    return directory


@pytest.fixture
def make_client(generator_dir: Path) -> Iterator[Callable[..., TestClient]]:
    """Start the app in-process (lifespan included) with settings overrides."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        # In-process jobs: a TestClient listens on no port a worker process could write to.
        overrides = {"job_isolation": "inline", **overrides}
        settings = Settings(generator_dir=generator_dir, port=8889, **overrides)
        client = TestClient(create_app(settings))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(group_size=4)


@pytest.fixture(scope="session")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A simulated policy server process on a loopback port: fast, always right, seeded."""
    port = free_port()
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--latency-mean-s", "0.01", "--accuracy", "1.0", "--seed", "0", "--log-level", "warning"]
    log = tmp_path_factory.mktemp("simulator") / "simulator.log"
    with started(command, "simulator", log) as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the simulator")
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def process(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start ``python <args>`` on a free loopback port (``--host``/``--port`` added), wait until
    it answers ``/health``; returns its URL. Every process is stopped at the end."""
    contexts: list[Any] = []

    def start(*args: str, name: str) -> str:
        port = free_port()
        command = [sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)]
        context = started(command, name, tmp_path / f"{name}.log")
        running = context.__enter__()
        contexts.append(context)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", running, 60, name)
        return url

    yield start
    for context in reversed(contexts):
        context.__exit__(None, None, None)
