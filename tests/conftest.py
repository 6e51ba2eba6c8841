from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.app import create_app
from buffer.settings import Settings
from tests.factories import FakeClock


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
