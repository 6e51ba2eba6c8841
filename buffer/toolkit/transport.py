"""The HTTP exchange with the policy server, behind a small interface the engine clients use.

The default is aiohttp, called directly: one ``ClientSession`` per client, with explicit limits
and timeouts. httpx over aiohttp (``httpx-aiohttp``) cost about two thirds of the service's busy
time in its own layers (539-764 us of CPU per engine request against 256-325 us for aiohttp
alone), and httpx's own pool collapses at hundreds of requests in flight (encode/httpx#3215).
``bench/engine_client_cpu.py`` measures the client's CPU per request.

``HttpxTransport`` wraps any ``httpx.AsyncBaseTransport``: tests pass
``httpx.AsyncHTTPTransport()``, which respx intercepts, or an ASGI app's transport.

Either way a failure to exchange is one exception, ``Unreachable``, named as httpx names it
(``ConnectError``, ``ReadError``, ``ReadTimeout``, ...): the kinds a job's progress counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

if TYPE_CHECKING:
    import aiohttp

#: The SGLang router's (sgl-model-gateway) routing key: its ``consistent_hashing`` and ``manual``
#: policies send every request with the same key to the same worker.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP answer, read whole."""

    status: int
    body: bytes
    retry_after: str | None = None

    @property
    def is_error(self) -> bool:
        return self.status >= 400

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Unreachable(Exception):
    """No HTTP answer: the connection was refused or dropped, or the answer did not come in time.

    ``kind`` names it as httpx does; ``connect`` is true when the request never reached the
    engine (nothing was started there), so another engine can take it at once."""

    def __init__(self, kind: str, detail: str, *, connect: bool) -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.connect = connect

    def __repr__(self) -> str:
        return f"{self.kind}({str(self)!r})"


class Transport(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply: ...

    async def get(self, url: str, timeout_s: float) -> int:
        """The status of a GET (a health check); ``Unreachable`` without an answer."""
        ...

    async def aclose(self) -> None: ...


class AiohttpTransport:
    """One ``aiohttp.ClientSession``, opened on first use (it belongs to the running loop).

    At most ``max_connections`` connections (to all engines together), kept alive; a
    connection is given ``connect_timeout_s`` to open and an answer ``timeout_s`` to come.
    aiohttp is imported here, not with the module: a worker talking to ``http://`` engines
    only (``http11``) does not pay its 80 ms of start-up."""

    def __init__(
        self, *, max_connections: int = 1000, timeout_s: float = 600.0, connect_timeout_s: float = 30.0
    ):
        import aiohttp

        self.max_connections = max_connections
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, trust_env=False, auto_decompress=True
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        import aiohttp

        try:
            async with self._open().post(url, data=body, headers=headers) as response:
                content = await response.read()
                return Reply(response.status, content, response.headers.get("retry-after"))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _unreachable(exc) from exc

    async def get(self, url: str, timeout_s: float) -> int:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._open().get(url, timeout=timeout) as response:
                await response.read()
                return response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _unreachable(exc) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpxTransport:
    """An ``httpx.AsyncClient`` on the given transport (tests: respx, an ASGI app)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, timeout_s: float = 600.0) -> None:
        self._client = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False
        )

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        try:
            response = await self._client.post(url, content=body, headers=dict(headers))
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__, str(exc), connect=_never_sent(exc)) from exc
        return Reply(response.status_code, response.content, response.headers.get("retry-after"))

    async def get(self, url: str, timeout_s: float) -> int:
        try:
            response = await self._client.get(url, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__, str(exc), connect=_never_sent(exc)) from exc
        return response.status_code

    async def aclose(self) -> None:
        await self._client.aclose()


def _never_sent(exc: httpx.TransportError) -> bool:
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _unreachable(exc: BaseException) -> Unreachable:
    """aiohttp's exceptions under httpx's names (the kinds counted before aiohttp was called directly)."""
    import aiohttp

    detail = str(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Unreachable("ConnectTimeout", detail, connect=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Unreachable("ConnectError", detail, connect=True)
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return Unreachable("ReadTimeout", detail, connect=False)
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        return Unreachable("ReadError", detail, connect=False)
    if isinstance(exc, aiohttp.InvalidURL):
        return Unreachable("UnsupportedProtocol", detail, connect=True)
    return Unreachable(type(exc).__name__, detail, connect=False)
