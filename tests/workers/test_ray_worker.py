"""A Ray worker reports its generator's progress and its memory as a worker process does,
tested with a stand-in for the actor (no Ray needed; ``test_workers_ray`` runs the real one)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from types import SimpleNamespace
from typing import Any

import pytest

from buffer.workers import ray_worker
from buffer.workers.ray_worker import GeneratorActor, RayWorker
from buffer.workers.spec import WorkerSpec


class _Call:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if isinstance(self.answer, BaseException):
            future.set_exception(self.answer)
        else:
            future.set_result(self.answer)
        return SimpleNamespace(future=lambda: future)


class _Actor:
    """Answers ``report`` as a running actor would."""

    def __init__(self, report: Any) -> None:
        self.report = _Call(report)
        self._actor_id = SimpleNamespace(hex=lambda: "a1")


class _RayError(Exception):
    pass


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A stand-in for the ``ray`` module; the actors it was asked to kill."""
    actors: list[Any] = []
    errors = SimpleNamespace(RayActorError=_RayError, RayError=_RayError)
    fake = SimpleNamespace(exceptions=errors, kill=lambda actor, no_restart: actors.append(actor))
    monkeypatch.setattr(ray_worker, "_ray", lambda: fake)
    monkeypatch.setattr(ray_worker, "REPORT_INTERVAL_S", 0.01)
    return actors


def _running(actor: _Actor, result: asyncio.Future[Any]) -> RayWorker:
    worker = RayWorker(WorkerSpec("job-1", "t", "g.py", {}, "http://buffer"), "local")
    worker._actor, worker._ref = actor, result
    worker._reporter = asyncio.create_task(worker._poll())
    return worker


@pytest.mark.anyio
async def test_a_running_actor_reports_its_progress_and_memory_and_its_last_counts_stay(
    killed: list[Any],
) -> None:
    report = {"progress": {"completed": 3, "total": 10}, "rss_bytes": 123_000_000, "pid": 4242}
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    actor = _Actor(report)
    worker = _running(actor, result)
    await asyncio.sleep(0.05)
    described = worker.describe()
    assert (described["rss_bytes"], described["pid"], described["status"]) == (123_000_000, 4242, "running")
    assert worker.progress() == {"completed": 3, "total": 10}
    result.set_result({"returncode": 0, "status": "succeeded", "progress": {"completed": 10, "total": 10}})
    outcome = await worker.wait()
    assert outcome.status == "succeeded"
    assert worker.progress() == {"completed": 10, "total": 10}  # its last word, as the run ended
    assert worker.rss_bytes() is None
    assert worker._reporter is not None
    assert worker._reporter.done()
    assert killed == [actor]  # its process and CPU freed for the next job's actors


@pytest.mark.anyio
@pytest.mark.usefixtures("killed")
async def test_an_actor_that_cannot_answer_leaves_the_last_report_and_its_death_is_a_loss() -> None:
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    worker = _running(_Actor(_RayError("busy")), result)
    await asyncio.sleep(0.05)
    assert (worker.progress(), worker.rss_bytes()) == ({}, None)
    result.set_exception(_RayError("the actor died unexpectedly"))
    outcome = await worker.wait()
    assert outcome.lost  # the job replaces it instead of failing
    assert outcome.error == "the Ray actor died: the actor died unexpectedly"


def test_the_actor_reports_its_generators_progress_and_its_own_memory() -> None:
    actor = GeneratorActor()
    assert actor.report()["progress"] == {}  # not running yet
    actor._keep({"completed": 7})  # as child.run hands over each report
    report = actor.report()
    assert report["progress"] == {"completed": 7}
    assert report["pid"] == os.getpid()
    assert report["rss_bytes"] > 10_000_000
