"""``bench/generation_soak.py``, short: a job's plan (the toolkit, 2 worker processes, 2 remote
lease workers behind a relay that partitions them) made exactly once through SIGKILLs of the
service timed to worker starts and to reads, remote workers killed and started again, and no
process of a job outliving its service (issue 22)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.support.paths import REPO


def run_soak(*args: str, timeout_s: float) -> tuple[int, dict[str, Any], str]:
    command = [sys.executable, "bench/generation_soak.py", "--json", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    lines = done.stdout.splitlines()
    figures: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    return done.returncode, figures, done.stdout + done.stderr[-8000:]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_every_plan_item_is_made_once_through_kills_partitions_and_remote_worker_restarts() -> None:
    code, figures, output = run_soak(
        "--kills", "5", "--rows", "16", "--latency-s", "2.0", "--finish-s", "90", timeout_s=220
    )
    assert code == 0, output
    assert figures["kills"] >= 5
    assert figures["exported"] == figures["plan_items"] == 16 * 4 * 2
    assert figures["made_twice"] == figures["never_made"] == figures["orphans"] == 0
