"""Generator discovery: good files load, broken ones are reported exactly and stop nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from buffer.core.registry import GeneratorRegistry
from buffer.errors import GeneratorUnavailable, UnknownTask
from tests.support.factories import write_generator

GOOD = """
TASK_TYPE = "math"

def run_rollout(data):
    return None
"""


def registry_of(directory: Path) -> GeneratorRegistry:
    registry = GeneratorRegistry(directory)
    registry.refresh()
    return registry


def only_error(registry: GeneratorRegistry) -> dict[str, str]:
    (error,) = registry.errors
    return error.describe()


def test_a_generator_is_found_with_its_overridden_hooks(generator_dir: Path) -> None:
    write_generator(
        generator_dir,
        "math_generator.py",
        GOOD + "\ndef filter_item(item, task_type):\n    return True\n",
    )
    write_generator(generator_dir, "helpers.py", "raise RuntimeError('not a generator: never imported')")
    registry = registry_of(generator_dir)
    assert registry.errors == []
    described = registry.get("math").describe()
    assert described["hooks_overridden"] == ["filter_item"]
    assert described["run_rollout"] == "sync"
    assert described["file"].endswith("math_generator.py")


def test_async_run_rollout_is_recognised(generator_dir: Path) -> None:
    write_generator(
        generator_dir, "a_generator.py", 'TASK_TYPE = "a"\nasync def run_rollout(data):\n    pass\n'
    )
    assert registry_of(generator_dir).get("a").is_async


def test_a_file_that_fails_to_import_is_reported_with_where_under_its_declared_task(
    generator_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_generator(
        generator_dir, "broken_generator.py", 'TASK_TYPE = "search"\nimport no_such_module_here\n'
    )
    write_generator(generator_dir, "math_generator.py", GOOD)
    registry = registry_of(generator_dir)
    assert set(registry.generators) == {"math"}  # the others still load
    error = only_error(registry)
    assert error["kind"] == "import"
    assert error["task_type"] == "search"
    assert error["error"] == "ModuleNotFoundError: No module named 'no_such_module_here'"
    assert error["where"] == "generator/broken_generator.py:2"
    assert "traceback" not in error  # the log has it
    assert "Traceback (most recent call last)" in caplog.text
    with pytest.raises(GeneratorUnavailable, match="no_such_module_here"):
        registry.get("search")
    assert not any(name.startswith("rollout_generator_broken_generator") for name in sys.modules)


def test_a_syntax_error_is_reported_under_the_file_name(generator_dir: Path) -> None:
    write_generator(generator_dir, "code_generator.py", "def run_rollout(data:\n")
    error = only_error(registry_of(generator_dir))
    assert error["kind"] == "import"
    assert error["task_type"] == "code"
    assert error["error"].startswith("SyntaxError")


def test_sys_exit_at_import_is_a_load_error_not_an_exit(generator_dir: Path) -> None:
    write_generator(generator_dir, "exit_generator.py", "import sys\nsys.exit(3)\n")
    assert only_error(registry_of(generator_dir))["error"] == "SystemExit: 3"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def run_rollout(data):\n    pass\n", "does not define TASK_TYPE"),
        ('TASK_TYPE = "t"\n', "does not define run_rollout(data)"),
        ("TASK_TYPE = 3\ndef run_rollout(data):\n    pass\n", "TASK_TYPE must be a non-empty string, not 3"),
        ('TASK_TYPE = "t"\nrun_rollout = 5\n', "run_rollout must be a function, not int"),
        ('TASK_TYPE = "t"\ndef run_rollout():\n    pass\n', "run_rollout() must take one argument, data"),
        (
            'TASK_TYPE = "t"\ndef run_rollout(data):\n    pass\n'
            "def pad_group_data(group):\n    return group\n",
            "pad_group_data(group) has the wrong parameters: expected (group, group_size)",
        ),
        (
            'TASK_TYPE = "t"\ndef run_rollout(data):\n    pass\n'
            "def is_valid_group(a, b, c, d):\n    return True\n",
            "is_valid_group(a, b, c, d) has the wrong parameters: expected "
            "(group, min_valid_group_size, task_type) or (group, min_valid_group_size)",
        ),
        (
            'TASK_TYPE = "t"\ndef run_rollout(data):\n    pass\n'
            "async def filter_item(item, task_type):\n    return True\n",
            "filter_item must be a plain function: hooks run synchronously on each group",
        ),
        (
            'TASK_TYPE = "t"\nSTART_ROLLOUT_FIELDS = "difficulty"\ndef run_rollout(data):\n    pass\n',
            "START_ROLLOUT_FIELDS must be a tuple of field names, a pydantic model of the fields, "
            "or '*' (any field), not 'difficulty'",
        ),
    ],
)
def test_contract_violations_are_named(generator_dir: Path, source: str, message: str) -> None:
    write_generator(generator_dir, "t_generator.py", source)
    error = only_error(registry_of(generator_dir))
    assert error["kind"] == "contract"
    assert error["error"] == message


def test_a_repeated_task_type_keeps_the_first_file_and_reports_the_other_naming_both(
    generator_dir: Path,
) -> None:
    write_generator(generator_dir, "math_generator.py", GOOD)
    write_generator(generator_dir, "copy_of_math_generator.py", GOOD)
    write_generator(generator_dir, "other_generator.py", GOOD.replace('"math"', '"other"'))
    registry = registry_of(generator_dir)
    assert set(registry.generators) == {"math", "other"}
    assert registry.get("math").path.name == "copy_of_math_generator.py"  # the first, sorted
    (error,) = registry.errors
    assert error.kind == "duplicate"
    assert error.path.name == "math_generator.py"
    assert "copy_of_math_generator.py" in error.error
    assert "not used" in error.error


def test_a_copy_of_a_serving_generator_does_not_take_its_task_over(generator_dir: Path) -> None:
    """Copying the template (as the docs say) before changing its TASK_TYPE leaves the task
    served by the file that served it, whatever the copy's name sorts as."""
    write_generator(generator_dir, "math_generator.py", GOOD)
    registry = registry_of(generator_dir)
    serving = registry.get("math")
    write_generator(generator_dir, "a_copy_generator.py", GOOD)
    registry.refresh()
    assert registry.get("math") is serving
    (error,) = registry.errors
    assert (error.kind, error.path.name) == ("duplicate", "a_copy_generator.py")
    assert str(serving.path) in error.error
    (generator_dir / "a_copy_generator.py").write_text(GOOD.replace('"math"', '"aime_copy"'))
    registry.refresh()
    assert set(registry.generators) == {"math", "aime_copy"}
    assert registry.errors == []


