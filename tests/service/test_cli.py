"""The command-line tool: its help lists the commands, a bad value is one line naming the flag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.service import cli
from tests.support.paths import REPO

REPO_ROOT = REPO


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), out, err


def test_help_lists_every_command_and_the_serve_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert out.startswith("usage: rollout-buffer [COMMAND] [OPTIONS]")
    for name in ("serve", "status", "tail"):
        assert f"\n  {name} " in out, out
    assert "--port N" in out
    assert "--data-dir DIR" in out
    assert "{Path,null}" not in out  # a type expression is no metavar
    assert "$ROLLOUT_BUFFER_PORT" in out


def test_python_buffer_py_help_still_shows_the_service_flags() -> None:
    """slime users run ``python buffer.py``: the same tool, serving by default."""
    result = subprocess.run(
        [sys.executable, "buffer.py", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "status" in result.stdout
    assert "--generator-dir DIR" in result.stdout


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--port", "abc"],
            "rollout-buffer serve: --port abc: Input should be a valid integer, "
            "unable to parse string as an integer",
        ),
        (
            ["serve", "--port", "0"],
            "rollout-buffer serve: --port 0: Input should be greater than or equal to 1",
        ),
        (["--bogus"], "rollout-buffer: unrecognized arguments: --bogus (--help lists the options)"),
        (
            ["serve", "--log-format", "xml"],
            "rollout-buffer serve: argument --log-format: invalid choice: 'xml' (choose from 'text', 'json') "
            "(--help lists the options)",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert out == ""
    assert err == line + "\n"


def test_a_bad_variable_is_one_line_naming_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_BUFFER_GROUP_SIZE", "many")
    code, _, err = run_main([], capsys)
    assert code == 2
    assert err == (
        "rollout-buffer serve: ROLLOUT_BUFFER_GROUP_SIZE=many: Input should be a valid integer, "
        "unable to parse string as an integer\n"
    )


def test_flags_win_over_variables_and_booleans_have_a_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUFFER_PORT", "9000")
    monkeypatch.setenv("ROLLOUT_BUFFER_GROUP_SIZE", "3")
    namespace = cli.parser().parse_args(
        ["serve", "--port", "9001", "--no-resume-jobs", "--data-dir", "/tmp/x"]
    )
    settings = cli.settings_from(namespace)
    assert (settings.port, settings.group_size, settings.resume_jobs) == (9001, 3, False)
    assert settings.data_dir == Path("/tmp/x")


def test_a_list_option_is_repeated_or_given_as_a_json_list() -> None:
    def settings(*args: str) -> cli.Settings:
        return cli.settings_from(cli.parser().parse_args(["serve", *args]))

    repeated = settings("--input-roots", "/data/a", "--input-roots", "/data/b")
    assert repeated.input_roots == [Path("/data/a"), Path("/data/b")]
    as_json = settings("--input-roots", '["/data/a", "/data/b"]', "--allowed-origins", "https://x.test")
    assert as_json.input_roots == repeated.input_roots
    assert as_json.allowed_origins == ["https://x.test"]
    assert settings().input_roots is None  # not given: the default roots


def test_status_has_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["status", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: rollout-buffer status")
    assert "--sample-s SECONDS" in out


def test_status_against_nothing_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["status", "--url", "http://127.0.0.1:9"], capsys)
    assert code == 1
    assert err.startswith("rollout-buffer status: ")
    assert err.count("\n") == 1


#: What a type expression looks like where a metavar should be a word (``--host str``,
#: ``--seed {int,null}``): a reader learns nothing from it.
TYPE_METAVAR = re.compile(r"--[a-z-]+ (?:str|int|float|bool|list|dict|null|\{[a-z]+,null\}|\{[^}]*,null\})\b")


def program_help(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, *argv, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())  # argparse wraps at the terminal's width


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["buffer.py"], ["--port N port to listen on (default: 8889); $ROLLOUT_BUFFER_PORT"]),
        (
            ["-m", "buffer.simulator"],
            [
                "--host HOST interface to listen on (default: 127.0.0.1); $ROLLOUT_BUFFER_SIM_HOST",
                "--seed N",
                "--port PORT",
            ],
        ),
        (["-m", "buffer.demo"], ["--steps N trainer steps (STEPS) (default: 5)", "--model NAME"]),
        (["-m", "buffer", "simulator"], ["usage: rollout-buffer simulator"]),
        (["-m", "buffer", "demo"], ["usage: rollout-buffer demo"]),
    ],
)
def test_every_help_shows_words_and_defaults_never_type_names(argv: list[str], shown: list[str]) -> None:
    text = program_help(*argv)
    assert "PydanticUndefined" not in text
    assert not TYPE_METAVAR.findall(text), TYPE_METAVAR.findall(text)
    for words in shown:
        assert words in text


def test_the_serve_help_names_each_list_option_s_entries(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(["--help"], capsys)
    text = " ".join(out.split())
    for flag in ("--send-api-key-to HOST", "--allowed-engine-hosts HOST", "--input-roots DIR"):
        assert flag in text
    assert "--log-level-for NAME=LEVEL" in text
    assert "(default: [])" not in text


def test_the_simulator_reads_the_service_s_prefix_and_its_former_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from buffer.simulator.cli import parse_config

    monkeypatch.setenv("ROLLOUT_BUFFER_SIM_SEED", "7")
    monkeypatch.setenv("SIM_LLM_ACCURACY", "0.25")
    config = parse_config([])
    assert (config.seed, config.accuracy) == (7, 0.25)
    monkeypatch.setenv("ROLLOUT_BUFFER_SIM_ACCURACY", "0.5")  # the current prefix wins
    assert parse_config([]).accuracy == 0.5
    assert parse_config(["--seed", "null"]).seed is None


def test_a_bad_simulator_value_is_one_line_naming_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "buffer.simulator", "--engine", "tgi"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == "python -m buffer.simulator: --engine: Input should be 'vllm' or 'sglang'\n"


def test_log_level_for_raises_a_named_logger(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = cli.parser().parse_args(
        ["serve", "--log-level-for", "openai=INFO", "--log-level-for", "x.y=debug"]
    )
    assert cli.settings_from(namespace).log_levels() == {"openai": "info", "x.y": "debug"}
    code, _, err = run_main(["--log-level-for", "openai:info"], capsys)
    assert code == 2
    assert err.startswith(
        "rollout-buffer serve: --log-level-for ['openai:info']: Value error, 'openai:info' is "
    )
    assert "NAME=LEVEL" in err
