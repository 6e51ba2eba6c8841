"""Discovering the generators: every ``*_generator.py`` in the generator folder.

Each file is imported under its own module name, registered in ``sys.modules`` before it
runs and removed again if it fails. A file is reported, never fatal, when it fails to
import (with the traceback), breaks the contract (no ``TASK_TYPE``, no ``run_rollout``, a
hook with the wrong parameters), or repeats another file's ``TASK_TYPE`` (both are reported
and neither is used: running the wrong one silently would be worse). ``refresh`` re-imports
only files that changed, so a new or edited generator is picked up without a restart; a file
that failed to import is imported again on each scan (a missing package may have been installed).

No traceback reaches a client: the log has it, the API says only ``where`` the error happened
(the innermost frame of the generator's code), as it does for a failed job or hook.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from buffer import paths
from buffer.core.hook_guard import guard_hooks
from buffer.core.hooks import Hooks, bind_hooks
from buffer.errors import GeneratorUnavailable, UnknownTask

logger = logging.getLogger(__name__)

SUFFIX = "_generator.py"

_BUFFER_PACKAGE = str(paths.PACKAGE) + os.sep
_PYTHON_INSTALL = tuple(
    {str(Path(p).resolve()) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
)
#: A frame line of a formatted traceback; a SyntaxError's has no function.
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<name>.+))?$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Generator:
    task_type: str
    path: Path
    module: ModuleType
    run_rollout: Callable[[dict[str, Any]], Any]
    hooks: Hooks

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run_rollout)

    def describe(self) -> dict[str, Any]:
        return {
            "task_type": self.task_type,
            "file": str(self.path),
            "run_rollout": "async" if self.is_async else "sync",
            "hooks_overridden": sorted(self.hooks.overridden),
        }


@dataclass(frozen=True, slots=True)
class LoadError:
    path: Path
    kind: Literal["import", "contract", "duplicate"]
    error: str
    task_type: str  # declared TASK_TYPE, read from the source when the import failed, else the file's stem
    traceback: str = ""  # for the log only
    where: str | None = None  # for the API: see ``where``

    def describe(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "task_type": self.task_type,
            "kind": self.kind,
            "error": self.error,
            "where": self.where,
        }


class GeneratorRegistry:
    def __init__(self, directory: Path, *, hook_timeout_s: float | None = None) -> None:
        """``hook_timeout_s``: each hook a generator overrides runs off the caller's thread and
        fails after this long (see ``buffer.core.hook_guard``); None: called directly."""
        self.directory = directory
        self.hook_timeout_s = hook_timeout_s
        self._lock = threading.Lock()
        self._loaded: dict[Path, tuple[tuple[int, int], Generator | LoadError]] = {}
        self._generators: dict[str, Generator] = {}
        self._errors: list[LoadError] = []

    @property
    def generators(self) -> dict[str, Generator]:
        return dict(self._generators)

    @property
    def errors(self) -> list[LoadError]:
        return list(self._errors)

    def refresh(self) -> None:
        """Re-scan the folder; import new and changed files, forget removed ones."""
        with self._lock:
            paths = sorted(self.directory.glob(f"*{SUFFIX}")) if self.directory.is_dir() else []
            loaded: dict[Path, tuple[tuple[int, int], Generator | LoadError]] = {}
            for path in paths:
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                fingerprint = (stat.st_mtime_ns, stat.st_size)
                cached = self._loaded.get(path)
                # A file that failed to import is tried again on every scan, changed or not: what
                # it lacked is often a package installed since (``pip install requests``).
                retry = cached is not None and isinstance(cached[1], LoadError) and cached[1].kind == "import"
                if cached is not None and cached[0] == fingerprint and not retry:
                    loaded[path] = cached
                else:
                    loaded[path] = (fingerprint, self._guarded(load_generator(path)))
            self._loaded = loaded
            self._index([result for _, result in loaded.values()])

    def _guarded(self, result: Generator | LoadError) -> Generator | LoadError:
        if isinstance(result, LoadError) or self.hook_timeout_s is None:
            return result
        return dataclasses.replace(result, hooks=guard_hooks(result.hooks, self.hook_timeout_s))

    def _index(self, results: list[Generator | LoadError]) -> None:
        by_task: dict[str, list[Generator]] = {}
        errors = [result for result in results if isinstance(result, LoadError)]
        for result in results:
            if isinstance(result, Generator):
                by_task.setdefault(result.task_type, []).append(result)
        generators: dict[str, Generator] = {}
        for task_type, found in by_task.items():
            if len(found) == 1:
                generators[task_type] = found[0]
                continue
            names = ", ".join(str(g.path) for g in found)
            for generator in found:
                errors.append(
                    LoadError(
                        generator.path,
                        "duplicate",
                        f"TASK_TYPE {task_type!r} is defined by {names}",
                        task_type,
                    )
                )
        for error in errors:
            if not any(error == old for old in self._errors):
                tb = f"\n{error.traceback}" if error.traceback else ""
                logger.error("generator %s not loaded (%s): %s%s", error.path, error.kind, error.error, tb)
        for task_type, generator in generators.items():
            if self._generators.get(task_type) is not generator:
                logger.info("generator %s -> %s", task_type, generator.path)
        self._generators = generators
        self._errors = errors

    def get(self, task_type: str) -> Generator:
        """The task's generator; raises ``UnknownTask`` or ``GeneratorUnavailable``."""
        generator = self._generators.get(task_type)
        if generator is not None:
            return generator
        failures = [error.describe() for error in self._errors if error.task_type == task_type]
        if failures:
            raise GeneratorUnavailable(task_type, failures)
        raise UnknownTask(task_type, self._generators)

    def hooks_for(self, task_type: str) -> Hooks:
        generator = self._generators.get(task_type)
        return generator.hooks if generator else Hooks()


