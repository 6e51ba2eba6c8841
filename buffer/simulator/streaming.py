"""``stream=true``: the chunks each engine sends, one sampled token per chunk.

Chat: a first chunk with the role (vLLM adds ``prompt_token_ids`` to it with
``return_token_ids``), then one chunk per output id whose delta is what the engine's parsers
let through by then (reasoning, content, or a whole tool call once its ``</tool_call>`` is
sampled), with that token's logprob and, on vLLM, its ``token_ids``; the last token's chunk
carries ``finish_reason``; then a usage chunk (``stream_options.include_usage``) and ``[DONE]``.
The deltas of a field joined give the non-streaming field. vLLM's completions send text deltas
with ``token_ids``; SGLang's ``/generate`` sends the text, ids and logprobs so far each time.

Each generator yields ``(chunk, tokens)``: the SSE payload, and how many sampled tokens it carries
(the caller waits ``--latency-per-token-s`` for each).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from buffer.simulator.conversation import Output, parse_output
from buffer.simulator.engines import Dialect
from buffer.simulator.model import SimModel
from buffer.simulator.replies import Generation
from buffer.simulator.shapes import (
    ChatChoice,
    chat_logprobs,
    completion_logprobs,
    meta_info,
    stop_reason,
    usage,
)

Chunk = tuple[dict[str, Any], int]


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


def chat_chunks(
    dialect: Dialect,
    model: SimModel,
    head: dict[str, Any],
    choices: list[ChatChoice],
    prompt_ids: list[int] | None,
    thinking: bool,
    logprobs: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> Iterator[Chunk]:
    """The chunks of a streamed chat completion (see the module docstring)."""

    def chunk(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}
        return {**head, "object": "chat.completion.chunk", "choices": [body]}

    for index, choice in enumerate(choices):
        first = chunk(index, {"role": "assistant", "content": ""})
        if prompt_ids is not None and index == 0:
            first["prompt_token_ids"] = prompt_ids
        yield first, 0
        generation = choice.generation
        sent = Output(None, None, [])
        raw = ""
        for position, token in enumerate(generation.ids):
            last = position == len(generation.ids) - 1
            raw += "" if token in model.special_ids else model.token_text[token]
            now = choice.output if last else _partial(parse_output(raw, thinking))
            delta = _delta(dialect, sent, now, choice)
            sent = now
            fields: dict[str, Any] = {}
            if logprobs:
                fields["logprobs"] = chat_logprobs(model, [token], [generation.logprobs[position]], 0)
            if prompt_ids is not None:
                fields["token_ids"] = [token]
            if last:
                fields["finish_reason"] = choice.finish_reason
                fields.update(dialect.stop_field(generation, model.eos_id))
            yield chunk(index, delta, **fields), 1
        if not generation.ids:
            yield chunk(index, {}, finish_reason=choice.finish_reason), 0
    if include_usage:
        completion_tokens = sum(len(choice.generation.ids) for choice in choices)
        yield (
            {
                **head,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            },
            0,
        )


def _partial(output: Output) -> Output:
    """What a streaming parser lets through before the end: no half tool call, no trailing newline."""
    content = output.content
    if content is not None and "<tool_call>" in content:
        content = content.split("<tool_call>", 1)[0].rstrip("\n")
    reasoning = output.reasoning.rstrip("\n") if output.reasoning is not None else None
    return Output(reasoning, content, output.tool_calls)


def _delta(dialect: Dialect, sent: Output, now: Output, choice: ChatChoice) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    reasoning = _extension(sent.reasoning, now.reasoning)
    if reasoning:
        delta.update(dialect.reasoning_delta(reasoning))
    content = _extension(sent.content, now.content)
    if content:
        delta["content"] = content
    if now.tool_calls and not sent.tool_calls:
        delta["tool_calls"] = dialect.tool_calls(choice)
    return delta


def _extension(before: str | None, after: str | None) -> str:
    before = before or ""
    return after[len(before) :] if after and after.startswith(before) else ""


def completion_chunks(
    model: SimModel,
    head: dict[str, Any],
    generations: list[Generation],
    texts: list[str],
    prompt_ids: list[int] | None,
    logprobs: bool,
    skip_special_tokens: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> Iterator[Chunk]:
    """vLLM's streamed ``/v1/completions``: one text delta per token, with its id."""
    for index, (generation, text) in enumerate(zip(generations, texts, strict=True)):
        sent = ""
        for position, token in enumerate(generation.ids):
            last = position == len(generation.ids) - 1
            now = (
                text
                if last
                else model.decode(generation.ids[: position + 1], skip_special_tokens)[: len(text)]
            )
            choice: dict[str, Any] = {
                "index": index,
                "text": now[len(sent) :],
                "logprobs": None,
                "finish_reason": generation.finish_reason if last else None,
                "stop_reason": stop_reason(generation, model.eos_id) if last else None,
            }
            sent = now
            if logprobs:
                one = Generation([token], [generation.logprobs[position]], generation.finish_reason)
                choice["logprobs"] = completion_logprobs(model, one)
            if prompt_ids is not None:
                choice["token_ids"] = [token]
                if position == 0:
                    choice["prompt_token_ids"] = prompt_ids
            yield {**head, "object": "text_completion", "choices": [choice]}, 1
        if not generation.ids:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": generation.finish_reason}
            yield {**head, "object": "text_completion", "choices": [choice]}, 0
    if include_usage:
        completion_tokens = sum(len(generation.ids) for generation in generations)
        yield (
            {
                **head,
                "object": "text_completion",
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            },
            0,
        )


def generate_chunks(
    model: SimModel,
    generation: Generation,
    text: str,
    skip_special_tokens: bool,
    prompt_tokens: int,
    weight_version: str,
    logprobs: bool,
    started: float,
) -> Iterator[Chunk]:
    """SGLang's streamed ``/generate``: the text, ids and logprobs so far, in each chunk."""
    for position in range(len(generation.ids)):
        last = position == len(generation.ids) - 1
        so_far = Generation(
            generation.ids[: position + 1],
            generation.logprobs[: position + 1],
            generation.finish_reason,
            generation.matched_stop,
        )
        info = meta_info(so_far, prompt_tokens, weight_version, logprobs, started)
        if not last:
            info["finish_reason"] = None
        body_text = text if last else model.decode(so_far.ids, skip_special_tokens)[: len(text)]
        yield {"text": body_text, "output_ids": so_far.ids, "meta_info": info}, 1
    if not generation.ids:
        info = meta_info(generation, prompt_tokens, weight_version, logprobs, started)
        yield {"text": "", "output_ids": [], "meta_info": info}, 0
