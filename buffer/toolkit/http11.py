"""The engine clients' default transport for ``http://`` engines: HTTP/1.1 on asyncio's
protocols, parsed by ``httptools`` (llhttp, the parser uvicorn serves with).

A generator's worker spends most of its CPU on the engine requests: aiohttp's ``ClientSession``
cost about 120 us of CPU per request here (URL objects, tracing, cookies, redirects and
payload machinery a JSON POST to an engine does not use), this transport about 50 us
(``bench/engine_client_cpu.py``). It does one thing: a POST (or a health check's GET) of a
body already encoded, on a pool of kept-alive connections, and the whole answer back.

- at most ``max_connections`` connections at once, to all engines together; a request waits
  for one; idle connections are reused (newest first) and dropped when the server closes them;
- a connection gets ``connect_timeout_s`` to open (``ConnectTimeout``; refused:
  ``ConnectError``, both ``connect=True``: nothing reached the engine) and the answer
  ``timeout_s`` to come whole (``ReadTimeout``); a connection lost or an answer that does
  not parse is a ``ReadError``. Nothing is retried here: the engine client's retries decide;
- no ``Accept-Encoding`` is sent, so engines answer uncompressed; a ``gzip`` or ``deflate``
  answer is still decoded;
- ``https://`` (and anything else) goes through ``AiohttpTransport``, opened on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from buffer.toolkit.transport import AiohttpTransport, Reply, Unreachable


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    head: bytes  # the request line and the Host header, for POST
    get_head: bytes  # the same for GET


class _Connection(asyncio.Protocol):
    """One kept-alive connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[Reply] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._retry_after: str | None = None
        self._encoding: bytes | None = None
        self._header: bytes = b""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; not an isinstance check: uvloop's (the service's and Ray's loop)
        # do not derive from asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable("ReadError", f"the answer does not parse as HTTP: {exc}", connect=False))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        detail = str(exc) if exc else "the server closed the connection"
        self._fail(Unreachable("ReadError", detail, connect=False))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 11 and name.lower() == b"retry-after":
            self._retry_after = value.decode("latin-1")
        elif len(name) == 16 and name.lower() == b"content-encoding":
            self._encoding = value.strip().lower()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        status = self._parser.get_status_code()
        retry_after, encoding = self._retry_after, self._encoding
        self._body, self._retry_after, self._encoding = [], None, None
        if not self._parser.should_keep_alive():
            self.close()
        if waiter is None or waiter.done():
            return
        if encoding not in (None, b"identity"):
            try:
                body = _decoded(body, encoding)
            except (zlib.error, ValueError) as exc:
                waiter.set_exception(Unreachable("DecodingError", str(exc), connect=False))
                return
        waiter.set_result(Reply(status, body, retry_after))

    def _fail(self, error: Unreachable) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http11Transport:
    """A pool of HTTP/1.1 connections per engine (host and port), for ``EngineClient``."""

    def __init__(
        self, *, max_connections: int = 1000, timeout_s: float = 600.0, connect_timeout_s: float = 30.0
    ) -> None:
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._slots: asyncio.Semaphore | None = None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._targets: dict[str, _Target | None] = {}
        self._other: AiohttpTransport | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        target = self._target(url)
        if target is None:
            return await self._fallback().post(url, body, headers)
        head = b"".join((target.head, _header_lines(headers), b"content-length: %d\r\n\r\n" % len(body)))
        return await self._exchange(target, head + body, self.timeout_s)

    async def get(self, url: str, timeout_s: float) -> int:
        target = self._target(url)
        if target is None:
            return await self._fallback().get(url, timeout_s)
        reply = await self._exchange(target, target.get_head + b"\r\n", timeout_s)
        return reply.status

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
        for connection in list(self._busy):
            connection.close()
        if self._other is not None:
            await self._other.aclose()

    async def _exchange(self, target: _Target, request: bytes, timeout_s: float) -> Reply:
        if self._slots is None:  # asyncio primitives belong to the running loop: made on first use
            self._slots = asyncio.Semaphore(self.max_connections)
        async with self._slots:
            connection = await self._connection(target)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[Reply] = loop.create_future()
            connection.waiter = waiter
            self._busy.add(connection)
            timer = loop.call_later(timeout_s, _time_out, waiter, timeout_s)
            try:
                assert connection.transport is not None
                connection.transport.write(request)
                reply = await waiter
            except BaseException:
                connection.close()  # a timeout or a cancel: the answer may still come, on no one's request
                raise
            finally:
                timer.cancel()
                self._busy.discard(connection)
            if not connection.closed:
                self._idle.setdefault((target.host, target.port), []).append(connection)
            return reply

    async def _connection(self, target: _Target) -> _Connection:
        idle = self._idle.get((target.host, target.port))
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, target.host, target.port)
        except TimeoutError as exc:
            raise Unreachable(
                "ConnectTimeout", f"no connection within {self.connect_timeout_s} s", connect=True
            ) from exc
        except OSError as exc:
            raise Unreachable("ConnectError", str(exc), connect=True) from exc
        return connection

    def _target(self, url: str) -> _Target | None:
        """The host, port and request line ``url`` names; ``None`` for what is not plain http."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        target: _Target | None = None
        if parts.scheme == "http" and parts.hostname:
            try:
                port = parts.port or 80
            except ValueError:  # a port that is no number: aiohttp names it
                port = None
            if port is not None:
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                host = parts.hostname
                authority = f"[{host}]" if ":" in host else host
                if parts.port is not None:
                    authority = f"{authority}:{port}"
                line = f" {path} HTTP/1.1\r\nhost: {authority}\r\n"
                target = _Target(host, port, f"POST{line}".encode(), f"GET{line}".encode())
        if len(self._targets) < 1024:
            self._targets[url] = target
        return target

    def _fallback(self) -> AiohttpTransport:
        if self._other is None:
            self._other = AiohttpTransport(
                max_connections=self.max_connections,
                timeout_s=self.timeout_s,
                connect_timeout_s=self.connect_timeout_s,
            )
        return self._other


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a line break in the {name!r} header")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


def _time_out(waiter: asyncio.Future[Reply], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(Unreachable("ReadTimeout", f"no answer within {timeout_s} s", connect=False))


def _decoded(body: bytes, encoding: bytes) -> bytes:
    if encoding == b"gzip":
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == b"deflate":
        with contextlib.suppress(zlib.error):
            return zlib.decompress(body)
        return zlib.decompress(body, -zlib.MAX_WBITS)  # raw deflate, as some servers send it
    raise ValueError(f"an answer in an encoding this client cannot read: {encoding.decode('latin-1')}")
