"""Calls the tests make through the HTTP API, and generator sources they install."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient


def write_all(client: TestClient, items: list[dict[str, Any]]) -> None:
    for item in items:
        response = client.post("/buffer/write", json=item)
        assert response.status_code == 200, response.text


def read(client: TestClient, body: Any = None) -> dict[str, Any]:
    response = (
        client.post("/get_rollout_data", json=body) if body is not None else client.post("/get_rollout_data")
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def wait_for(
    condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.02
) -> Any:
    """``condition()``'s first true value, checked every ``interval_s`` for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


async def until(
    condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.01
) -> Any:
    """``wait_for`` inside an event loop: ``condition()``'s first true value, checked every
    ``interval_s`` for up to ``timeout_s`` while the loop runs the rest."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def job_status(client: TestClient, job_id: str) -> str:
    status: str = client.get(f"/jobs/{job_id}").json()["data"]["status"]
    return status


RECORDING = """
import json, pathlib, threading
TASK_TYPE = "{task}"
START_ROLLOUT_FIELDS = ('record_to',)

def run_rollout(data):
    record = dict(data, thread=threading.current_thread().name)
    pathlib.Path(data["record_to"]).write_text(json.dumps(record))
"""

WAITING = """
import asyncio
TASK_TYPE = "waiting"

async def run_rollout(data):
    await asyncio.sleep(60)
"""
