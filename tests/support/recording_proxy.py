"""A reverse proxy that records what a real engine received and answered: the ground truth the
real-engine tests check every sample against.

Run in a thread of the test process in front of the engine (``RecordingProxy.serving``); every
request is forwarded as it came, and every JSON exchange (or streamed one, its events joined) is
kept with its path and status. Nothing is interpreted here: the tests read the recording with
the engine's own field names.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from buffer.processes import free_port

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass
class Exchange:
    path: str
    request: dict[str, Any] | None
    status: int
    answer: dict[str, Any] | None = None
    #: A streamed answer: its ``data:`` events, decoded, in order.
    events: list[dict[str, Any]] = field(default_factory=list)


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])

    def recorded(self, path: str) -> list[Exchange]:
        with self._lock:
            return [exchange for exchange in self.exchanges if exchange.path == path]

    def _keep(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            sent = json.loads(body) if body else None
        except ValueError:
            sent = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        path = request.url.path
        url = self.upstream + path + (f"?{request.url.query}" if request.url.query else "")
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False)
        upstream = await client.send(
            client.build_request(request.method, url, content=body, headers=headers), stream=True
        )
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            exchange = Exchange(path, sent, upstream.status_code)

            async def relay() -> Any:
                pending = b""
                try:
                    async for chunk in upstream.aiter_raw():
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            data = line.strip()
                            if data.startswith(b"data:") and data[5:].strip() != b"[DONE]":
                                with contextlib.suppress(ValueError):
                                    exchange.events.append(json.loads(data[5:]))
                        yield chunk
                finally:
                    await upstream.aclose()
                    await client.aclose()
                    self._keep(exchange)

            return StreamingResponse(
                relay(), status_code=upstream.status_code, media_type="text/event-stream"
            )
        content = await upstream.aread()
        await upstream.aclose()
        await client.aclose()
        try:
            answer = json.loads(content) if content else None
        except ValueError:
            answer = None
        self._keep(Exchange(path, sent, upstream.status_code, answer if isinstance(answer, dict) else None))
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(content, status_code=upstream.status_code, headers=kept)

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        """Serve on a free loopback port in a thread for the block; yields the proxy's URL."""
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="recording-proxy", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