def test_unknown_task_lists_the_available_ones(generator_dir: Path) -> None:
    write_generator(generator_dir, "math_generator.py", GOOD)
    with pytest.raises(UnknownTask, match="no generator for 'chess'; available tasks: math"):
        registry_of(generator_dir).get("chess")


def test_new_and_changed_files_are_picked_up_on_refresh(generator_dir: Path) -> None:
    registry = registry_of(generator_dir)
    assert registry.generators == {}
    path = write_generator(generator_dir, "math_generator.py", GOOD)
    registry.refresh()
    first = registry.get("math")
    registry.refresh()
    assert registry.get("math") is first  # unchanged files are not imported again
    path.write_text(GOOD + "\ndef filter_item(item, task_type):\n    return False\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    registry.refresh()
    assert registry.get("math").hooks.overridden == {"filter_item"}
    path.unlink()
    registry.refresh()
    assert registry.generators == {}


def test_a_generator_is_importable_as_a_module_while_it_runs(generator_dir: Path) -> None:
    # dataclasses and pickling look the module up in sys.modules during import.
    write_generator(
        generator_dir,
        "dc_generator.py",
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Config:\n    n: int = 1\n"
        'TASK_TYPE = "dc"\ndef run_rollout(data):\n    return Config()\n',
    )
    registry = registry_of(generator_dir)
    assert registry.errors == []
    module = registry.get("dc").module
    assert sys.modules[module.__name__] is module


def test_two_folders_with_the_same_file_name_do_not_collide(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    write_generator(first, "math_generator.py", GOOD)
    write_generator(second, "math_generator.py", GOOD.replace('"math"', '"math2"'))
    a, b = registry_of(first).get("math"), registry_of(second).get("math2")
    assert a.module is not b.module
    assert a.module.__name__ != b.module.__name__


def test_a_file_that_failed_to_import_is_retried_once_its_package_appears(
    generator_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install requests` after the service started: the next scan loads the generator,
    although the generator's own file was not touched."""
    write_generator(
        generator_dir,
        "web_generator.py",
        'import late_installed_package\nTASK_TYPE = "web"\n\ndef run_rollout(data):\n    return None\n',
    )
    registry = registry_of(generator_dir)
    assert only_error(registry)["error"] == "ModuleNotFoundError: No module named 'late_installed_package'"
    site = tmp_path / "site"
    site.mkdir()
    (site / "late_installed_package.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    assert registry.errors == []
    assert list(registry.generators) == ["web"]
    sys.modules.pop("late_installed_package", None)


# -- a file's import runs in a process of its own first (issue 24) --------------------------------


def test_a_file_whose_import_ends_the_process_is_reported_and_never_imported_here(
    generator_dir: Path,
) -> None:
    """``os._exit`` at the top level ended the service; now it ends the discovery process."""
    write_generator(generator_dir, "exit_generator.py", 'import os\nTASK_TYPE = "exit"\nos._exit(7)\n')
    write_generator(generator_dir, "math_generator.py", GOOD)
    write_generator(generator_dir, "zeta_generator.py", GOOD.replace('"math"', '"zeta"'))  # after it
    registry = registry_of(generator_dir)
    assert set(registry.generators) == {"math", "zeta"}
    error = only_error(registry)
    assert (error["kind"], error["task_type"]) == ("import", "exit")
    assert error["error"].startswith("its import ended the process (exit code 7)")
    assert not any(name.startswith("rollout_generator_exit_generator") for name in sys.modules)


def test_a_file_whose_import_outlasts_its_limit_is_reported_where_it_hangs_and_not_retried(
    generator_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_generator(
        generator_dir,
        "slow_generator.py",
        'import time\nTASK_TYPE = "slow"\ntime.sleep(30)\ndef run_rollout(data):\n    pass\n',
    )
    write_generator(generator_dir, "math_generator.py", GOOD)
    registry = GeneratorRegistry(generator_dir, import_timeout_s=2)
    registry.refresh()
    assert set(registry.generators) == {"math"}
    (error,) = registry.errors
    assert (error.kind, error.task_type) == ("import", "slow")
    assert error.error.startswith("its import did not finish within 2 s")
    assert error.where == "generator/slow_generator.py:3"
    assert "Timeout" in caplog.text  # the stacks it was in, in the log
    registry.refresh()  # each try costs its limit: tried again only once the file changes
    assert registry.errors[0] is error


def test_what_a_generator_prints_as_it_is_imported_does_not_confuse_discovery(generator_dir: Path) -> None:
    write_generator(generator_dir, "loud_generator.py", 'print("{\\"path\\": 1}")\n' + GOOD)
    assert set(registry_of(generator_dir).generators) == {"math"}
