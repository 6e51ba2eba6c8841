"""Logging: configured once, in the entry point; every line a request causes carries its id.

``configure_logging`` gives the root logger one handler (text or JSON lines) that uvicorn's loggers
share, the service's own loggers the level asked and every library's its warnings only;
``RequestIdMiddleware`` sets the id of the request being handled in a context variable,
which the handler's filter copies onto each record as ``request_id``.
"""

from __future__ import annotations

import contextvars
import logging
import logging.config
import random
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s%(request_tag)s: %(message)s"
TEXT_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
MAX_REQUEST_ID_LENGTH = 128

# The id of the request being handled; None outside a request. Each request runs in its own task,
# hence its own copy of the context: ids never leak from one request to another.
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


def outside_request() -> contextvars.Context:
    """The current context without the request's id: for work a request starts that outlives
    it (a job and its workers), whose lines are the job's, not the request's."""
    context = contextvars.copy_context()
    context.run(request_id.set, None)
    return context


# What every LogRecord has: anything else on a record came in through ``extra``.
_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",  # set by Formatter.format
    "asctime",  # set by Formatter.format
    "request_id",  # set by RequestIdFilter, written out explicitly
    "color_message",  # uvicorn's copy of its message with ANSI colours
}


class RequestIdFilter(logging.Filter):
    """Copies the current request's id (or None) onto each record as ``record.request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__["request_id"] = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    """``2026-11-21 22:00:00 INFO    buffer.service.jobs [req 3f2a…]: message``, the tag only in a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT, TEXT_DATE_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        rid = record.__dict__.get("request_id")
        return TEXT_FORMAT % {**record.__dict__, "request_tag": f" [req {rid}]" if rid else ""}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id, traceback, extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = record.__dict__.get("request_id")
        if rid is not None:
            entry["request_id"] = rid
        if record.exc_info and record.exc_info[0] is not None:
            entry["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["traceback"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # A name with a leading underscore is a library's own (Ray's log-record factory adds
        # ``_ray_timestamp_ns`` to every record once imported), not an ``extra`` of the caller.
        extras = {
            key: value
            for key, value in record.__dict__.items()
            if key not in _RECORD_FIELDS and key not in entry and not key.startswith("_")
        }
        try:
            return orjson.dumps({**entry, **extras}, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # e.g. an int beyond 64 bits, or a cycle: fall back to each extra's repr
            return orjson.dumps({**entry, **{key: repr(value) for key, value in extras.items()}}).decode()


#: The service's own loggers (and their children), which log at the level asked; every other
#: logger (a library's: httpx, the OpenAI SDK, aiohttp, whatever a generator imports) says only
#: its warnings and errors, unless named in ``levels`` (``--log-level-for NAME=LEVEL``).
OWN_LOGGERS = ("buffer", "generator", "default_func", "__main__", *UVICORN_LOGGERS)


def configure_logging(
    level: str,
    log_format: LogFormat = "text",
    stream: TextIO | None = None,
    levels: Mapping[str, str] | None = None,
) -> None:
    """Send every log record, uvicorn's included, to one handler on ``stream`` (default stderr):
    the service's own loggers at ``level``, the root (so every library) at WARNING or
    ``level`` if stricter, and each logger ``levels`` names at its level.

    ``logging.config.dictConfig``: calling it again reconfigures rather than doubling lines.
    """
    own = {"level": level.upper(), "handlers": [], "propagate": True}
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"line": {"()": JsonFormatter if log_format == "json" else TextFormatter}},
        "handlers": {
            "line": {
                "class": "logging.StreamHandler",
                "stream": sys.stderr if stream is None else stream,
                "formatter": "line",
                "filters": ["request_id"],
            }
        },
        "root": {"level": max(logging.WARNING, _number(level)), "handlers": ["line"]},
        # uvicorn runs with log_config=None: its loggers come to the one handler, as the rest.
        "loggers": {name: dict(own) for name in OWN_LOGGERS},
    }
    for name, named_level in (levels or {}).items():
        config["loggers"][name] = {**config["loggers"].get(name, {}), "level": named_level.upper()}
    logging.config.dictConfig(config)


def _number(level: str) -> int:
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}")
    return number


def with_request_id(raw: bytes | None, send: Send) -> tuple[str, Send]:
    """The request's id (``raw``, the client's usable one, or a new one) and ``send`` adding it to
    the response's headers as ``x-request-id``."""
    # A correlation tag, not a secret: the cheap generator will do on this hot path.
    rid = f"{random.getrandbits(64):016x}" if raw is None else raw.decode()
    header = (b"x-request-id", rid.encode() if raw is None else raw)

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers")
            if isinstance(headers, list):  # Starlette's own list: add to it, no copy
                headers.append(header)
            else:
                message = {**message, "headers": [*(headers or ()), header]}
        await send(message)

    return rid, send_with_id


def _incoming_id(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The client's ``X-Request-ID`` if it is printable ASCII of at most 128 characters."""
    for name, value in headers:
        if name == b"x-request-id":
            value = value.strip()
            if 0 < len(value) <= MAX_REQUEST_ID_LENGTH and value.isascii() and value.decode().isprintable():
                return value
            return None
    return None


class RequestIdMiddleware:
    """Gives every HTTP request an id: the client's ``X-Request-ID`` or a fresh random one.

    The id is in ``request_id`` (so on every log record) while the request is handled and in the
    ``X-Request-ID`` response header. Pure ASGI: it runs on every write.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, send_with_id = with_request_id(_incoming_id(scope["headers"]), send)
        token = request_id.set(rid)
        await self.app(scope, receive, send_with_id)
        # Reset only on success: an exception goes on to Starlette's ServerErrorMiddleware (outside
        # this one), whose 500 handler logs it, and that line should carry the id too. The context
        # is this request's own, so leaving the id set there cannot mislabel another request.
        request_id.reset(token)
