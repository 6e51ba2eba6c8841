"""The engines' weight-update controls, simulated: pause and resume, update weights from disk.

Each engine's routes, served only where the imitated engine serves them (a 404 for the other's):

- SGLang: ``POST /pause_generation {"mode": "abort" | "in_place" | "retract"}``: requests
  arriving while paused wait for ``POST /continue_generation``; with ``abort`` (SGLang's
  default) every request in flight is answered at once with ``finish_reason: "abort"`` and the
  tokens it had so far, as SGLang aborts them. ``POST /update_weights_from_disk {"model_path",
  "weight_version"?, "abort_all_requests"?}``: the reported weight version becomes the one
  given, else the next integer; ``GET /get_weight_version`` answers it.
- vLLM (0.32, only with ``VLLM_SERVER_DEV_MODE=1``: ``--dev-mode`` here;
  ``entrypoints/rl/online/api_router.py``): ``POST /pause?mode=abort|wait|keep`` (``abort`` by
  default; ``wait`` answers once what is in flight has finished; ``keep`` freezes it) answers
  ``{"status": "paused"}``, ``POST /resume`` ``{"status": "resumed"}``, ``GET /is_paused``
  ``{"is_paused": ...}``. Requests arriving while paused wait for the resume, as vLLM's
  scheduler holds them.

``GET /control`` (the simulator's own) answers the pause state and counters.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, TypeVar

from fastapi import FastAPI, Query
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

_A = TypeVar("_A")


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    mode: str = "abort"


class UpdateWeightsBody(BaseModel):
    # SGLang's field is model_path: pydantic before 2.10 reserves model_ for itself and warns.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model_path: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


@dataclass(slots=True)
class Control:
    """The simulator's pause state; the weight version is the simulator's own."""

    paused: bool = False
    pauses: int = 0
    aborted: int = 0
    #: True while an aborted request's answer is composed again, cut short (``recompose``).
    aborting: bool = False
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)
    #: The requests sleeping through their latency: each future is set True if a pause aborts it.
    _sleeping: set[asyncio.Future[bool]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._resumed.set()

    def pause(self, mode: str) -> None:
        self.paused = True
        self.pauses += 1
        self._resumed.clear()
        if mode == "abort":
            self.abort_all()

    async def drained(self) -> None:
        """Wait until no request is in flight (its latency slept through)."""
        while self._sleeping:
            await asyncio.gather(*list(self._sleeping), return_exceptions=True)

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    def abort_all(self) -> None:
        for sleeping in self._sleeping:
            if not sleeping.done():
                sleeping.set_result(True)
        self._sleeping.clear()

    async def hold(self) -> None:
        """Wait while paused."""
        if not self.paused:
            return
        await self._resumed.wait()

    async def sleep(self, seconds: float) -> bool:
        """Sleep through a request's latency; True if a pause aborted it first.

        One future and one timer a request (no task, no ``asyncio.wait``): thousands sleep at once."""
        loop = asyncio.get_running_loop()
        sleeping: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(seconds, _wake, sleeping)
        self._sleeping.add(sleeping)
        try:
            aborted = await sleeping
        finally:
            timer.cancel()
            self._sleeping.discard(sleeping)
        if aborted:
            self.aborted += 1
        return aborted

    def recompose(self, prepare: Callable[[random.Random], _A], rng: random.Random) -> _A:
        """The answer again, every choice aborted part way (its tokens so far)."""
        self.aborting = True
        try:
            return prepare(rng)
        finally:
            self.aborting = False

    def snapshot(self) -> dict[str, Any]:
        return {"paused": self.paused, "pauses": self.pauses, "aborted": self.aborted}


def _wake(sleeping: asyncio.Future[bool]) -> None:
    if not sleeping.done():
        sleeping.set_result(False)


class Controlled(Protocol):
    """What the control routes act on (the simulator, ``server.Simulator``): its pause state
    and the weight version it reports."""

    control: Control
    weight_version: str


def install_control(app: FastAPI, sim: Controlled, engine: str, dev_mode: bool = False) -> None:
    """Add the control routes of ``engine`` to the simulator ``app`` (vLLM's with ``dev_mode``)."""
    control = sim.control

    @app.get("/control")
    async def get_control() -> Response:
        return JSONResponse({**control.snapshot(), "weight_version": sim.weight_version})

    if engine == "sglang":
        _sglang_routes(app, sim)
    elif engine == "vllm" and dev_mode:
        _vllm_routes(app, sim)


def _vllm_routes(app: FastAPI, sim: Controlled) -> None:
    control = sim.control

    @app.post("/pause")
    async def pause(
        mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
        clear_cache: Annotated[bool, Query()] = True,
    ) -> Response:
        control.pause("abort" if mode == "abort" else "hold")
        if mode == "wait":
            await control.drained()
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        control.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return JSONResponse({"is_paused": control.paused})


def _sglang_routes(app: FastAPI, sim: Controlled) -> None:
    control = sim.control

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> Response:
        control.pause((body or PauseBody()).mode)
        return JSONResponse({"success": True, "message": "Generation paused"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        control.resume()
        return JSONResponse({"success": True, "message": "Generation continued"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody) -> Response:
        if body.abort_all_requests:
            control.abort_all()
        current = str(sim.weight_version)
        new = body.weight_version or (str(int(current) + 1) if current.isdigit() else "1")
        sim.weight_version = new
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": sim.weight_version})
