"""The engine call of a proxied chat completion, and the stream the agent asked for.

The request goes to the engine as the agent wrote it (tools, images, sampling fields, any
extension), with the toolkit's capture fields added (``engines.chat_capture_fields``) and
``stream: false``; the answer's ids and logprobs are read by the toolkit's reader
(``engines.chat_tokens``). The HTTP client is the toolkit's ``EngineClient`` (one shared pool,
retries of transport errors, 429 and 5xx).

Streaming. SGLang refuses its token fields with ``stream: true``, and a stream's ids arrive
split over chunks where an engine sends them at all; so a streamed request is made upstream
without streaming, and the whole answer is then streamed to the agent as OpenAI
``chat.completion.chunk`` events (``stream_chunks``): the role, the reasoning, the content, each
tool call, the finish reason, the usage when ``stream_options.include_usage`` asked for it, and
``[DONE]``. The agent sees a stream; its first byte comes when the engine has finished.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from buffer.toolkit.engines import AnswerShapeError, Engine, chat_capture_fields, chat_tokens
from buffer.toolkit.llm import EngineClient, LLMError, engine_base_url
from buffer.toolkit.types import TokenCapture

#: Fields of the answer that only the capture asked for: dropped unless the agent asked too.
_CAPTURE_ANSWER_FIELDS = ("prompt_token_ids", "token_ids", "meta_info")


class EngineProxy(EngineClient):
    """The gateway's client to the engines (any number of them: the URL is per call)."""

    def __init__(self, *, engine: Engine = "auto", **client: Any) -> None:
        super().__init__(**client)
        self.engine = engine

    def upstream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        upstream = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
        upstream["stream"] = False
        for key, value in chat_capture_fields(self.engine).items():
            upstream.setdefault(key, value)
        return upstream

    async def chat(self, engine_url: str, body: dict[str, Any]) -> dict[str, Any]:
        """The engine's answer to ``body`` (an upstream body), after any retries; ``LLMError``."""
        answer, _ = await self._post(engine_base_url(engine_url) + "/chat/completions", body)
        return answer

    async def models(self, engine_url: str) -> tuple[int, bytes]:
        response = await self._client.get(engine_base_url(engine_url) + "/models", headers=self._headers)
        return response.status_code, response.content


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
