"""``rollout-buffer worker`` with ``"evaluation": true``: the task is set up as an evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.workers import remote
from buffer.workers.spec import WorkerSpec

BUFFER = "http://buffer.test:8889"


def run_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: dict[str, Any]
) -> tuple[Any, WorkerSpec]:
    ran: list[WorkerSpec] = []
    monkeypatch.setattr(remote, "configure_logging", lambda level: None)
    monkeypatch.setattr(remote.child, "run", lambda spec: ran.append(spec) or 0)
    settings = {"task_type": "eval-math", "settings": {}, "hooks_from": ":evaluation"}
    with respx.mock:
        put = respx.put(f"{BUFFER}/tasks/eval-math").mock(
            return_value=httpx.Response(200, json={"success": True, "data": settings})
        )
        argv = ["--buffer", BUFFER, "--task", "eval-math", "--generator", str(tmp_path / "g_generator.py")]
        assert remote.main([*argv, "--data", json.dumps(data)]) == 0
    (spec,) = ran
    return json.loads(put.calls.last.request.content), spec


def test_a_remote_worker_sets_up_an_evaluation_task_and_tells_its_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configured, spec = run_worker(tmp_path, monkeypatch, {"num_repeat_per_sample": 4, "evaluation": True})
    assert configured == {"num_repeat_per_sample": 4, "evaluation": True}
    assert spec.data["evaluation"] is True
    configured, spec = run_worker(tmp_path, monkeypatch, {"num_repeat_per_sample": 4})
    assert configured == {"num_repeat_per_sample": 4, "evaluation": False}
    assert spec.data["evaluation"] is False  # as a job of /start_rollout sees it
