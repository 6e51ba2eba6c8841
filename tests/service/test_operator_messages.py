"""What an operator is told on a first day: a generator folder that is not there, a data folder
with nothing in it, an input file outside the input roots (and the flag that allows it)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from buffer.service import cli
from buffer.service.app import create_app
from buffer.service.job_policy import JobPolicy
from buffer.service.settings import Settings


def test_a_missing_generator_folder_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer.service.app")
    missing = tmp_path / "no-such-folder"
    with TestClient(create_app(Settings(generator_dir=missing, host="127.0.0.1"))):
        pass
    warned = [record.getMessage() for record in caplog.records if "does not exist" in record.getMessage()]
    assert warned == [
        f"the generator folder {missing} does not exist (--generator-dir): no task has a generator, "
        "and /start_rollout answers 404 until the folder is made"
    ]


def test_an_empty_folder_is_no_damaged_buffer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", str(tmp_path)])
    out, err = capsys.readouterr()
    assert exited.value.code == 2
    assert "DAMAGED" not in out + err
    assert err == (
        f"rollout-buffer check: {tmp_path}: no buffer here (buffer.sqlite3 is absent): nothing to check; "
        f"a service started with --data-dir {tmp_path} makes one\n"
    )


def test_an_input_file_outside_the_roots_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """slime's example reads /root/dapo-math-17k/...: the refusal says how to allow it."""
    data = tmp_path / "dapo-math-17k"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    policy = JobPolicy((tmp_path / "generator" / "data",))
    with pytest.raises(Exception, match="input_file") as refused:
        policy.check_blocking({"input_file": str(data / "train.jsonl")}, "http://127.0.0.1:8889")
    assert f"start the service with --input-roots {data} (or ROLLOUT_BUFFER_INPUT_ROOTS)" in str(
        refused.value
    )
