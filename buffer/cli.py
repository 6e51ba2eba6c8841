"""``python buffer.py`` / ``python -m buffer`` / ``rollout-buffer``: run the service;
``rollout-buffer status`` and ``rollout-buffer tail`` look at a running one instead."""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags (``--help`` lists them; each has a ``ROLLOUT_BUFFER_*`` variable) and serve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["status"], ["tail"]):
        from buffer import console  # the command-line views load no server code

        sys.exit(console.main(args))
    serve(args)


def serve(args: list[str]) -> None:
    import uvicorn
    from pydantic_settings import CliApp

    from buffer.app import create_app
    from buffer.logs import configure_logging
    from buffer.settings import Settings

    settings = CliApp.run(Settings, cli_args=args)
    configure_logging(settings.log_level, settings.log_format)
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
