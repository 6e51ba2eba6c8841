"""The engine call of a proxied chat completion, and the stream the agent asked for.

The request goes to the engine as the agent wrote it (tools, images, sampling fields, any
extension), with the toolkit's capture fields added (``engines.Dialect.chat_capture``) and
``stream: false``; the answer's ids and logprobs are read by the toolkit's reader
(``engines.chat_tokens``). The HTTP client is the toolkit's ``EngineClient`` on one shared
transport, the toolkit's own HTTP/1.1 one (``buffer.toolkit.http11``: ``https://`` engines go
through aiohttp), with its engine pool and retries of transport errors, 429 and 5xx. aiohttp's
``ClientSession`` cost about 75 us more of the gateway's CPU per call (``bench/gateway.py``).

Streaming. SGLang refuses its token fields with ``stream: true``, and a stream's ids arrive
split over chunks where an engine sends them at all; so a streamed request is made upstream
without streaming, and the whole answer is then streamed to the agent as OpenAI
``chat.completion.chunk`` events (``stream_chunks``): the role, the reasoning, the content, each
tool call, the finish reason, the usage when ``stream_options.include_usage`` asked for it, and
``[DONE]``. The agent sees a stream; its first byte comes when the engine has finished.

Token mode. A session with a tokenizer is served by the toolkit's token client
(``buffer.toolkit.tito``): a chain's first prompt rendered once with the served model's
template, each later one extended by the ids sampled and the observation's tokens, sent to the
engine's token route; the agent gets a chat completion (``chat_answer``: tool calls parsed from
the text).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from buffer.service.gateway import streaming
from buffer.toolkit.engines import AnswerShapeError, Engine, answer_engine, chat_tokens, dialect
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.llm import EngineClient, LLMError, RetryPolicy, engine_base_url
from buffer.toolkit.pool import routing_key
from buffer.toolkit.tito import TokenClient, TokenRenderer, tokenizer_for
from buffer.toolkit.transport import HttpxTransport, Transport
from buffer.toolkit.types import Completion, TokenCapture

#: Fields of the answer that only the capture asked for: dropped unless the agent asked too.
_CAPTURE_ANSWER_FIELDS = ("prompt_token_ids", "token_ids", "meta_info")


class _Engines(EngineClient):
    """The engines of one set of URLs (a pool when there are several), on the shared transport."""

    def __init__(
        self, urls: Sequence[str], transport: Transport, retry: RetryPolicy, path: str = "/chat/completions"
    ) -> None:
        super().__init__(transport=transport, retry=retry)
        self._engines(list(urls), lambda url: engine_base_url(url) + path)


class EngineProxy:
    """The gateway's client to the engines: one HTTP/1.1 transport, and one toolkit client (with
    its pool, retries and counting) per set of engine URLs that sessions name. A session's calls
    carry its id as the routing key, so they stick to one engine of a pool: its prefix cache."""

    def __init__(
        self,
        *,
        engine: Engine = "auto",
        transport: httpx.AsyncBaseTransport | Transport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect(engine)
        if transport is None:
            self._transport: Transport = Http11Transport()
        elif isinstance(transport, httpx.AsyncBaseTransport):
            self._transport = HttpxTransport(transport)
        else:
            self._transport = transport
        self._retry = retry or RetryPolicy(max_retry_s=60.0)
        self._clients: dict[tuple[str, ...], _Engines] = {}
        self._completion_clients: dict[tuple[str, ...], _Engines] = {}  # legacy /v1/completions
        self._token_clients: dict[tuple[tuple[str, ...], str, str], TokenClient] = {}
        self._renderers: dict[str, TokenRenderer] = {}
        self._http: httpx.AsyncClient | None = None  # for the rare GET /v1/models

    def upstream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        upstream = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
        upstream["stream"] = False
        for key, value in self.dialect.chat_capture.items():
            upstream.setdefault(key, value)
        return upstream

    def _client(self, urls: Sequence[str]) -> _Engines:
        key = tuple(urls)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Engines(key, self._transport, self._retry)
        return client

    async def chat(self, urls: Sequence[str], body: dict[str, Any], key: str) -> dict[str, Any]:
        """The engine's answer to ``body`` (an upstream body), after any retries; ``LLMError``."""
        token = routing_key.set(key)
        try:
            answer, _ = await self._client(urls)._post(body)
        finally:
            routing_key.reset(token)
        return answer

    async def completions(self, urls: Sequence[str], body: dict[str, Any], key: str) -> dict[str, Any]:
        """The engine's answer to a legacy completion (``completions.upstream_body``); ``LLMError``."""
        clients = self._completion_clients
        client = clients.get(tuple(urls))
        if client is None:
            client = clients[tuple(urls)] = _Engines(urls, self._transport, self._retry, "/completions")
        token = routing_key.set(key)
        try:
            answer, _ = await client._post(body)
        finally:
            routing_key.reset(token)
        return answer

    async def renderer(self, tokenizer_path: str) -> TokenRenderer:
        """The served model's template (loaded once per path, in a thread); ``ValueError``,
        ``OSError`` or ``TokenizerMissing`` when it does not load."""
        renderer = self._renderers.get(tokenizer_path)
        if renderer is None:
            tokenizer = await asyncio.to_thread(tokenizer_for, tokenizer_path, True)
            renderer = self._renderers.setdefault(tokenizer_path, TokenRenderer(tokenizer))
        return renderer

    async def complete_tokens(
        self,
        urls: Sequence[str],
        tokenizer_path: str,
        body: dict[str, Any],
        previous: Completion | None,
        key: str,
    ) -> Completion:
        """Token mode: the answer to the agent's ``body`` from the engine's token route, its
        prompt extended from ``previous`` (the chain's call it continues) or rendered afresh."""
        renderer = await self.renderer(tokenizer_path)
        model = str(body.get("model") or "default")
        client_key = (tuple(urls), tokenizer_path, model)
        client = self._token_clients.get(client_key)
        if client is None:
            client = self._token_clients[client_key] = TokenClient(
                list(urls),
                renderer,
                engine=self.engine,
                model=model,
                transport=self._transport,
                retry=self._retry,
            )
        sampling = {k: v for k, v in body.items() if k in TOKEN_SAMPLING and v is not None}
        seed = sampling.pop("seed", None)
        token = routing_key.set(key)
        try:
            return await client.complete(
                body["messages"], tools=body.get("tools") or None, seed=seed, previous=previous, **sampling
            )
        finally:
            routing_key.reset(token)

    async def models(self, urls: Sequence[str]) -> tuple[int, bytes]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=30.0, trust_env=False)
        response = await self._http.get(engine_base_url(urls[0]) + "/models")
        return response.status_code, response.content

    async def aclose(self) -> None:
        for client in (*self._clients.values(), *self._completion_clients.values()):
            await client.pool.aclose()
        for token_client in self._token_clients.values():
            await token_client.pool.aclose()
        await self._transport.aclose()
        if self._http is not None:
            await self._http.aclose()


