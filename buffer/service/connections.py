"""The HTTP connections the service accepts: uvicorn's httptools protocol, with limits it lacks.

uvicorn closes a keep-alive connection idle past ``timeout_keep_alive``, but sets no bound
before a request's headers are whole: with httptools a client may send headers of any size
(held in memory, before the API key is looked at) or trickle them forever, and some 1,100
such connections use up 1,024 file descriptors, after which no client gets in. uvicorn's own
``limit_concurrency`` does not help there: it counts a connection only once its headers are in.

``guarded_protocol`` adds, per server:

- a limit on a request's line and headers: past ``max_header_bytes``, a 431 and the connection
  is closed (what uvicorn's h11 protocol does with ``h11_max_incomplete_event_size``);
- a deadline for them: a connection that has not sent a whole request line and headers within
  ``header_timeout_s`` of opening (or of starting its next request) is closed;
- a cap on open connections: past ``max_connections``, a new connection closes the one that
  has waited longest for its headers (a slow client loses its place to one that is ready), or
  is itself answered 503 when none is waiting.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 40\r\nconnection: close\r\n\r\nrequest line and headers are too large\r\n"
)
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
#: How often at most the log says that connections were closed for waiting too long.
REPORT_INTERVAL_S = 60.0


@dataclass(slots=True)
class ConnectionLimits:
    """The limits, and the state the connections of one server share."""

    max_header_bytes: int
    header_timeout_s: float
    max_connections: int
    #: Connections still waiting for their request's headers, the longest waiting first, with
    #: the loop time they started waiting.
    waiting: OrderedDict[GuardedProtocol, float] = field(default_factory=OrderedDict)
    open: int = 0
    closed: dict[str, int] = field(default_factory=lambda: {"evicted": 0, "timed_out": 0, "too_large": 0})
    refused: int = 0
    _reported_s: float = 0.0
    _sweeping: bool = False

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look for connections past their header deadline from now on. One timer a server,
        not one a request: arming and cancelling a timer on every request would cost the
        write path more than all the rest of this module."""
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(self._sweep_interval_s(), self._sweep, loop)

    def _sweep_interval_s(self) -> float:
        return min(1.0, self.header_timeout_s / 4)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections waiting longer than ``header_timeout_s``: the oldest first,
        stopping at the first that may wait on, so O(connections closed)."""
        deadline = loop.time() - self.header_timeout_s
        while self.waiting:
            protocol, since = next(iter(self.waiting.items()))
            if since > deadline:
                break
            protocol._close("timed_out")
        loop.call_later(self._sweep_interval_s(), self._sweep, loop)

    def count(self, reason: str) -> None:
        self.closed[reason] += 1
        now = time.monotonic()
        if now - self._reported_s >= REPORT_INTERVAL_S:
            self._reported_s = now
            logger.warning(
                "closed connections that did not send their headers in time or in size: %s; refused %d "
                "(--max-connections %d, --header-timeout-seconds %g, --max-header-bytes %d)",
                ", ".join(f"{count} {reason}" for reason, count in self.closed.items()),
                self.refused,
                self.max_connections,
                self.header_timeout_s,
                self.max_header_bytes,
            )


def default_max_connections() -> int:
    """Half the file descriptors the process may open: the rest are for the policy servers the
    generators call, the data folder and the reward processes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(32, (soft if soft != resource.RLIM_INFINITY else 2**20) // 2)


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open files to the hard one (often 1,024 against 500,000 or more);
    returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 2**20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            logger.debug("could not raise the open-file limit to %d", wanted, exc_info=True)
    return soft


class GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` bounded by ``limits`` (set on the subclass ``guarded_protocol`` makes)."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._waiting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        limits = self.limits
        limits.watch(self.loop)
        limits.open += 1
        if limits.open > limits.max_connections:
            if limits.waiting:
                next(iter(limits.waiting))._close("evicted")  # which takes it off the list
            else:
                limits.refused += 1
                self.transport.write(_BUSY)
                self.transport.close()
                return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        self.limits.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting and not self.transport.is_closing():
            # Counted once what was fed has not completed the headers: a body that arrives in
            # the same read as its headers is never counted.
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self.transport.write(_TOO_LARGE)
                self._close("too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.cycle is None or self.cycle.response_complete:  # not a request pipelined behind one
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._headers_done()
        super().on_headers_complete()

    def _await_headers(self) -> None:
        if not self._waiting:
            self._waiting = True
            self._header_bytes = 0
            self.limits.waiting[self] = self.loop.time()

    def _headers_done(self) -> None:
        if self._waiting:
            self._waiting = False
            del self.limits.waiting[self]

    def _close(self, reason: str) -> None:
        self._headers_done()
        if not self.transport.is_closing():
            self.limits.count(reason)
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``), bound to ``limits``."""
    return type("GuardedHttpToolsProtocol", (GuardedProtocol,), {"limits": limits})
