"""``python buffer.py`` / ``python -m buffer`` / ``rollout-buffer``: run the service;
``rollout-buffer status`` and ``rollout-buffer tail`` look at a running one instead;
``rollout-buffer check DIR [--repair]`` checks (and salvages) a data folder."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

    from buffer.settings import Settings


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags (``--help`` lists them; each has a ``ROLLOUT_BUFFER_*`` variable) and serve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["status"], ["tail"]):
        from buffer import console  # the command-line views load no server code

        sys.exit(console.main(args))
    if args[:1] == ["check"]:
        from buffer import datacheck

        sys.exit(datacheck.main(args[1:]))
    serve(args)


def serve(args: list[str]) -> None:
    import uvicorn
    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from buffer.app import create_app
    from buffer.logs import configure_logging
    from buffer.settings import Settings

    try:
        settings = CliApp.run(Settings, cli_args=args)
    except ValidationError as exc:  # a usage error, not a crash: no traceback
        sys.exit(_usage_error(exc))
    configure_logging(settings.log_level, settings.log_format)
    # Each write allocates many short-lived objects; collecting the young generation every
    # 50,000 allocations instead of 700 gains some 15% of write throughput. What exists at
    # start-up (imports, settings) is never garbage: keep it out of every collection.
    gc.set_threshold(50_000, 20, 20)
    gc.freeze()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # keep the format configured above
        access_log=settings.access_log,
        timeout_keep_alive=5,
        **_connection_options(settings),
    )

    class Server(uvicorn.Server):
        """uvicorn's server, telling the app first when SIGTERM or Ctrl-C arrives: long polls
        answer at once instead of holding the graceful shutdown up for their whole wait."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            services = getattr(app.state, "services", None)
            if services is not None:
                services.begin_shutdown()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # uvicorn raises a captured signal again once it has shut down, which makes
                # the exit status -15; a stop asked for and done cleanly is a success: 0.
                self._captured_signals.remove(sig)

    # SIGTERM: uvicorn stops accepting and finishes the requests in flight; then the app's
    # lifespan stops the jobs and closes the journal, and the process exits 0.
    Server(config).run()


def _connection_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's HTTP protocol, bounded: headers in size and time, connections in number
    (``buffer.connections``). Without httptools, uvicorn's h11 protocol and its own header limit."""
    try:
        from buffer import connections
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}
    descriptors = connections.raise_descriptor_limit()
    max_connections = settings.max_connections or connections.default_max_connections()
    logging.getLogger(__name__).info(
        "at most %d connections (open-file limit %d), headers within %d bytes and %g s",
        max_connections,
        descriptors,
        settings.max_header_bytes,
        settings.header_timeout_seconds,
    )
    limits = connections.ConnectionLimits(
        settings.max_header_bytes, settings.header_timeout_seconds, max_connections
    )
    return {"http": connections.guarded_protocol(limits)}


def _usage_error(exc: ValidationError) -> int:
    """Say which option is wrong and why, as argparse does; the exit status is 2."""
    for error in exc.errors(include_url=False):
        option = "--" + "-".join(str(part) for part in error["loc"]).replace("_", "-")
        sys.stderr.write(f"python buffer.py: error: {option}: {error['msg']} (got {error.get('input')!r})\n")
    return 2
