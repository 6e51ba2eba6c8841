"""The HTTP face of the simulator: ``create_sim_app(config)``.

Routes: ``POST /v1/chat/completions`` (both engines, ``chat.py``), ``POST /v1/completions``
(vLLM's, with a token-id prompt) and ``POST /generate`` (SGLang's native one), both in
``completions.py``; ``POST /update_weight_version``, ``GET /v1/models``, ``GET /health``,
``GET /stats``, ``POST /stats/reset``, ``GET``/``POST /outage`` (see ``outage.py``), and the
imitated engine's pause and weight-update controls (``control.py``: SGLang's, or vLLM's with
``--dev-mode``). Every generation request takes the
simulator's common path (``server.Simulator.serve``): faults, latency, counters.
"""

from __future__ import annotations

import logging
import time

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from buffer.simulator.chat import prepare_chat
from buffer.simulator.completions import prepare_completion, prepare_generate
from buffer.simulator.config import SimConfig
from buffer.simulator.control import install_control
from buffer.simulator.front import FastRoute, SimApp
from buffer.simulator.model import SimModel
from buffer.simulator.outage import OutageRequest
from buffer.simulator.protocol import ChatRequest, CompletionRequest, GenerateRequest, error_body
from buffer.simulator.server import Simulator, json_response, load_model

logger = logging.getLogger(__name__)


class WeightVersionRequest(BaseModel):
    new_version: str


def create_sim_app(config: SimConfig | None = None, model: SimModel | None = None) -> SimApp:
    """A simulator app; all its state (model, generator, counters) lives in this call, none in the module."""
    config = config or SimConfig()
    sim = Simulator(config, model or load_model(config))
    stats, outage = sim.stats, sim.outage
    created = int(time.time())
    app = SimApp(title="simulated OpenAI-compatible LLM server")
    app.state.config = config
    app.state.stats = stats
    app.state.outage = outage
    app.state.simulator = sim
    install_control(app, sim, sim.dialect.name, config.dev_mode)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        model = {
            "id": config.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": sim.dialect.name,
        }
        return json_response({"object": "list", "data": [model]})

    @app.get("/stats")
    async def get_stats() -> Response:
        return json_response(stats.snapshot())

    @app.post("/stats/reset")
    async def reset_stats() -> Response:
        stats.reset()
        return json_response(stats.snapshot())

    @app.get("/outage")
    async def get_outage() -> Response:
        return json_response(outage.snapshot())

    @app.post("/outage")
    async def start_outage(body: OutageRequest) -> Response:
        outage.start(body.seconds, body.mode)
        if body.seconds:
            logger.warning("outage: generation requests fail (%s) for %.1f s", body.mode, body.seconds)
        else:
            logger.warning("outage: ended")
        return json_response(outage.snapshot())

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionRequest) -> Response:
        """SGLang's: the version reported from now on (``meta_info``, ``metadata``)."""
        sim.weight_version = body.new_version
        message = f"Weight version updated to {body.new_version}"
        return json_response({"success": True, "message": message, "new_version": body.new_version})

    async def chat_completions(request: ChatRequest) -> Response:
        refused = sim.unknown_model(request.model)
        if refused is not None:
            return refused
        return await sim.serve(
            lambda rng: prepare_chat(sim, request, rng), request, request.seed, request.stream
        )

    async def completions(request: CompletionRequest) -> Response:
        refused = sim.unknown_model(request.model)
        if refused is not None:
            return refused
        return await sim.serve(
            lambda rng: prepare_completion(sim, request, rng), request, request.seed, request.stream
        )

    async def generate_route(request: GenerateRequest) -> Response:
        seed = request.sampling_params.get("sampling_seed", request.sampling_params.get("seed"))
        return await sim.serve(
            lambda rng: prepare_generate(sim, request, rng),
            request,
            int(seed) if seed is not None else None,
            request.stream,
        )

    # FastAPI's routes answer what the front passes on (see front.py), and document the API.
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    app.post("/generate")(generate_route)
    app.fast_routes.update(
        {
            "/v1/chat/completions": FastRoute(ChatRequest, chat_completions),
            "/v1/completions": FastRoute(CompletionRequest, completions),
            "/generate": FastRoute(GenerateRequest, generate_route),
        }
    )

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'][1:]) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        if request.url.path == "/generate":
            stats.requests += 1
            stats.by_status[400] += 1
            return json_response({"error": {"message": problems}}, 400)
        if request.url.path.startswith("/v1/"):  # the counters are those of the generation routes
            stats.requests += 1
            return sim.error(400, problems, sim.dialect.invalid_request_type)
        return json_response(error_body(problems, "invalid_request_error"), 400)

    app.add_exception_handler(RequestValidationError, validation_error)
    return app
