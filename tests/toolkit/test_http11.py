"""The engine clients' default transport (``buffer.toolkit.http11``) against raw loopback servers
that answer byte for byte: kept-alive connections reused, closed ones dropped, chunked and
compressed answers read, a dropped answer a ``ReadError``, the connection limit kept."""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.transport import Unreachable

pytestmark = pytest.mark.anyio

Answer = Callable[[bytes], bytes | None]  # the request's bytes -> the answer's (None: drop it)


def answer(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    head = "".join(f"{h}\r\n" for h in (f"HTTP/1.1 {status}", f"content-length: {len(body)}", *headers))
    return head.encode() + b"\r\n" + body


class Server:
    """Answers each request (read up to its body's end) with ``respond(request)``; counts the
    connections opened and the most requests in progress at once."""

    def __init__(self, respond: Answer, delay_s: float = 0.0) -> None:
        self.respond = respond
        self.delay_s = delay_s
        self.connections = 0
        self.requests: list[bytes] = []
        self.in_progress = 0
        self.most_in_progress = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                self.in_progress += 1
                self.most_in_progress = max(self.most_in_progress, self.in_progress)
                await asyncio.sleep(self.delay_s)
                self.in_progress -= 1
                reply = self.respond(request)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Server], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(server: Server) -> str:
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        servers.append(listening)
        return f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/v1/chat/completions"

    yield start
    for listening in servers:
        listening.close()


async def test_a_post_sends_the_body_and_headers_and_reuses_the_connection(
    serve: Callable[[Server], Awaitable[str]],
) -> None:
    server = Server(lambda request: answer(b'{"ok": true}', "retry-after: 3"))
    url = await serve(server)
    transport = Http11Transport()
    try:
        for _ in range(3):
            reply = await transport.post(url, b'{"a": 1}', {"content-type": "application/json", "x-key": "k"})
            assert (reply.status, reply.body, reply.retry_after) == (200, b'{"ok": true}', "3")
    finally:
        await transport.aclose()
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert {b"content-type: application/json", b"x-key: k", b"content-length: 8"} <= set(lines)
    assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)
    assert body == b'{"a": 1}'


def test_it_works_on_uvloop_as_in_the_service_and_ray_actors() -> None:
    """uvloop's transports do not derive from asyncio.Transport: an inline job runs on the
    service's uvloop, a Ray actor on Ray's."""
    import uvloop

    async def main() -> tuple[int, bytes]:
        server = Server(lambda request: answer(b'{"ok": true}'))
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/generate"
        transport = Http11Transport(timeout_s=10.0)
        try:
            reply = await transport.post(url, b"{}", {"content-type": "application/json"})
        finally:
            await transport.aclose()
            listening.close()
        return reply.status, reply.body

    assert uvloop.run(main()) == (200, b'{"ok": true}')


async def test_a_connection_the_server_closes_is_not_reused(
    serve: Callable[[Server], Awaitable[str]],
) -> None:
    server = Server(lambda request: answer(b"{}", "connection: close"))
    url = await serve(server)
    transport = Http11Transport()
    try:
        for _ in range(3):
            assert (await transport.post(url, b"{}", {})).status == 200
    finally:
        await transport.aclose()
    assert server.connections == 3


async def test_chunked_and_gzip_answers_are_read(serve: Callable[[Server], Awaitable[str]]) -> None:
    packed = gzip.compress(b'{"text": "' + b"x" * 5000 + b'"}')
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in (packed[:100], packed[100:]))
        + b"0\r\n\r\n"
    )
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-encoding: gzip\r\n\r\n" + chunked
    url = await serve(Server(lambda request: reply))
    transport = Http11Transport()
    try:
        assert (await transport.post(url, b"{}", {})).body == b'{"text": "' + b"x" * 5000 + b'"}'
    finally:
        await transport.aclose()


async def test_an_answer_cut_off_is_a_read_error_and_the_next_request_reconnects(
    serve: Callable[[Server], Awaitable[str]],
) -> None:
    replies = iter([b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\nconnection: close\r\n\r\n{"])
    server = Server(lambda request: next(replies, answer(b"{}")))
    url = await serve(server)
    transport = Http11Transport()
    try:
        with pytest.raises(Unreachable) as raised:
            await transport.post(url, b"{}", {})
        assert (raised.value.kind, raised.value.connect) == ("ReadError", False)
        assert (await transport.post(url, b"{}", {})).status == 200
    finally:
        await transport.aclose()
    assert server.connections == 2


async def test_no_answer_in_time_is_a_read_timeout(serve: Callable[[Server], Awaitable[str]]) -> None:
    url = await serve(Server(lambda request: answer(b"{}"), delay_s=1.0))
    transport = Http11Transport(timeout_s=0.1)
    try:
        with pytest.raises(Unreachable) as raised:
            await transport.post(url, b"{}", {})
        assert raised.value.kind == "ReadTimeout"
    finally:
        await transport.aclose()


async def test_a_refused_connection_is_a_connect_error() -> None:
    transport = Http11Transport()
    listening = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    listening.close()
    await listening.wait_closed()
    try:
        with pytest.raises(Unreachable) as raised:
            await transport.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {})
        assert (raised.value.kind, raised.value.connect) == ("ConnectError", True)
    finally:
        await transport.aclose()


async def test_at_most_max_connections_requests_at_once(serve: Callable[[Server], Awaitable[str]]) -> None:
    server = Server(lambda request: answer(b"{}"), delay_s=0.05)
    url = await serve(server)
    transport = Http11Transport(max_connections=3)
    try:
        replies = await asyncio.gather(*(transport.post(url, b"{}", {}) for _ in range(12)))
    finally:
        await transport.aclose()
    assert [reply.status for reply in replies] == [200] * 12
    assert server.most_in_progress == 3
    assert server.connections == 3


async def test_a_health_check_is_a_get_of_the_status(serve: Callable[[Server], Awaitable[str]]) -> None:
    server = Server(lambda request: answer(b"", status="503 Service Unavailable"))
    url = await serve(server)
    transport = Http11Transport()
    try:
        assert await transport.get(url.replace("/v1/chat/completions", "/health"), 1.0) == 503
    finally:
        await transport.aclose()
    assert server.requests[0].startswith(b"GET /health HTTP/1.1\r\n")


async def test_a_header_with_a_line_break_is_refused(serve: Callable[[Server], Awaitable[str]]) -> None:
    url = await serve(Server(lambda request: answer(b"{}")))
    transport = Http11Transport()
    try:
        with pytest.raises(ValueError, match="line break"):
            await transport.post(url, b"{}", {"authorization": "Bearer x\r\nx-evil: 1"})
    finally:
        await transport.aclose()


def test_a_worker_talking_to_http_engines_does_not_import_aiohttp() -> None:
    """aiohttp is some 80 ms of a worker's start-up; only https engines (and the gateway) need it."""
    code = "import sys, buffer.workers.child, buffer.toolkit; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
