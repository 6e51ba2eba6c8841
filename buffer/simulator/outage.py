"""An outage started at run time: for a while, every chat completion request fails.

``POST /outage {"seconds": 10, "mode": "503"}`` starts one (or replaces the one under way);
``{"seconds": 0}`` ends it; ``GET /outage`` tells whether one is under way and for how long.
During an outage a request fails as it arrives, and so does one that was waiting out its
latency when the outage began, as with a server that goes down under load:

- ``"503"``: an immediate HTTP 503 with OpenAI's error body, as from an overloaded server or a
  gateway whose backend is down;
- ``"reset"``: the connection is dropped: the status line and headers go out, then the
  connection closes before the body, as when the server process dies mid-answer. (An ASGI app
  cannot refuse a connection; this is the closest a client can tell from it.) It takes a real
  server: in process, through ``httpx.ASGITransport``, it reads as a 200 with an empty body.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

OutageMode = Literal["503", "reset"]


class OutageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(ge=0, le=24 * 3600, description="how long it lasts from now; 0 ends it")
    mode: OutageMode = Field(
        default="503", description='"503": HTTP 503 answers; "reset": dropped connections'
    )


class Outage:
    """When the outage under way ends, and how requests fail until then."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until = 0.0
        self.mode: OutageMode = "503"

    def start(self, seconds: float, mode: OutageMode) -> None:
        self._until = self._clock() + seconds
        self.mode = mode

    @property
    def remaining_s(self) -> float:
        return max(0.0, self._until - self._clock())

    @property
    def active(self) -> bool:
        return self._clock() < self._until

    def snapshot(self) -> dict[str, object]:
        remaining_s = self.remaining_s
        return {
            "active": remaining_s > 0,
            "mode": self.mode if remaining_s > 0 else None,
            "remaining_s": round(remaining_s, 3),
        }


class DroppedConnection(Response):
    """A response that starts and never finishes: uvicorn closes the connection after it."""

    def __init__(self) -> None:
        super().__init__(status_code=200, media_type="application/json")
        self.headers["content-length"] = "1024"  # promised, never sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})


class QuietDroppedConnections(logging.Filter):
    """Drops uvicorn's error line for a response left unfinished: here, only an outage's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing response."
