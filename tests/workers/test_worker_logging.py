"""A worker process logs as the service does: its own loggers at the level, every library's
warnings only, and the loggers ``--log-level-for`` names at theirs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from buffer.service.jobs import _worker_env
from buffer.workers.process import WorkerProcess
from buffer.workers.spec import WorkerSpec

pytestmark = pytest.mark.anyio

LOGGING = """
import logging
TASK_TYPE = "probe"

def run_rollout(data):
    logging.getLogger("buffer.toolkit.runner").info("the toolkit's progress")
    logging.getLogger("httpx2").info("HTTP Request: POST http://engine/v1/chat/completions")
    logging.getLogger("openai").info("HTTP Request: POST http://engine/v1/chat/completions")
    logging.getLogger("openai").warning("Retrying request")
    logging.getLogger("asked").info("asked for")
"""


async def test_a_worker_quietens_libraries_and_raises_the_loggers_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="buffer.workers.output")
    generator = tmp_path / "probe_generator.py"
    generator.write_text(LOGGING)
    spec = WorkerSpec(
        "job-1", "probe", str(generator), {}, "http://127.0.0.1:9", log_levels={"asked": "info"}
    )
    worker = WorkerProcess(spec, env=_worker_env(None))
    await worker.start()
    assert (await worker.wait()).status == "succeeded"
    lines = "\n".join(r.getMessage() for r in caplog.records if r.name == "buffer.workers.output")
    assert "the toolkit's progress" in lines
    assert "Retrying request" in lines
    assert "asked for" in lines
    assert "HTTP Request" not in lines, lines