def load_generator(path: Path) -> Generator | LoadError:
    """Import the generator file ``path`` under its own module name; what failed, if it did."""
    declared = _declared_task_type(path)
    module_name = f"rollout_generator_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        return LoadError(path, "import", "not a loadable Python file", declared)
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # a generator's import may even call sys.exit()
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = f"{type(exc).__name__}: {exc}"
        return LoadError(path, "import", error, declared, traceback.format_exc(), where(exc, path))
    try:
        return _check_contract(path, module)
    except TypeError as exc:
        task_type = getattr(module, "TASK_TYPE", declared)
        return LoadError(path, "contract", str(exc), task_type if isinstance(task_type, str) else declared)


def _check_contract(path: Path, module: ModuleType) -> Generator:
    if not hasattr(module, "TASK_TYPE"):
        raise TypeError("does not define TASK_TYPE")
    task_type = module.TASK_TYPE
    if not isinstance(task_type, str) or not task_type:
        raise TypeError(f"TASK_TYPE must be a non-empty string, not {task_type!r}")
    run_rollout = getattr(module, "run_rollout", None)
    if run_rollout is None:
        raise TypeError("does not define run_rollout(data)")
    if not callable(run_rollout):
        raise TypeError(f"run_rollout must be a function, not {type(run_rollout).__name__}")
    try:
        inspect.signature(run_rollout).bind({})
    except TypeError:
        raise TypeError(f"run_rollout{inspect.signature(run_rollout)} must take one argument, data") from None
    except ValueError:  # no signature to inspect
        pass
    return Generator(task_type, path, module, run_rollout, bind_hooks(vars(module)))


def _declared_task_type(path: Path) -> str:
    """``TASK_TYPE`` read from the source without running it, so a file that fails to import
    is still reported under its task; the file's stem when that cannot be read either."""
    fallback = path.name.removesuffix(SUFFIX)
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return fallback
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (
                any(isinstance(t, ast.Name) and t.id == "TASK_TYPE" for t in targets)
                and node.value is not None
            ):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    return fallback
                return value if isinstance(value, str) else fallback
    return fallback


def where(exc: BaseException, prefer: str | Path | None = None) -> str:
    """Where ``exc`` happened in the user's code, for an API answer in place of its traceback:
    ``generator/math_generator.py:42 in normalize_group_data``. The last frame in the file
    ``prefer`` (the generator's), else the last outside this package and Python's own
    libraries, else the last. A syntax error points at its line."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{_short(exc.filename)}:{exc.lineno}"
    frames = [(frame.filename, frame.lineno, frame.name) for frame in traceback.extract_tb(exc.__traceback__)]
    return _innermost(frames, prefer)


def where_in(text: str, prefer: str | Path | None = None) -> str:
    """``where`` for a traceback kept only as text (``traceback.format_exc()``)."""
    frames = [(match["file"], int(match["line"]), match["name"]) for match in _FRAME.finditer(text)]
    return _innermost(frames, prefer)


def _innermost(frames: Sequence[tuple[str, int | None, str | None]], prefer: str | Path | None) -> str:
    if not frames:
        return ""
    preferred = _resolved(str(prefer)) if prefer is not None else None
    in_preferred = (frame for frame in reversed(frames) if _resolved(frame[0]) == preferred)
    users = (frame for frame in reversed(frames) if _is_users(frame[0]))
    filename, line, name = next(in_preferred, None) or next(users, frames[-1])
    return f"{_short(filename)}:{line}" + (f" in {name}" if name and name != "<module>" else "")


def _resolved(filename: str) -> str:
    return filename if filename.startswith("<") else str(Path(filename).resolve())


def _is_users(filename: str) -> bool:
    path = _resolved(filename)
    return not path.startswith(("<", _BUFFER_PACKAGE, *_PYTHON_INSTALL))


def _short(filename: str) -> str:
    """The file and its folder: enough to find it, without the machine's layout."""
    if filename.startswith("<"):
        return filename
    path = Path(filename)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name
