"""The HTTP face of the simulator: ``create_sim_app(config)`` and its counters.

Routes: ``POST /v1/chat/completions`` (both engines), ``POST /v1/completions`` (vLLM's, with a
token-id prompt), ``POST /generate`` (SGLang's native one), ``POST /update_weight_version``,
``GET /v1/models``, ``GET /health``, ``GET /stats``, ``POST /stats/reset``, and ``GET``/``POST
/outage`` (see ``outage.py``). ``engines.py`` holds the answer shapes, ``streaming.py`` the chunks.

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
import logging
import math
import random
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from buffer.simulator.config import SimConfig
from buffer.simulator.control import Control, install_control
from buffer.simulator.conversation import SimMessage, parse_output, parse_prompt
from buffer.simulator.engines import (
    ChatChoice,
    chat_logprobs,
    completion_logprobs,
    message_body,
    meta_info,
    new_call_ids,
    new_id,
    output_text,
    stop_reason,
    usage,
)
from buffer.simulator.front import FastRoute, SimApp
from buffer.simulator.model import RENDER_CACHE_SIZE, OpenReply, SimModel, remember
from buffer.simulator.outage import DroppedConnection, Outage, OutageRequest
from buffer.simulator.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    flat_error_body,
    stop_strings,
)
from buffer.simulator.replies import Generation, Limits, ReplyPlan, generate, plan_reply
from buffer.simulator.streaming import Chunk, chat_chunks, completion_chunks, generate_chunks, sse
from buffer.simulator.tokenizer import build_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SimStats:
    """Counters of the generation routes: what came in, how it ended, how much ran at once."""

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


class WeightVersionRequest(BaseModel):
    new_version: str


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


@dataclass(frozen=True, slots=True)
class _TokenPrompt:
    plan: ReplyPlan
    partial_ids: list[int] | None
    partial_text: str | None


@dataclass(frozen=True, slots=True)
class _ChatPrompt:
    """A chat request's prompt as the model reads it: its ids, the replies it may get, the
    assistant reply it ends in (``continue_final_message``), whether the model reasons first."""

    ids: array[int]
    plan: ReplyPlan
    open_reply: OpenReply | None
    thinking: bool


class Simulator:
    """The simulated engine: its model, generator, counters and outage, and one method per route."""

    def __init__(self, config: SimConfig, model: SimModel) -> None:
        self.config = config
        self.model = model
        self.engine = config.engine
        self.rng = random.Random(config.seed)
        self.stats = SimStats()
        self.outage = Outage()
        #: SGLang's pause, continue and weight updates (``buffer.simulator.control``).
        self.control = Control()
        self.weight_version = config.weight_version
        # A group's samples send the same prompt: read once (the oldest dropped first).
        self._chat_prompts: dict[bytes, _ChatPrompt] = {}
        self._token_prompts: dict[bytes, _TokenPrompt] = {}

    # Errors

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> Response:
        """An error the engine itself would answer: SGLang's flat body, vLLM's nested one."""
        self.stats.by_status[status] += 1
        if self.engine == "sglang":
            return json_response(flat_error_body(message, error_type, status, param), status)
        return json_response(
            {"error": {"message": message, "type": error_type, "param": param, "code": status}}, status
        )

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
    ) -> Generation:
        """One reply of the simulated model to ``plan``, continuing ``partial_ids`` if given, with
        this server's accuracy, abort rate and fault generator."""
        return generate(
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
        )

    def down(self) -> bool:
        return self.outage.active

    def outage_response(self) -> Response:
        if self.outage.mode == "reset":
            self.stats.dropped += 1
            return DroppedConnection()
        self.stats.by_status[503] += 1
        return json_response(error_body("simulated outage: the server is unavailable", "server_error"), 503)

    def unknown_model(self, model: str) -> Response | None:
        """vLLM answers a model name it does not serve with a 404; SGLang serves any name."""
        if self.engine != "vllm" or not model or model == self.config.served_model_name:
            return None
        self.stats.requests += 1
        return self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

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
            await self.control.hold()  # paused: a new request waits for /continue_generation
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

    def head(self, id_prefix: str, kind: str) -> dict[str, Any]:
        """The fields an OpenAI answer (and each of its stream's chunks) starts with."""
        return {
            "id": new_id(id_prefix),
            "object": kind,
            "created": int(time.time()),
            "model": self.config.served_model_name,
        }

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

    # POST /v1/chat/completions

    def prepare_chat(self, request: ChatRequest, reply_rng: random.Random) -> Answer | Response:
        model, engine = self.model, self.engine
        started = time.monotonic()
        if (
            engine == "sglang"
            and request.stream
            and (request.return_prompt_token_ids or request.return_token_ids or request.return_meta_info)
        ):
            message = (
                "return_prompt_token_ids, return_token_ids and return_meta_info are not supported with stream"
            )
            return self.error(400, message, "BadRequestError")
        if engine == "vllm" and request.continue_final_message and request.add_generation_prompt:
            message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            return self.error(400, message, "BadRequestError")
        key = _chat_prompt_key(request)
        prompt = self._chat_prompts.get(key) if key is not None else None
        if prompt is None:
            try:
                prompt = self.chat_prompt(request)
            except ValueError as exc:
                return self.error(400, str(exc), "BadRequestError", "messages")
            if key is not None:
                remember(self._chat_prompts, key, prompt, RENDER_CACHE_SIZE)
        prompt_ids, plan, open_reply = list(prompt.ids), prompt.plan, prompt.open_reply
        thinking = prompt.thinking
        limits = Limits(request.token_limit, stop_strings(request.stop), tuple(request.stop_token_ids or ()))
        choices = []
        for _ in range(request.n):
            generation = self.draft(
                plan,
                limits,
                reply_rng,
                open_reply.ids if open_reply else None,
                open_reply.text if open_reply else None,
                logprobs=request.logprobs,
            )
            raw = output_text(model, generation, skip_special_tokens=True, keep_stop=False)
            output = parse_output(raw, thinking and raw.startswith("<think>"))
            if open_reply and open_reply.text and not output.tool_calls:
                # A tool call continued from an aborted text: read the reply as a whole.
                whole = parse_output(open_reply.text + raw, thinking)
                if whole.tool_calls:
                    output = whole
            choices.append(ChatChoice(generation, output, new_call_ids(output, reply_rng)))
        head = self.head("chatcmpl", "chat.completion")

        def body() -> dict[str, Any]:
            return self.chat_body(request, head, prompt_ids, choices, started)

        chunks = None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            send_ids = prompt_ids if engine == "vllm" and request.return_token_ids else None

            def chunks() -> Iterator[Chunk]:
                return chat_chunks(
                    engine,
                    model,
                    head,
                    choices,
                    send_ids,
                    thinking,
                    request.logprobs,
                    include_usage,
                    len(prompt_ids),
                )

        return Answer(len(prompt_ids), [choice.generation for choice in choices], body, chunks)

    def chat_prompt(self, request: ChatRequest) -> _ChatPrompt:
        """The prompt of a chat request, rendered and read; ``ValueError`` if it cannot be rendered."""
        model = self.model
        continuing = request.continue_final_message and request.messages[-1].role == "assistant"
        tools = request.tools or []
        template_kwargs = request.chat_template_kwargs or {}
        prompt_ids = model.render(
            [_template_message(message) for message in request.messages], tools, continuing, template_kwargs
        )
        thinking = model.thinking and template_kwargs.get("enable_thinking", True) is not False
        history = request.messages[:-1] if continuing else request.messages
        plan = plan_reply(
            [SimMessage(m.role, m.text()) for m in history], tools, request.tool_choice, thinking
        )
        open_reply = model.open_reply(prompt_ids) if continuing else None
        return _ChatPrompt(array("i", prompt_ids), plan, open_reply, thinking)

    def chat_body(
        self,
        request: ChatRequest,
        head: dict[str, Any],
        prompt_ids: list[int],
        choices: list[ChatChoice],
        started: float,
    ) -> dict[str, Any]:
        model, engine = self.model, self.engine
        bodies = []
        for index, choice in enumerate(choices):
            generation = choice.generation
            logprobs = (
                chat_logprobs(model, generation.ids, generation.logprobs, request.top_logprobs or 0)
                if request.logprobs
                else None
            )
            body: dict[str, Any] = {
                "index": index,
                "message": message_body(engine, choice),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
            if engine == "vllm":
                body["stop_reason"] = stop_reason(generation, model.eos_id)
                if request.return_token_ids:
                    body["token_ids"] = generation.ids
            else:
                body["matched_stop"] = generation.matched_stop
                if request.return_prompt_token_ids:
                    body["prompt_token_ids"] = prompt_ids
                if request.return_token_ids:
                    body["token_ids"] = generation.ids
                if request.return_meta_info:
                    body["meta_info"] = meta_info(
                        generation, len(prompt_ids), self.weight_version, request.logprobs, started
                    )
            bodies.append(body)
        completion_tokens = sum(len(choice.generation.ids) for choice in choices)
        answer = {**head, "choices": bodies, "usage": usage(len(prompt_ids), completion_tokens)}
        if engine == "vllm" and request.return_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        if engine == "sglang":
            answer["metadata"] = {"weight_version": self.weight_version}
        return answer

    # Token prompts: POST /v1/completions and POST /generate

    def token_prompt(self, prompt_ids: list[int]) -> _TokenPrompt:
        """The reply plan for a rendered prompt, recovered from its text, and the reply it continues."""
        key = array("i", prompt_ids).tobytes()  # ids checked by bad_ids first
        cached = self._token_prompts.get(key)
        if cached is not None:
            return cached
        model = self.model
        conversation = parse_prompt(model.decode(prompt_ids, skip_special_tokens=False))
        open_reply = model.open_reply(prompt_ids)
        thinking = model.thinking and not (open_reply is not None and open_reply.thinking_off)
        plan = plan_reply(conversation.messages, conversation.tools, "auto", thinking)
        if open_reply is None:
            prompt = _TokenPrompt(plan, None, None)
        else:
            prompt = _TokenPrompt(plan, open_reply.ids, open_reply.text)
        return remember(self._token_prompts, key, prompt, RENDER_CACHE_SIZE)

    def bad_ids(self, prompt_ids: list[int]) -> str | None:
        if not prompt_ids:
            return "the prompt is empty"
        if min(prompt_ids) >= 0 and max(prompt_ids) < self.model.vocab_size:
            return None
        bad = [token for token in prompt_ids if not 0 <= token < self.model.vocab_size]
        return f"token ids out of the vocabulary (size {self.model.vocab_size}): {bad[:5]}"

    def prepare_completion(self, request: CompletionRequest, reply_rng: random.Random) -> Answer | Response:
        model = self.model
        prompt_ids = request.prompt if isinstance(request.prompt, list) else model.encode(request.prompt)
        problem = self.bad_ids(prompt_ids)
        if problem:
            return self.error(400, problem, "BadRequestError", "prompt")
        prompt = self.token_prompt(prompt_ids)
        limits = Limits(request.max_tokens, stop_strings(request.stop), tuple(request.stop_token_ids or ()))
        generations = [
            self.draft(
                prompt.plan,
                limits,
                reply_rng,
                prompt.partial_ids,
                prompt.partial_text,
                logprobs=request.logprobs is not None,
            )
            for _ in range(request.n)
        ]
        texts = [
            output_text(model, generation, request.skip_special_tokens, request.include_stop_str_in_output)
            for generation in generations
        ]
        head = self.head("cmpl", "text_completion")

        def body() -> dict[str, Any]:
            choices = []
            for index, (generation, text) in enumerate(zip(generations, texts, strict=True)):
                choice: dict[str, Any] = {
                    "index": index,
                    "text": text,
                    "logprobs": completion_logprobs(model, generation)
                    if request.logprobs is not None
                    else None,
                    "finish_reason": generation.finish_reason,
                    "stop_reason": stop_reason(generation, model.eos_id),
                }
                if request.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                    choice["token_ids"] = generation.ids
                choices.append(choice)
            completion_tokens = sum(len(generation.ids) for generation in generations)
            return {**head, "choices": choices, "usage": usage(len(prompt_ids), completion_tokens)}

        chunks = None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)

            def chunks() -> Iterator[Chunk]:
                return completion_chunks(
                    model,
                    head,
                    generations,
                    texts,
                    prompt_ids if request.return_token_ids else None,
                    request.logprobs is not None,
                    request.skip_special_tokens,
                    include_usage,
                    len(prompt_ids),
                )

        return Answer(len(prompt_ids), generations, body, chunks)

    def prepare_generate(self, request: GenerateRequest, reply_rng: random.Random) -> Answer | Response:
        model = self.model
        started = time.monotonic()
        if request.input_ids is not None:
            prompt_ids = request.input_ids
        elif request.text is not None:
            prompt_ids = model.encode(request.text)
        else:
            prompt_ids = []
        problem = self.bad_ids(prompt_ids)
        if problem:
            self.stats.by_status[400] += 1
            return json_response({"error": {"message": problem}}, 400)
        params = request.sampling_params
        max_new_tokens = params.get("max_new_tokens", 128)
        limits = Limits(
            int(max_new_tokens) if max_new_tokens is not None else None,
            stop_strings(params.get("stop")),
            tuple(params.get("stop_token_ids") or ()),
        )
        prompt = self.token_prompt(prompt_ids)
        generation = self.draft(
            prompt.plan,
            limits,
            reply_rng,
            prompt.partial_ids,
            prompt.partial_text,
            logprobs=request.return_logprob,
        )
        skip_special_tokens = bool(params.get("skip_special_tokens", True))
        text = output_text(model, generation, skip_special_tokens, keep_stop=bool(params.get("no_stop_trim")))

        def body() -> dict[str, Any]:
            info = meta_info(
                generation, len(prompt_ids), self.weight_version, request.return_logprob, started
            )
            return {"text": text, "output_ids": generation.ids, "meta_info": info}

        chunks = None
        if request.stream:

            def chunks() -> Iterator[Chunk]:
                return generate_chunks(
                    model,
                    generation,
                    text,
                    skip_special_tokens,
                    len(prompt_ids),
                    self.weight_version,
                    request.return_logprob,
                    started,
                )

        return Answer(len(prompt_ids), [generation], body, chunks)


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
    install_control(app, sim)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        owner = "vllm" if config.engine == "vllm" else "sglang"
        model = {"id": config.served_model_name, "object": "model", "created": created, "owned_by": owner}
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
            lambda rng: sim.prepare_chat(request, rng), request, request.seed, request.stream
        )

    async def completions(request: CompletionRequest) -> Response:
        refused = sim.unknown_model(request.model)
        if refused is not None:
            return refused
        return await sim.serve(
            lambda rng: sim.prepare_completion(request, rng), request, request.seed, request.stream
        )

    async def generate_route(request: GenerateRequest) -> Response:
        seed = request.sampling_params.get("sampling_seed", request.sampling_params.get("seed"))
        return await sim.serve(
            lambda rng: sim.prepare_generate(request, rng),
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
            return sim.error(
                400, problems, "BadRequestError" if config.engine == "vllm" else "invalid_request_error"
            )
        return json_response(error_body(problems, "invalid_request_error"), 400)

    app.add_exception_handler(RequestValidationError, validation_error)
    return app


def _chat_prompt_key(request: ChatRequest) -> bytes | None:
    """What a chat request's prompt depends on, as bytes; None if it cannot be written as JSON."""
    messages = [
        (message.role, message.content, message.tool_calls, message.tool_call_id, message.model_extra)
        for message in request.messages
    ]
    key = [messages, request.tools, request.continue_final_message, request.chat_template_kwargs]
    try:
        return orjson.dumps([*key, request.tool_choice])
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, say
        return None


def _template_message(message: Any) -> dict[str, Any]:
    """A request message as the chat template reads it: text content, tool calls as sent."""
    rendered: dict[str, Any] = message.model_dump(exclude_none=True)
    rendered["content"] = message.text() if message.content is not None else None
    return rendered


def _reply_rng(request: BaseModel, server_seed: int | None, seed: int) -> random.Random:
    """A generator determined by ``--seed``, the request's seed and everything else it asks.

    On ``/generate`` and ``/v1/completions``, a request id and streaming are left out of it."""
    if isinstance(request, ChatRequest):
        identity = request.identity()
    else:  # a request id, or streaming, changes nothing of the reply
        identity = request.model_dump(mode="json", exclude={"rid", "request_id", "stream", "stream_options"})
    digest = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS))
    return random.Random(f"{server_seed}:{seed}:{digest.hexdigest()}")
