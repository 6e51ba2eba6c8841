"""The engine call of a proxied chat completion, and the stream the agent asked for.

The request goes to the engine as the agent wrote it (tools, images, sampling fields, any
extension), with the toolkit's capture fields added (``engines.Dialect.chat_capture``) and
``stream: false``; the answer's ids and logprobs are read by the toolkit's reader
(``engines.chat_tokens``). The HTTP client is the toolkit's ``EngineClient`` on one shared
aiohttp transport (its engine pool, retries of transport errors, 429 and 5xx).

Streaming. SGLang refuses its token fields with ``stream: true``, and a stream's ids arrive
split over chunks where an engine sends them at all; so a streamed request is made upstream
without streaming, and the whole answer is then streamed to the agent as OpenAI
``chat.completion.chunk`` events (``stream_chunks``): the role, the reasoning, the content, each
tool call, the finish reason, the usage when ``stream_options.include_usage`` asked for it, and
``[DONE]``. The agent sees a stream; its first byte comes when the engine has finished.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson

from buffer.toolkit.engines import AnswerShapeError, Engine, answer_engine, chat_tokens, dialect
from buffer.toolkit.llm import EngineClient, LLMError, RetryPolicy, engine_base_url
from buffer.toolkit.pool import routing_key
from buffer.toolkit.transport import AiohttpTransport, HttpxTransport, Transport
from buffer.toolkit.types import TokenCapture

#: Fields of the answer that only the capture asked for: dropped unless the agent asked too.
_CAPTURE_ANSWER_FIELDS = ("prompt_token_ids", "token_ids", "meta_info")


class _Engines(EngineClient):
    """The engines of one set of URLs (a pool when there are several), on the shared transport."""

    def __init__(self, urls: Sequence[str], transport: Transport, retry: RetryPolicy) -> None:
        super().__init__(transport=transport, retry=retry)
        self._engines(list(urls), lambda url: engine_base_url(url) + "/chat/completions")


class EngineProxy:
    """The gateway's client to the engines: one aiohttp transport, and one toolkit client (with
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
            self._transport: Transport = AiohttpTransport()
        elif isinstance(transport, httpx.AsyncBaseTransport):
            self._transport = HttpxTransport(transport)
        else:
            self._transport = transport
        self._retry = retry or RetryPolicy(max_retry_s=60.0)
        self._clients: dict[tuple[str, ...], _Engines] = {}
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

    async def models(self, urls: Sequence[str]) -> tuple[int, bytes]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=30.0, trust_env=False)
        response = await self._http.get(engine_base_url(urls[0]) + "/models")
        return response.status_code, response.content

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.pool.aclose()
        await self._transport.aclose()
        if self._http is not None:
            await self._http.aclose()


def capture(answer: dict[str, Any]) -> tuple[dict[str, Any], str, TokenCapture | None]:
    """The first choice's message, finish reason and token record of an engine's answer."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise LLMError(f"the policy server's answer has no choices: {str(answer)[:300]}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise LLMError(f"the policy server's answer has no message: {str(answer)[:300]}")
    try:
        tokens = chat_tokens(answer, choice)
    except AnswerShapeError as exc:
        raise LLMError(f"the policy server's token ids are malformed: {exc}") from exc
    if tokens is not None:  # which engine answered: what its logprobs are depends on it
        tokens.engine = answer_engine(answer, choice)
    return message, str(choice.get("finish_reason") or "stop"), tokens


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
    base = {
        "id": answer.get("id", "chatcmpl-gateway"),
        "object": "chat.completion.chunk",
        "created": answer.get("created", 0),
        "model": answer.get("model", body.get("model", "")),
    }
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
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and answer.get("usage") is not None:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _event(
    base: dict[str, Any],
    index: int,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: Any = None,
) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
