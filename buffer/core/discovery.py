"""The discovery process: ``python -P -m buffer.core.discovery --timeout-s S FILE...``.

The service never runs a generator file's top level before a process of its own has: a file
whose import calls ``os._exit``, crashes the interpreter or hangs would take the service with
it (``buffer.core.registry.GeneratorRegistry.refresh`` starts this process and reads it). It
imports each file in turn, as the service would (``load_generator``), and writes one JSON line
per step to its standard output, which nothing else writes to (what a generator prints goes to
standard error):

- ``{"importing": FILE}`` before each file, so that whoever reads knows which file is to blame
  if no answer follows (the process exited, or ran out of time);
- ``{"path": FILE, "contract": {...}}`` for a file that imported and keeps the contract: its
  ``TASK_TYPE``, ``run_rollout`` (sync or async), the hooks it overrides, and what it declares
  of the ``/start_rollout`` fields (``START_ROLLOUT_FIELDS``: names, ``"*"``, or a pydantic
  model: its fields, import path and JSON schema);
- ``{"path": FILE, "error": {...}}`` for a file that failed to import or breaks the contract
  (``LoadError``: kind, error, task type, traceback, where).

A file still importing ``--timeout-s`` after it started has its threads' stacks written to
standard error (``faulthandler``), so the service can say where it hung before it kills it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import IO, Any

from buffer.core.registry import Generator, LoadError, load_generator


def contract(generator: Generator) -> dict[str, Any]:
    """What the service keeps of a generator it has not imported: its contract, as JSON."""
    fields = generator.fields
    model = fields.model
    return {
        "task_type": generator.task_type,
        "run_rollout": "async" if generator.is_async else "sync",
        "hooks": sorted(generator.hooks.overridden),
        "fields": {
            "names": sorted(fields.names),
            "any": fields.any,
            "model": f"{model.__module__}.{model.__qualname__}" if model is not None else None,
            "schema": _schema(model) if model is not None else None,
        },
    }


def report(path: Path, result: Generator | LoadError) -> dict[str, Any]:
    """The line written for ``path``."""
    if isinstance(result, Generator):
        return {"path": str(path), "contract": contract(result)}
    error = {
        "kind": result.kind,
        "error": result.error,
        "task_type": result.task_type,
        "traceback": result.traceback,
        "where": result.where,
    }
    return {"path": str(path), "error": error}


def _schema(model: Any) -> Any:
    try:
        return model.model_json_schema()
    except Exception:  # a field type pydantic cannot describe: the names are enough
        return None


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message, default=str) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m buffer.core.discovery")
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a generator's prints go to standard error: standard output is the answers'
    for name in args.files:
        _send(out, {"importing": name})
        faulthandler.dump_traceback_later(args.timeout_s)
        result = load_generator(Path(name))
        faulthandler.cancel_dump_traceback_later()
        _send(out, report(Path(name), result))
    sys.stderr.flush()
    # Not a normal exit: no atexit handler or thread a generator left behind may hold it up.
    os._exit(0)


if __name__ == "__main__":
    main()
