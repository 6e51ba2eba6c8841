"""The simulated engine: its state, and the path every generation request takes.

``Simulator`` holds the model, the server's generator, the counters, the outage, the pause
state and the weight version. ``serve`` is the common path of the generation routes: a pause
holds the request, an outage fails it, a rate limit or a server error may, and it waits out its
latency; what it answers is composed by the route (``chat.py``, ``completions.py``) as an
``Answer``.

Randomness. Faults (429, 500/503, aborts) and latency come from the server's generator, seeded by
``--seed``, so a retried request is not doomed to repeat its fault. The reply itself (the text, a
wrong answer, a tool call's id, logprobs) comes from that generator too, unless the request sets
a seed (``seed``; ``sampling_params.sampling_seed`` on ``/generate``): then from a generator
seeded by ``--seed``, that seed and the rest of the request, so the same request with the same
seed gets the same reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from buffer.simulator.config import SimConfig
from buffer.simulator.control import Control
from buffer.simulator.engines import DIALECTS
from buffer.simulator.model import SimModel
from buffer.simulator.outage import DroppedConnection, Outage
from buffer.simulator.prompts import Prompts
from buffer.simulator.protocol import ChatRequest, error_body
from buffer.simulator.replies import Generation, Limits, ReplyPlan, generate
from buffer.simulator.sampling import SamplingFields
from buffer.simulator.shapes import new_id
from buffer.simulator.stats import SimStats
from buffer.simulator.streaming import Chunk, sse
from buffer.simulator.tokenizer import build_tokenizer, load_tokenizer


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code, headers, media_type="application/json")


def load_model(config: SimConfig) -> SimModel:
    """The tokenizer of ``--tokenizer-path``, else the default one built with ``--chat-template``."""
    if config.tokenizer_path:
        return SimModel(load_tokenizer(config.tokenizer_path))
    return SimModel(
        build_tokenizer(thinking=config.chat_template == "thinking"), config.chat_template == "thinking"
    )


@dataclass(slots=True)
class Answer:
    """A request's answer, composed before its latency: the choices, and how to send them."""

    prompt_tokens: int
    generations: list[Generation]
    body: Callable[[], dict[str, Any]]
    chunks: Callable[[], Iterator[Chunk]] | None = None  # set for stream=true


