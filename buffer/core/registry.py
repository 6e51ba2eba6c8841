"""Discovering the generators: every ``*_generator.py`` in the generator folder.

Each file is imported under its own module name, registered in ``sys.modules`` before it
runs and removed again if it fails. A file is reported, never fatal, when it fails to
import (with the traceback), breaks the contract (no ``TASK_TYPE``, no ``run_rollout``, a
hook with the wrong parameters), or repeats another file's ``TASK_TYPE`` (both are reported
and neither is used: running the wrong one silently would be worse). ``refresh`` re-imports
only files that changed, so a new or edited generator is picked up without a restart; a file
that failed to import is imported again on each scan (a missing package may have been installed).

A file's top level runs in a process of its own first (``buffer.core.discovery``, one process
a scan, for every new or changed file, with a time limit a file: ``import_timeout_s``): a file
whose import exits the process (``os._exit``), crashes the interpreter or outlasts its limit is
reported, and the service never imports it. A file that imported there, and keeps the contract,
is then imported in the service: its hooks run here (``buffer.core.hook_guard``), and a pydantic
model it declares of its ``/start_rollout`` fields validates them here, with its own validators
(which a model rebuilt from its JSON schema would lose). A file that hung or killed its process
is tried again only once it changes; one that raised, on each scan.

No traceback reaches a client: the log has it, the API says only ``where`` the error happened
(the innermost frame of the generator's code), as it does for a failed job or hook.

What a generator declares of the ``/start_rollout`` fields it reads, ``START_ROLLOUT_FIELDS``,
is read here too (``declared_fields``), in one of three forms: a tuple of names; a pydantic
model of them, typed (a ``BaseModel`` subclass; a payload that breaks it is refused with the
model's reasons); or ``"*"``, a generator that reads fields nobody can list (it passes the
payload on), so that any field is accepted. A generator that declares nothing reads no others
(slime's own generators do not): ``buffer.service.start_fields`` refuses any other field with
a 422 naming it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
from buffer.keys import API_KEY_VARIABLE

logger = logging.getLogger(__name__)

SUFFIX = "_generator.py"

#: The module attribute a generator declares the extra ``/start_rollout`` fields it reads in.
FIELDS_ATTRIBUTE = "START_ROLLOUT_FIELDS"
#: Its value for a generator that reads fields it cannot list: every field is accepted.
ANY_FIELDS = "*"
#: How long a generator file's import may take in the discovery process (``--generator-import-timeout-s``).
DEFAULT_IMPORT_TIMEOUT_S = 60.0
#: How long the discovery process may take to start, before its first file.
DISCOVERY_START_S = 60.0
#: After a file's time limit, how long its stacks (``faulthandler``) have to reach the log.
_DUMP_S = 1.0


@dataclass(frozen=True, slots=True)
class DeclaredFields:
    """The fields a generator reads beyond the service's and the toolkit's."""

    names: frozenset[str] = frozenset()
    #: A pydantic model of them (``names`` are its fields), or None.
    model: Any = None
    #: Any field (``"*"``).
    any: bool = False


def declared_fields(module: ModuleType) -> DeclaredFields:
    """The generator module's ``START_ROLLOUT_FIELDS``; ``TypeError`` saying what is wrong with it."""
    declared = getattr(module, FIELDS_ATTRIBUTE, None)
    if declared is None:
        return DeclaredFields()
    if declared == ANY_FIELDS:
        return DeclaredFields(any=True)
    model_fields = getattr(declared, "model_fields", None)  # a pydantic model: no import of pydantic here
    if isinstance(declared, type) and isinstance(model_fields, dict):
        return DeclaredFields(frozenset(model_fields), model=declared)
    if isinstance(declared, (tuple, list, set, frozenset)) and all(
        isinstance(name, str) and name for name in declared
    ):
        return DeclaredFields(frozenset(declared))
    raise TypeError(
        f"{FIELDS_ATTRIBUTE} must be a tuple of field names, a pydantic model of the fields, "
        f"or {ANY_FIELDS!r} (any field), not {declared!r}"
    )


