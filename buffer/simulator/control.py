"""SGLang's weight-update controls, simulated: pause, continue, update weights, weight version.

- ``POST /pause_generation {"mode": "abort" | "in_place" | "retract"}``: requests arriving
  while paused wait for ``/continue_generation``; with ``abort`` (SGLang's default) every
  request in flight is answered at once with ``finish_reason: "abort"`` and the tokens so far
  (none, here), as SGLang aborts them.
- ``POST /continue_generation``: requests go on.
- ``POST /update_weights_from_disk {"model_path", "weight_version"?}``: the weight version
  becomes the one given, else the next integer; ``abort_all_requests`` aborts what is in flight.
- Every chat completion reports ``metadata.weight_version`` (SGLang's field) as of its end;
  ``GET /get_weight_version`` answers it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

Answer = tuple[int, dict[str, Any], dict[str, str] | None]


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    mode: str = "abort"


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_path: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


@dataclass(slots=True)
class Control:
    """The simulator's pause state and weight version."""

    weight_version: str = "0"
    paused: bool = False
    aborted: int = 0
    pauses: int = 0
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)
    _abort: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._resumed.set()

    def pause(self, mode: str) -> None:
        self.paused = True
        self.pauses += 1
        self._resumed.clear()
        if mode == "abort":
            self.abort_all()

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    def abort_all(self) -> None:
        self._abort.set()
        self._abort = asyncio.Event()

    async def run(self, answer: Awaitable[Answer], model: str) -> Answer:
        """``answer`` once the server is not paused, or an abort if one comes first; stamped
        with the weight version."""
        await self._resumed.wait()
        abort = self._abort
        work = asyncio.ensure_future(answer)
        aborted = asyncio.ensure_future(abort.wait())
        try:
            await asyncio.wait({work, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        if not work.done():
            work.cancel()
            self.aborted += 1
            return 200, self._aborted_body(model), None
        status, body, headers = work.result()
        if status == 200:
            body["metadata"] = {**body.get("metadata", {}), "weight_version": self.weight_version}
        return status, body, headers

    def _aborted_body(self, model: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": ""}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "abort", "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "metadata": {"weight_version": self.weight_version},
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "paused": self.paused,
            "pauses": self.pauses,
            "aborted": self.aborted,
        }


def install_control(app: FastAPI, json_response: Any) -> Control:
    """Add the control routes to the simulator ``app``; returns their state."""
    control = Control()
    app.state.control = control

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> Response:
        control.pause((body or PauseBody()).mode)
        response: Response = json_response({"success": True, "message": "Generation paused"})
        return response

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        control.resume()
        response: Response = json_response({"success": True, "message": "Generation continued"})
        return response

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody) -> Response:
        if body.abort_all_requests:
            control.abort_all()
        if body.weight_version is not None:
            control.weight_version = body.weight_version
        else:
            current = control.weight_version
            control.weight_version = str(int(current) + 1) if current.isdigit() else "1"
        response: Response = json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )
        return response

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        response: Response = json_response({"weight_version": control.weight_version})
        return response

    @app.get("/control")
    async def get_control() -> Response:
        response: Response = json_response(control.snapshot())
        return response

    return control
