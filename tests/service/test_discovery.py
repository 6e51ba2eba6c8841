"""A generator file's import runs in a process of its own before the service's (issue 24): one
that ends its process or hangs is reported, and the service and its other generators go on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.calls import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GOOD = 'TASK_TYPE = "good"\n\ndef run_rollout(data):\n    return None\n'
EXIT = 'import os\nTASK_TYPE = "exit"\nos._exit(7)\n'
# Says it has started (the file ``mark``), then takes 30 s to import.
SLOW = """
import pathlib, time
pathlib.Path({mark!r}).touch()
time.sleep(30)
TASK_TYPE = "slow"

def run_rollout(data):
    return None
"""


def errors_by_task(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {error["task_type"]: error for error in body["data"]["errors"]}


def test_imports_that_end_the_process_or_hang_leave_the_service_serving(
    process: Callable[..., str], generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "good_generator.py").write_text(GOOD)
    (generator_dir / "exit_generator.py").write_text(EXIT)
    url = process(
        "buffer.py", "--generator-dir", str(generator_dir), "--generator-import-timeout-s", "5", name="buffer"
    )  # it answers /health: os._exit(7) at import did not end it
    with httpx.Client(base_url=url, timeout=60) as client:
        body = client.get("/generators").json()
        assert [generator["task_type"] for generator in body["data"]["generators"]] == ["good"]
        assert errors_by_task(body)["exit"]["error"].startswith("its import ended the process (exit code 7)")

        mark = tmp_path / "slow-import-started"
        (generator_dir / "slow_generator.py").write_text(SLOW.format(mark=str(mark)))
        scanned: dict[str, Any] = {}
        scan = threading.Thread(target=lambda: scanned.update(client.get("/generators").json()))
        scan.start()
        try:
            wait_for(mark.exists, 60, "the slow file's import to start")
            health = client.get("/health")  # while the scan waits on that import
            assert health.status_code == 200
            assert scan.is_alive()
        finally:
            scan.join(60)
        slow = errors_by_task(scanned)["slow"]
        assert slow["error"].startswith("its import did not finish within 5 s")
        assert slow["where"] == "generator/slow_generator.py:4"

        started = client.post("/start_rollout", json={"task_type": "good"}).json()
        assert started["success"], started

        def succeeded() -> bool:
            job = client.get(f"/jobs/{started['job_id']}").json()["data"]
            return bool(job["status"] == "succeeded")

        wait_for(succeeded, 60, "the good generator's job")
        assert client.get("/health").json()["generator_errors"] == 2
