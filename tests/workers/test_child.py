"""A worker process on its own, started as the service starts one: what its own machinery
imports (little, so it starts in tens of milliseconds: nothing of the service, the core's read
path or the store), and what its generator is told of its job."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from buffer.paths import ROOT
from buffer.workers.process import WorkerProcess
from buffer.workers.spec import WorkerSpec

#: The issue's bound: a worker's own machinery (its generator importing nothing of the package).
MAX_WORKER_MODULES = 15

# Imports nothing of the package: what it sees in sys.modules is the worker's own doing.
MODULES = """
import json, sys

TASK_TYPE = "modules"
START_ROLLOUT_FIELDS = ('out',)

def run_rollout(data):
    names = sorted(m for m in sys.modules if m == "buffer" or m.startswith("buffer."))
    with open(data["out"], "w") as out:
        json.dump(names, out)
"""

# Records the Authorization header of the sinks it opens: to its service, to another buffer.
KEY_PROBE = """
import json
from buffer.toolkit.sink import open_sink

TASK_TYPE = "key_probe"
START_ROLLOUT_FIELDS = ('out',)

async def run_rollout(data):
    sent = {}
    for name, url in [("service", None), ("other", "http://other.internal:9000")]:
        sink = await open_sink(url)
        sent[name] = sink.authorization
        await sink.aclose()
    with open(data["out"], "w") as out:
        json.dump(sent, out)
"""

pytestmark = pytest.mark.anyio


async def run_worker(tmp_path: Path, source: str, env: dict[str, str] | None = None, **spec: Any) -> Any:
    """Run ``source`` as a generator in a worker process, as the service does; what it left in
    ``data["out"]``."""
    generator = tmp_path / "probe_generator.py"
    generator.write_text(source)
    out = tmp_path / "out.json"
    worker = WorkerProcess(
        WorkerSpec("job-1", "probe", str(generator), {"out": str(out)}, "http://127.0.0.1:9", **spec),
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    await worker.start()
    outcome = await worker.wait()
    assert outcome.status == "succeeded", outcome
    return json.loads(out.read_text())


async def test_a_workers_own_machinery_imports_at_most_15_of_the_packages_modules(tmp_path: Path) -> None:
    names = await run_worker(tmp_path, MODULES)
    assert len(names) <= MAX_WORKER_MODULES, (
        f"a worker imports {len(names)} of the package's modules, more than {MAX_WORKER_MODULES}: {names}"
    )
    assert not [name for name in names if name.startswith(("buffer.service", "buffer.store"))], names


async def test_a_worker_sends_the_services_key_only_to_the_service_and_the_hosts_it_names(
    tmp_path: Path,
) -> None:
    sent = await run_worker(tmp_path, KEY_PROBE, api_key="service-secret")
    assert sent == {"service": "Bearer service-secret", "other": None}
    sent = await run_worker(tmp_path, KEY_PROBE, api_key="service-secret", api_key_hosts=("other.internal",))
    assert sent == {"service": "Bearer service-secret", "other": "Bearer service-secret"}
