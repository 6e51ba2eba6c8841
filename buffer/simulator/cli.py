"""``python -m buffer.simulator``: run the simulated LLM server.

Its flags are made from ``SimConfig`` itself, as the service's are from its settings (the
simulator shares no code with the service): each shows what it takes (``--port N``), its
default and its ``ROLLOUT_BUFFER_SIM_*`` variable; a bad value is one line naming the flag.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from buffer.simulator.app import create_sim_app
from buffer.simulator.config import ENV_PREFIX, SimConfig
from buffer.simulator.outage import QuietDroppedConnections
from buffer.simulator.tokenizer import MissingExtraError

logger = logging.getLogger(__name__)

PROG = "python -m buffer.simulator"
#: What a flag takes, said as a word, where its name alone does not say it.
METAVARS = {
    "port": "PORT",
    "tokenizer_path": "DIR",
    "weight_version": "VERSION",
    "routed_experts": "LAYERS,TOPK",
    "served_model_name": "NAME",
    "seed": "N",
}


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    """One flag per ``SimConfig`` field: ``--kebab-name WORD``, its description, its default."""
    doc = " ".join((SimConfig.__doc__ or "").split())
    result = argparse.ArgumentParser(prog=prog, description=doc)
    for name, field in SimConfig.model_fields.items():
        annotation, _ = _without_none(field.annotation)
        default = field.get_default(call_default_factory=True)
        shown = "" if default is None else f" (default: {default})"
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": f"{field.description}{shown}; ${ENV_PREFIX}{name.upper()}".replace("%", "%%"),
        }
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:  # checked by the config: one line
            kwargs["metavar"] = "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
        else:
            kwargs["metavar"] = _metavar(name, annotation)
        result.add_argument("--" + name.replace("_", "-"), **kwargs)
    return result


def _without_none(annotation: Any) -> tuple[Any, bool]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0], True
    return annotation, False


def _metavar(name: str, annotation: Any) -> str:
    if name in METAVARS:
        return METAVARS[name]
    if annotation is float:
        return "SECONDS" if name.endswith("_s") else "P"  # the rest are probabilities
    return "N" if annotation is int else name.upper()


def parse_config(argv: Sequence[str] | None = None, prog: str = PROG) -> SimConfig:
    """Flags (``--help`` lists them) over ``ROLLOUT_BUFFER_SIM_*`` variables over defaults;
    ``pydantic.ValidationError`` for a bad value."""
    given = vars(parser(prog).parse_args(argv))
    for name, value in given.items():
        if value == "null" and _without_none(SimConfig.model_fields[name].annotation)[1]:
            given[name] = None
    return SimConfig(**given)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> None:
    """Run the server (``rollout-buffer simulator`` passes its own name as ``prog``)."""
    try:
        config = parse_config(argv, prog)
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            sys.stderr.write(f"{prog}: --{field.replace('_', '-')}: {error['msg']}\n")
        sys.exit(2)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    logging.getLogger("uvicorn.error").addFilter(QuietDroppedConnections())  # counted on /stats instead
    settings = ", ".join(
        f"{name}={value}" for name, value in config.model_dump(exclude={"host", "port"}).items()
    )
    # transformers advises at import that it has no torch: the simulator needs none.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        app = create_sim_app(config)
    except MissingExtraError as exc:
        sys.exit(f"{prog}: {exc}")
    # A request allocates many short-lived objects, and thousands are in flight: collecting the
    # young generation every 50,000 allocations instead of 700 spares rescanning those in flight
    # over and over. What exists at start-up (the tokenizer, its tables) is never garbage.
    gc.set_threshold(50_000, 20, 20)
    gc.freeze()
    logger.info("simulated LLM server on http://%s:%d/v1 (%s)", config.host, config.port, settings)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=None,  # keep the format configured above
        access_log=config.access_log,
        backlog=4096,  # a benchmark opens a thousand connections at once
        proxy_headers=False,  # no proxy in front: X-Forwarded-* would be read for nothing
    )
