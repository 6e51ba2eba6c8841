"""``python -m buffer.simulator``: run the simulated LLM server."""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Sequence

import uvicorn
from pydantic_settings import CliApp

from buffer.simulator.app import create_sim_app
from buffer.simulator.config import SimConfig
from buffer.simulator.outage import QuietDroppedConnections
from buffer.simulator.tokenizer import MissingExtraError

logger = logging.getLogger(__name__)


def parse_config(argv: Sequence[str] | None = None) -> SimConfig:
    """Flags (``--help`` lists them) over ``SIM_LLM_*`` variables over defaults."""
    return CliApp.run(SimConfig, cli_args=list(argv) if argv is not None else None)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
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
        sys.exit(f"python -m buffer.simulator: {exc}")
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