class Simulator:
    """The simulated engine: its model, generator, counters, outage and pause state."""

    def __init__(self, config: SimConfig, model: SimModel) -> None:
        self.config = config
        self.model = model
        #: Where the imitated engine puts what (``engines.py``).
        self.dialect = DIALECTS[config.engine]
        self.rng = random.Random(config.seed)
        self.stats = SimStats()
        self.outage = Outage()
        #: SGLang's pause, continue and weight updates (``buffer.simulator.control``).
        self.control = Control()
        self.weight_version = config.weight_version
        self.prompts = Prompts(model, self.dialect)

    # Errors

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> Response:
        """An error the engine itself would answer, in its shape."""
        self.stats.by_status[status] += 1
        return json_response(self.dialect.error_body(message, error_type, status, param), status)

    def down(self) -> bool:
        return self.outage.active

    def outage_response(self) -> Response:
        if self.outage.mode == "reset":
            self.stats.dropped += 1
            return DroppedConnection()
        self.stats.by_status[503] += 1
        return json_response(error_body("simulated outage: the server is unavailable", "server_error"), 503)

    def unknown_model(self, model: str) -> Response | None:
        """The answer to a model name the engine does not serve (vLLM's 404; SGLang serves any)."""
        if not self.dialect.refuses_model(model, self.config.served_model_name):
            return None
        self.stats.requests += 1
        return self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def bad_ids(self, prompt_ids: list[int]) -> str | None:
        """What is wrong with a token prompt (empty, or ids out of the vocabulary), or None."""
        if not prompt_ids:
            return "the prompt is empty"
        if min(prompt_ids) >= 0 and max(prompt_ids) < self.model.vocab_size:
            return None
        bad = [token for token in prompt_ids if not 0 <= token < self.model.vocab_size]
        return f"token ids out of the vocabulary (size {self.model.vocab_size}): {bad[:5]}"

    # Replies

    @property
    def abort_rate(self) -> float:
        """The configured rate; 1 while re-composing the answers a pause aborted."""
        return 1.0 if self.control.aborting else self.config.abort_rate

    def draft(
        self,
        plan: ReplyPlan,
        limits: Limits,
        reply_rng: random.Random,
        partial_ids: list[int] | None,
        partial_text: str | None,
        *,
        logprobs: bool,
        sampling: SamplingFields | None = None,
    ) -> Generation:
        """One reply of the simulated model to ``plan``, continuing ``partial_ids`` if given, with
        this server's accuracy, abort rate and fault generator; its logprobs as the engine reports
        them for a request with these ``sampling`` fields (``sampling.py``)."""
        generation = generate(
            self.model,
            plan,
            limits,
            self.config.accuracy,
            self.abort_rate,
            reply_rng,
            self.rng,
            partial_ids,
            partial_text,
            logprobs=logprobs,
            tool_error_rate=self.config.tool_error_rate,
        )
        if not generation.logprobs:
            return generation
        reported = self.dialect.reported_logprobs(
            generation.logprobs,
            sampling or SamplingFields(),
            self.model.vocab_size - 1,
            self.config.logprobs_mode,
        )
        return replace(generation, logprobs=reported)

    def head(self, id_prefix: str, kind: str) -> dict[str, Any]:
        """The fields an OpenAI answer (and each of its stream's chunks) starts with."""
        return {
            "id": new_id(id_prefix),
            "object": kind,
            "created": int(time.time()),
            "model": self.config.served_model_name,
        }

    # The common path: faults, latency, counters

    async def serve(
        self,
        prepare: Callable[[random.Random], Answer | Response],
        request: BaseModel,
        seed: int | None,
        stream: bool,
    ) -> Response:
        stats, config = self.stats, self.config
        stats.enter()
        streaming = False
        try:
            await self.control.hold()  # paused: a new request waits for the resume
            if self.down():
                return self.outage_response()
            started = time.monotonic()
            if self.rng.random() < config.rate_limit_rate:
                stats.by_status[429] += 1
                headers = {
                    "Retry-After": str(math.ceil(config.retry_after_s)),
                    "retry-after-ms": str(round(config.retry_after_s * 1000)),
                }
                body = error_body("simulated rate limit", "rate_limit_error", code="rate_limit_exceeded")
                return json_response(body, 429, headers)
            reply_rng = _reply_rng(request, config.seed, seed) if seed is not None else self.rng
            answer = prepare(reply_rng)
            if isinstance(answer, Response):
                return answer
            latency_s = self.latency_of(answer, stream)
            if await self.control.sleep(max(0.0, latency_s - (time.monotonic() - started))):
                answer = self.control.recompose(prepare, reply_rng)  # aborted by a pause
                if isinstance(answer, Response):
                    return answer
            if self.rng.random() < config.error_rate:
                status = self.rng.choice((500, 503))
                stats.by_status[status] += 1
                return json_response(error_body(f"simulated server error ({status})", "server_error"), status)
            if self.down():  # went down while it waited
                return self.outage_response()
            stats.by_status[200] += 1
            stats.prompt_tokens += answer.prompt_tokens
            stats.completion_tokens += sum(len(generation.ids) for generation in answer.generations)
            stats.by_finish_reason.update(generation.finish_reason for generation in answer.generations)
            if answer.chunks is None:
                return json_response(answer.body())
            streaming = True
            return StreamingResponse(self._stream(answer.chunks()), media_type="text/event-stream")
        finally:
            if not streaming:
                stats.in_flight -= 1

    def latency_of(self, answer: Answer, stream: bool) -> float:
        """How long ``answer`` takes: a sampled latency times the share of the reply it sampled
        (an engine spends its time per token: an aborted reply and its continuation take one
        reply's time), plus the per-token latency of its longest choice when not streamed."""
        config = self.config
        share = max((generation.share for generation in answer.generations), default=1.0)
        latency_s = config.sample_latency_s(self.rng) * share
        if not stream:
            longest = max((len(generation.ids) for generation in answer.generations), default=0)
            latency_s += config.latency_per_token_s * longest
        return latency_s

    async def _stream(self, chunks: Iterator[Chunk]) -> AsyncIterator[bytes]:
        try:
            for chunk, tokens in chunks:
                if tokens and self.config.latency_per_token_s:
                    await asyncio.sleep(self.config.latency_per_token_s * tokens)
                yield sse(chunk)
            yield sse("[DONE]")
        finally:
            self.stats.in_flight -= 1


def _reply_rng(request: BaseModel, server_seed: int | None, seed: int) -> random.Random:
    """A generator determined by ``--seed``, the request's seed and everything else it asks.

    On ``/generate`` and ``/v1/completions``, a request id and streaming are left out of it."""
    if isinstance(request, ChatRequest):
        identity = request.identity()
    else:  # a request id, or streaming, changes nothing of the reply
        identity = request.model_dump(mode="json", exclude={"rid", "request_id", "stream", "stream_options"})
    digest = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS))
    return random.Random(f"{server_seed}:{seed}:{digest.hexdigest()}")
