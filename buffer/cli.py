"""``python buffer.py`` / ``python -m buffer`` / ``rollout-buffer``: run the service."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence

import uvicorn
from pydantic_settings import CliApp

from buffer.app import create_app
from buffer.settings import Settings


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    # httpx logs every request at INFO: thousands a second from a generator.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags (``--help`` lists them; each has a ``ROLLOUT_BUFFER_*`` variable) and serve."""
    settings = CliApp.run(Settings, cli_args=list(argv) if argv is not None else None)
    configure_logging(settings.log_level)
    # Each write allocates many short-lived objects; collecting the young generation every
    # 50,000 allocations instead of 700 gains some 15% of write throughput. What exists at
    # start-up (imports, settings) is never garbage: keep it out of every collection.
    gc.set_threshold(50_000, 20, 20)
    gc.freeze()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # keep the format configured above
        access_log=settings.access_log,
        timeout_keep_alive=5,
    )