_BUFFER_PACKAGE = str(paths.PACKAGE) + os.sep
_PYTHON_INSTALL = tuple(
    {str(Path(p).resolve()) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
)
#: A frame line of a formatted traceback; a SyntaxError's has no function.
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<name>.+))?$', re.MULTILINE)
#: A frame line of a ``faulthandler`` dump (most recent call first).
_DUMPED_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>.+)$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Generator:
    task_type: str
    path: Path
    module: ModuleType
    run_rollout: Callable[[dict[str, Any]], Any]
    hooks: Hooks
    #: The ``/start_rollout`` fields it reads beyond the service's and the toolkit's.
    fields: DeclaredFields = dataclasses.field(default_factory=DeclaredFields)

    @property
    def file_name(self) -> str:
        """The file as a user names it: ``generator/math_generator.py``."""
        return _short(str(self.path))

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
    #: Tried again on each scan, changed or not (an import that raised); else only once the
    #: file changes (one that hung or ended its process: each try costs its time limit).
    retried: bool = True

    def describe(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "task_type": self.task_type,
            "kind": self.kind,
            "error": self.error,
            "where": self.where,
        }


class GeneratorRegistry:
    def __init__(
        self,
        directory: Path,
        *,
        hook_timeout_s: float | None = None,
        import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S,
    ) -> None:
        """``hook_timeout_s``: each hook a generator overrides runs off the caller's thread and
        fails after this long (see ``buffer.core.hook_guard``); None: called directly.
        ``import_timeout_s``: a file whose import in the discovery process takes longer is
        reported, not loaded."""
        self.directory = directory
        self.hook_timeout_s = hook_timeout_s
        self.import_timeout_s = import_timeout_s
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
        """Re-scan the folder; import new and changed files (in the discovery process first),
        forget removed ones. Blocks up to ``import_timeout_s`` a file: call it off the event loop."""
        with self._lock:
            paths = sorted(self.directory.glob(f"*{SUFFIX}")) if self.directory.is_dir() else []
            loaded: dict[Path, tuple[tuple[int, int], Generator | LoadError]] = {}
            fresh: dict[Path, tuple[int, int]] = {}
            for path in paths:
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                fingerprint = (stat.st_mtime_ns, stat.st_size)
                cached = self._loaded.get(path)
                # A file that failed to import is tried again on every scan, changed or not: what
                # it lacked is often a package installed since (``pip install requests``).
                retry = (
                    cached is not None
                    and isinstance(cached[1], LoadError)
                    and cached[1].kind == "import"
                    and cached[1].retried
                )
                if cached is not None and cached[0] == fingerprint and not retry:
                    loaded[path] = cached
                else:
                    fresh[path] = fingerprint
            probed = probe(list(fresh), self.import_timeout_s) if fresh else {}
            for path, fingerprint in fresh.items():
                failed = probed.get(path)
                result = failed if failed is not None else load_generator(path)
                loaded[path] = (fingerprint, self._guarded(result))
            self._loaded = dict(sorted(loaded.items()))
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
            # The file serving the task keeps it (a copy of the template must not take the task
            # over, nor down); else the first in sorted order. The others are reported.
            serving = self._generators.get(task_type)
            kept = next((g for g in found if serving is not None and g.path == serving.path), found[0])
            generators[task_type] = kept
            for generator in found:
                if generator is not kept:
                    errors.append(
                        LoadError(
                            generator.path,
                            "duplicate",
                            f"TASK_TYPE {task_type!r} is already defined by {kept.path}: this file is "
                            "not used; give it a TASK_TYPE of its own",
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


def probe(files: list[Path], limit_s: float) -> dict[Path, LoadError | None]:
    """Import each of ``files`` in the discovery process (``buffer.core.discovery``) first: for
    each, None when it imported there within ``limit_s`` and keeps the contract, else what went
    wrong. A file that ends the process or outlasts its limit is blamed, and a new process
    takes the files after it."""
    results: dict[Path, LoadError | None] = {}
    while remaining := [path for path in files if path not in results]:
        found = _probe_once(remaining, limit_s)
        if not found:  # the process failed before its first file: no file to blame, none to load
            return results | {path: _discovery_failed(path, "did not start") for path in remaining}
        results |= found
    return results


def _probe_once(files: list[Path], limit_s: float) -> dict[Path, LoadError | None]:
    """One discovery process over ``files``, read until it has answered for each, exits, or
    outlasts the file it imports."""
    command = [sys.executable, "-P", "-m", "buffer.core.discovery", "--timeout-s", f"{limit_s:g}"]
    results: dict[Path, LoadError | None] = {}
    importing: Path | None = None
    timed_out = False
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            [*command, *map(str, files)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=_discovery_env(),
            start_new_session=True,  # its group is killed at the end, with what its imports started
        )
        assert process.stdout is not None
        try:
            pending, deadline = b"", time.monotonic() + DISCOVERY_START_S
            while len(results) < len(files):
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not select.select([process.stdout], [], [], left)[0]:
                    continue
                chunk = os.read(process.stdout.fileno(), 1 << 16)
                if not chunk:
                    break  # it exited
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    try:
                        message = json.loads(line)
                    except ValueError:  # not one of its answers: its other output goes elsewhere
                        continue
                    if "importing" in message:
                        importing = Path(message["importing"])
                        deadline = time.monotonic() + limit_s + _DUMP_S
                    else:
                        results[Path(message["path"])] = _answer(Path(message["path"]), message)
                        importing = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.stdout.close()
            code = process.wait()
            errors.seek(0)
            stderr = errors.read().decode(errors="replace")
    if importing is not None and importing not in results:
        results[importing] = _import_ended(importing, limit_s, None if timed_out else code, stderr)
    elif not results:
        logger.error("the generator discovery process failed (exit code %s):\n%s", code, stderr[-4000:])
    return results


def _answer(path: Path, message: dict[str, Any]) -> LoadError | None:
    error = message.get("error")
    if error is None:
        logger.debug("generator %s: %s", path, message.get("contract"))
        return None
    return LoadError(
        path, error["kind"], error["error"], error["task_type"], error["traceback"], error["where"]
    )


def _import_ended(path: Path, limit_s: float, code: int | None, stderr: str) -> LoadError:
    """The error of a file whose import ended the discovery process (``code``), or outlasted
    ``limit_s`` (None): where it was, from the stacks the process wrote."""
    if code is None:
        error = f"its import did not finish within {limit_s:g} s (--generator-import-timeout-s)"
        frames = [(m["file"], int(m["line"]), m["name"]) for m in _DUMPED_FRAME.finditer(stderr)]
        at = _innermost(frames[::-1], path) or None
    elif code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        error = f"its import killed the process ({name})"
        at = where_in(stderr, path) or None
    else:
        error = f"its import ended the process (exit code {code})"
        at = where_in(stderr, path) or None
    note = "; imported in a process of its own, so the service did not import it"
    return LoadError(
        path, "import", error + note, _declared_task_type(path), stderr[-4000:], at, retried=False
    )


def _discovery_failed(path: Path, what: str) -> LoadError:
    return LoadError(path, "import", f"the discovery process {what}: see the log", _declared_task_type(path))


def _discovery_env() -> dict[str, str]:
    """The service's environment without its key, its import path as it is now (this package
    first): a file imports there as it would here."""
    env = dict(os.environ)
    env.pop(API_KEY_VARIABLE, None)
    entries = dict.fromkeys([str(paths.ROOT), *(entry for entry in sys.path if entry)])
    env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


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
    return Generator(task_type, path, module, run_rollout, bind_hooks(vars(module)), declared_fields(module))


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
