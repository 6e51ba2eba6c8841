"""The HTTP face of the simulator: ``create_sim_app(config)`` and its counters.

Routes: ``POST /v1/chat/completions`` (non-streaming), ``GET /v1/models``, ``GET /health``,
``GET /stats``, ``POST /stats/reset``, and ``GET``/``POST /outage`` (see ``outage.py``).

Randomness. Faults (429, 500/503, aborts) and latency come from the server's generator, seeded by
``--seed``, so a retried request is not doomed to repeat its fault. The reply itself (the text, a
wrong answer, a tool call's id, logprobs) comes from that generator too, unless the request sets
``seed``: then from a generator seeded by ``--seed``, the request's ``seed`` and the rest of the
request, so the same request with the same seed gets the same reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response

from buffer.simulator.config import SimConfig
from buffer.simulator.control import install_control
from buffer.simulator.outage import DroppedConnection, Outage, OutageRequest
from buffer.simulator.protocol import ChatRequest, error_body
from buffer.simulator.replies import Choice, complete, count_prompt_tokens, fake_logprobs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SimStats:
    """Counters of ``/v1/chat/completions``: what came in, how it ended, how much ran at once."""

    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    dropped: int = 0  # connections dropped by an outage in "reset" mode
    by_finish_reason: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def enter(self) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def reset(self) -> None:
        """Zero every counter; requests still running are still counted in flight."""
        self.requests = self.prompt_tokens = self.completion_tokens = self.dropped = 0
        self.max_in_flight = self.in_flight
        self.by_status.clear()
        self.by_finish_reason.clear()

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "by_status": {str(status): count for status, count in sorted(self.by_status.items())},
            "dropped": self.dropped,
            "by_finish_reason": dict(sorted(self.by_finish_reason.items())),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code, headers, media_type="application/json")


def create_sim_app(config: SimConfig | None = None) -> FastAPI:
    """A simulator app; all its state (generator, counters) lives in this call, none in the module."""
    config = config or SimConfig()
    server_rng = random.Random(config.seed)
    stats = SimStats()
    outage = Outage()
    created = int(time.time())
    app = FastAPI(title="simulated OpenAI-compatible LLM server")
    app.state.config = config
    app.state.stats = stats
    app.state.outage = outage
    control = install_control(app, json_response)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        model = {
            "id": config.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "simulator",
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
            logger.warning("outage: chat completions fail (%s) for %.1f s", body.mode, body.seconds)
        else:
            logger.warning("outage: ended")
        return json_response(outage.snapshot())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest) -> Response:
        stats.enter()
        try:
            answer = (
                None
                if outage.active
                else await control.run(_answer(request, config, server_rng, stats), config.served_model_name)
            )
        finally:
            stats.in_flight -= 1
        if answer is None or outage.active:  # down when it came, or went down while it waited
            return outage_response()
        status, body, headers = answer
        stats.by_status[status] += 1
        return json_response(body, status, headers)

    def outage_response() -> Response:
        if outage.mode == "reset":
            stats.dropped += 1
            return DroppedConnection()
        stats.by_status[503] += 1
        return json_response(error_body("simulated outage: the server is unavailable", "server_error"), 503)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'][1:]) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        if request.url.path.startswith("/v1/"):  # the counters are those of the OpenAI routes
            stats.requests += 1
            stats.by_status[400] += 1
        return json_response(error_body(problems, "invalid_request_error"), 400)

    app.add_exception_handler(RequestValidationError, validation_error)
    return app


async def _answer(
    request: ChatRequest, config: SimConfig, server_rng: random.Random, stats: SimStats
) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, body, headers) for one chat completion request, after its simulated latency.

    The latency is counted from here, so the time spent composing the reply is part of it."""
    started = time.monotonic()
    if request.stream:
        message = "stream=true is not supported by the simulator; send a non-streaming request"
        return 400, error_body(message, "invalid_request_error", param="stream"), None
    if server_rng.random() < config.rate_limit_rate:
        headers = {
            "Retry-After": str(math.ceil(config.retry_after_s)),
            "retry-after-ms": str(round(config.retry_after_s * 1000)),
        }
        return (
            429,
            error_body("simulated rate limit", "rate_limit_error", code="rate_limit_exceeded"),
            headers,
        )
    reply_rng = _reply_rng(request, config.seed) if request.seed is not None else server_rng
    choices = [
        complete(request, config.accuracy, config.abort_rate, reply_rng, server_rng) for _ in range(request.n)
    ]
    longest = max(len(choice.tokens) for choice in choices)
    latency_s = config.sample_latency_s(server_rng) + config.latency_per_token_s * longest
    await asyncio.sleep(max(0.0, latency_s - (time.monotonic() - started)))
    if server_rng.random() < config.error_rate:
        status = server_rng.choice((500, 503))
        return status, error_body(f"simulated server error ({status})", "server_error"), None
    prompt_tokens = count_prompt_tokens(request.messages)
    completion_tokens = sum(len(choice.tokens) for choice in choices)
    stats.prompt_tokens += prompt_tokens
    stats.completion_tokens += completion_tokens
    stats.by_finish_reason.update(choice.finish_reason for choice in choices)
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": config.served_model_name,
        "choices": [_choice_body(index, choice, request, reply_rng) for index, choice in enumerate(choices)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return 200, body, None


def _choice_body(index: int, choice: Choice, request: ChatRequest, rng: random.Random) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_call is not None:
        call = choice.tool_call
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]
    logprobs = fake_logprobs(choice.tokens, request.top_logprobs or 0, rng) if request.logprobs else None
    return {"index": index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs}


def _reply_rng(request: ChatRequest, server_seed: int | None) -> random.Random:
    """A generator determined by ``--seed``, the request's ``seed`` and everything else it asks."""
    digest = hashlib.sha256(orjson.dumps(request.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS))
    return random.Random(f"{server_seed}:{request.seed}:{digest.hexdigest()}")
