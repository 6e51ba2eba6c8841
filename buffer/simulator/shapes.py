"""Answer pieces the two engines write alike, whichever ``--engine`` is imitated.

The logprobs of a chat choice (one entry per output id, the end-of-turn token included), a
tool call's OpenAI form, usage, the decoded output text, and the bodies of the token routes
both dialects serve: SGLang's ``meta_info`` (``/generate``, and chat's ``return_meta_info``;
``finish_reason`` as an object, ``output_token_logprobs`` as ``[logprob, id, null]``) and
vLLM's completions ``logprobs`` and ``stop_reason`` (``/v1/completions``). Where the two
engines put things differently in a chat answer is ``engines.py``'s (one class per engine).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from buffer.simulator.conversation import Output
from buffer.simulator.model import SimModel
from buffer.simulator.replies import Generation


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """One finished chat choice: what was sampled, and how the engine's parsers read it."""

    generation: Generation
    output: Output
    call_ids: tuple[str, ...]

    @property
    def finish_reason(self) -> str:
        if self.output.tool_calls and self.generation.finish_reason == "stop":
            return "tool_calls"
        return self.generation.finish_reason


def new_call_ids(output: Output, rng: random.Random) -> tuple[str, ...]:
    return tuple(f"call_{rng.getrandbits(64):016x}" for _ in output.tool_calls)


def tool_calls_body(choice: ChatChoice) -> list[dict[str, Any]]:
    """The choice's tool calls in OpenAI's form, as both engines write them but for SGLang's
    ``index`` (``engines.SGLang.tool_calls``)."""
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call, call_id in zip(choice.output.tool_calls, choice.call_ids, strict=True)
    ]


def chat_logprobs(model: SimModel, ids: list[int], logprobs: list[float], top: int) -> dict[str, Any]:
    """``choices[i].logprobs``: one entry per output id, with ``top`` made-up alternatives."""
    texts, token_bytes = model.token_text, model.token_bytes
    if not top:  # what a capture asks for: no alternatives
        return {
            "content": [
                {"token": texts[token], "logprob": logprob, "bytes": token_bytes[token], "top_logprobs": []}
                for token, logprob in zip(ids, logprobs, strict=True)
            ]
        }
    content = []
    for token, logprob in zip(ids, logprobs, strict=True):
        entry = _chat_entry(model, token, logprob)
        alternatives = [entry]
        for rank in range(1, top):
            alternatives.append(_chat_entry(model, (token + rank) % model.vocab_size, logprob - rank))
        content.append({**entry, "top_logprobs": alternatives[:top]})
    return {"content": content}


def _chat_entry(model: SimModel, token: int, logprob: float) -> dict[str, Any]:
    return {"token": model.token_text[token], "logprob": logprob, "bytes": model.token_bytes[token]}


def sglang_finish_reason(generation: Generation) -> dict[str, Any]:
    if generation.finish_reason == "length":
        return {"type": "length", "length": len(generation.ids)}
    if generation.finish_reason == "abort":
        return {"type": "abort", "message": "simulated abort", "status_code": None, "err_type": None}
    return {"type": "stop", "matched": generation.matched_stop}


def meta_info(
    generation: Generation, prompt_tokens: int, weight_version: str, logprobs: bool, started: float
) -> dict[str, Any]:
    """SGLang's ``meta_info`` of one generation (``/generate``, and chat's ``return_meta_info``)."""
    info: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": sglang_finish_reason(generation),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(generation.ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if logprobs:
        info["output_token_logprobs"] = [
            [logprob, token, None] for token, logprob in zip(generation.ids, generation.logprobs, strict=True)
        ]
    info["e2e_latency"] = round(time.monotonic() - started, 6)
    return info


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stop_reason(generation: Generation, eos_id: int) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id matched; None at the end of turn."""
    matched = generation.matched_stop
    return None if matched == eos_id else matched


def output_text(model: SimModel, generation: Generation, skip_special_tokens: bool, keep_stop: bool) -> str:
    """The decoded output, without the matched stop string unless ``keep_stop``."""
    text = model.decode(generation.ids, skip_special_tokens=skip_special_tokens)
    if generation.stop_at is not None and not keep_stop:
        text = text[: generation.stop_at]
    return text


def completion_logprobs(model: SimModel, generation: Generation, offset: int = 0) -> dict[str, Any]:
    """vLLM's completions ``logprobs``: tokens, token_logprobs, text_offset, top_logprobs."""
    tokens = [model.token_text[token] for token in generation.ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": list(generation.logprobs),
        "tokens": tokens,
        "top_logprobs": [
            {token: logprob} for token, logprob in zip(tokens, generation.logprobs, strict=True)
        ],
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