#: The body's fields the token route is sent (in OpenAI's names; the dialect maps them).
TOKEN_SAMPLING = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "stop",
        "max_tokens",
        "max_completion_tokens",
    }
)


def capture(answer: dict[str, Any]) -> tuple[dict[str, Any], str, TokenCapture | None]:
    """The first choice's message, finish reason and token record of an engine's answer."""
    return captures(answer)[0]


def captures(answer: dict[str, Any]) -> list[tuple[dict[str, Any], str, TokenCapture | None]]:
    """Each choice's message, finish reason and token record of an engine's answer (``n > 1``:
    several), in the order of their ``index``."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise LLMError(f"the policy server's answer has no choices: {str(answer)[:300]}")
    found = []
    for choice in sorted(choices, key=lambda c: c.get("index") or 0):
        message = choice.get("message")
        if not isinstance(message, dict):
            raise LLMError(f"the policy server's answer has no message: {str(answer)[:300]}")
        try:
            tokens = chat_tokens(answer, choice)
        except AnswerShapeError as exc:
            raise LLMError(f"the policy server's token ids are malformed: {exc}") from exc
        if tokens is not None:  # which engine answered: what its logprobs are depends on it
            tokens.engine = answer_engine(answer, choice)
        found.append((message, str(choice.get("finish_reason") or "stop"), tokens))
    return found


def chat_answer(
    replies: Sequence[tuple[dict[str, Any], str, TokenCapture | None]],
    model: str,
    answer_id: str | None = None,
) -> dict[str, Any]:
    """An OpenAI chat completion made of recorded replies (a token-mode answer, or a retried
    request answered from what was recorded)."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for _, _, tokens in replies:
        if tokens is not None:
            usage["prompt_tokens"] = len(tokens.prompt_ids)
            usage["completion_tokens"] += len(tokens.output_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {
        "id": answer_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}
            for index, (message, finish_reason, _) in enumerate(replies)
        ],
        "usage": usage,
    }


def token_reply(completion: Completion) -> dict[str, Any]:
    """A token-mode completion as the assistant message an agent gets."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.text or None}
    if completion.tool_calls:
        message["tool_calls"] = completion.tool_calls
    if completion.reasoning_content:
        message["reasoning_content"] = completion.reasoning_content
    if message["content"] is None and not completion.tool_calls:
        message["content"] = ""
    return message


def for_agent(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The answer without the capture's fields the agent did not ask for itself."""
    asked = {
        key for key in ("return_token_ids", "return_prompt_token_ids", "return_meta_info") if body.get(key)
    }
    if asked:
        return answer
    if any(key in answer for key in _CAPTURE_ANSWER_FIELDS) or any(
        isinstance(c, dict) and any(key in c for key in _CAPTURE_ANSWER_FIELDS)
        for c in answer.get("choices") or ()
    ):
        answer = {key: value for key, value in answer.items() if key != "prompt_token_ids"}
        answer["choices"] = [
            {key: value for key, value in choice.items() if key not in _CAPTURE_ANSWER_FIELDS}
            if isinstance(choice, dict)
            else choice
            for choice in answer.get("choices") or ()
        ]
    return answer


def stream_chunks(answer: dict[str, Any], body: dict[str, Any]) -> Iterator[bytes]:
    """A whole answer as the server-sent events of a streamed one."""
    base = streaming.chunk_base(answer, body, "chat.completion.chunk", "chatcmpl-gateway")
    for choice in answer.get("choices") or ():
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        yield _event(base, index, {"role": "assistant", "content": ""})
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            yield _event(base, index, {"reasoning_content": reasoning})
        if message.get("content"):
            yield _event(base, index, {"content": message["content"]}, logprobs=choice.get("logprobs"))
        for position, call in enumerate(message.get("tool_calls") or ()):
            delta = {
                "index": position,
                "id": call.get("id"),
                "type": "function",
                "function": call.get("function"),
            }
            yield _event(base, index, {"tool_calls": [delta]})
        yield _event(base, index, {}, finish_reason=choice.get("finish_reason") or "stop")
    yield from streaming.stream_end(base, answer, body)


def _event(
    base: dict[str, Any],
    index: int,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: Any = None,
) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return streaming.chunk(base, choice)
