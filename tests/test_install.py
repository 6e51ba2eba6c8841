"""What an install puts on the path works from any folder, slime's ``rollout_buffer/`` included:
its own ``buffer.py``, ``generator/`` and ``default_func.py`` shadow this package for ``python -m
buffer`` there, never for the ``rollout-buffer`` command or the service's worker processes."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from buffer.paths import PACKAGE
from buffer.service.jobs import _worker_env
from buffer.workers.process import WorkerProcess
from buffer.workers.spec import WorkerSpec
from tests.support.paths import REPO

#: The console script pip made for this environment (``pip install -e .``).
SCRIPT = Path(sys.executable).parent / "rollout-buffer"


@pytest.fixture
def slime_folder(tmp_path: Path) -> Path:
    """A folder like slime's ``slime_plugins/rollout_buffer/``: whatever of it gets imported
    in place of this package says so."""
    folder = tmp_path / "rollout_buffer"
    folder.mkdir()
    (folder / "buffer.py").write_text("raise SystemExit('slime\\'s buffer.py ran')\n")
    (folder / "default_func.py").write_text("raise SystemExit('slime\\'s default_func.py ran')\n")
    (folder / "generator").mkdir()
    (folder / "generator" / "__init__.py").write_text("raise SystemExit('slime\\'s generator ran')\n")
    return folder


@pytest.mark.parametrize("command", ["serve", "status", "tail", "check", "worker", "simulator", "demo"])
def test_every_command_answers_help_in_slime_s_folder(slime_folder: Path, command: str) -> None:
    assert SCRIPT.exists(), f"no {SCRIPT}: pip install -e . makes it"
    done = subprocess.run(
        [str(SCRIPT), command, "--help"],
        cwd=slime_folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"usage: rollout-buffer {command}"), done.stdout[:300]


def test_the_top_help_lists_the_programs_too(slime_folder: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), "--help"], cwd=slime_folder, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    for command in ("serve", "check", "worker", "simulator", "demo"):
        assert f"\n  {command} " in done.stdout


def test_the_install_declares_the_command_and_ships_its_types() -> None:
    scripts = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["rollout-buffer"] == "buffer.service.cli:main"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"rollout-buffer": "buffer.service.cli:main"}
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]
    assert (PACKAGE / "py.typed").exists()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["buffer"]


@pytest.mark.anyio
async def test_a_worker_started_in_slime_s_folder_runs_this_package(
    slime_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service started there (``rollout-buffer``): its workers must not import slime's
    ``buffer.py`` either, which ``python -c`` would, from the working folder."""
    generator = tmp_path / "probe_generator.py"
    generator.write_text('TASK_TYPE = "probe"\n\ndef run_rollout(data):\n    import default_func\n')
    monkeypatch.chdir(slime_folder)
    worker = WorkerProcess(
        WorkerSpec("job-1", "probe", str(generator), {}, "http://127.0.0.1:9"), env=_worker_env(None)
    )
    await worker.start()
    outcome = await worker.wait()
    assert outcome.status == "succeeded", outcome
