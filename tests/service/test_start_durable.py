"""``/start_rollout`` and a job's cancel answer once what they changed is on disk. A SIGKILL of
the service right after the start's answer must find the job, resume it, and its task go on
counting what is made for its plan: the generation soak lost a started job this way, the job
posted again started afresh, and a remote lease worker's items written between were made again.
A cancel answered must not come back as a job resumed after a crash."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from buffer.service.app import create_app
from buffer.service.settings import Settings
from buffer.store.sqlite import Journal

# Runs until cancelled, writing nothing.
WAITER = """
import asyncio

TASK_TYPE = "waiter"

async def run_rollout(data):
    await asyncio.Event().wait()
"""


def slow_commits_of(monkeypatch: pytest.MonkeyPatch, prefix: bytes) -> list[bytes]:
    """Commits of records starting with ``prefix`` take 0.5 s (a slow disk: an answer that does
    not wait for them comes first); the list returned holds each once it is committed."""
    committed: list[bytes] = []
    commit: Callable[..., None] = Journal._commit

    def slow_commit(self: Journal, batch: list[object], first: int) -> None:
        ours = [entry for entry in batch if isinstance(entry, bytes) and entry.startswith(prefix)]
        if ours:
            time.sleep(0.5)
        commit(self, batch, first)
        committed.extend(ours)

    monkeypatch.setattr(Journal, "_commit", slow_commit)
    return committed


def settings(generator_dir: Path, tmp_path: Path) -> Settings:
    (generator_dir / "waiter_generator.py").write_text(WAITER)
    return Settings(generator_dir=generator_dir, data_dir=tmp_path / "data", job_isolation="inline")


def test_start_rollout_answers_once_the_job_is_on_disk(
    generator_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    committed = slow_commits_of(monkeypatch, b'{"e":"job",')
    with TestClient(create_app(settings(generator_dir, tmp_path))) as client:
        answer = client.post("/start_rollout", json={"task_type": "waiter"})
        assert answer.status_code == 200, answer.text
        assert len(committed) == 1  # a SIGKILL now finds the job, and resumes it


def test_a_cancel_answers_once_the_jobs_end_is_on_disk(
    generator_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    committed = slow_commits_of(monkeypatch, b'{"e":"job_end",')
    with TestClient(create_app(settings(generator_dir, tmp_path))) as client:
        job = client.post("/start_rollout", json={"task_type": "waiter"}).json()["job"]
        answer = client.post(f"/jobs/{job['id']}/cancel")
        assert answer.json()["data"]["status"] == "cancelled"
        assert len(committed) == 1  # a SIGKILL now does not resume it
