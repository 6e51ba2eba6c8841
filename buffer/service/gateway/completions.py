"""OpenAI's legacy completions (``POST /v1/completions``) as the gateway records them.

The request is the engine's own: both vLLM and SGLang serve ``/v1/completions``, and both give
the prompt's ids and the sampled ids in each choice with ``return_token_ids`` (vLLM's
``completion/protocol.py``, SGLang's ``serving_completions.py``) and each sampled token's logprob
in ``logprobs.token_logprobs`` with ``logprobs: 0`` (the agent's own ``logprobs`` where it asked
for more); SGLang adds ``metadata.weight_version``. So a call is sent as the agent wrote it, with
those fields added and ``stream: false`` (``upstream_body``), and each choice is read back
(``captures``); the agent gets the answer without what it did not ask for (``for_agent``),
streamed as OpenAI's ``text_completion`` chunks when it asked (``stream_chunks``).

- ``check(body)``: the one prompt of a call: a string, a list of one string, token ids or a list
  of one list of ids (a 422 naming the field for anything else, ``echo: true`` and ``best_of``).
- Chains. A call continues the earlier call whose prompt and sampled ids begin its prompt's ids
  (the longest, the latest among equals: ``tree.continued_by_ids``). In token mode the gateway
  owns the ids (``owned_ids``): a string prompt that begins with an earlier call's text (its
  prompt and its output as its ids decode, stop string and special tokens included) is sent as
  that call's ids plus the rest encoded (``tree.continued_by_text``), so a chain's tokens are
  never re-tokenised; any other string is encoded whole. ``new_text`` is a call's prompt as its
  message (the text past what its parent held).
- ``answer_of``: the answer made of recorded choices (an SDK's retry answered from the record).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from buffer.errors import InvalidInput
from buffer.service.gateway import streaming
from buffer.service.gateway.sessions import Session
from buffer.service.gateway.translation import MAX_STOP
from buffer.service.gateway.tree import continued_by_text, whole_messages
from buffer.toolkit.engines import AnswerShapeError, read_completions
from buffer.toolkit.llm import LLMError
from buffer.toolkit.types import TokenCapture

#: The answer's fields only the capture asked for: dropped unless the agent asked too.
_CAPTURE_FIELDS = ("prompt_token_ids", "token_ids")
#: Request fields that are no sampling field (``Call.sampling`` is the rest of what was sent).
NOT_SAMPLING = frozenset(
    {"prompt", "stream", "stream_options", "metadata", "echo", "logprobs", "return_token_ids", "user"}
)
_NOT_UPSTREAM = frozenset({"stream", "stream_options", "prompt"})
#: The most choices one call may ask for.
MAX_CHOICES = 128

Prompt = str | list[int]
Reply = tuple[str, str, TokenCapture]


def check(body: Mapping[str, Any]) -> Prompt:
    """The call's one prompt; ``InvalidInput`` naming the field that cannot be served."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInput.one("prompt", "must not be empty")
    elif not (isinstance(prompt, list) and prompt and all(type(i) is int and i >= 0 for i in prompt)):
        raise InvalidInput.one(
            "prompt",
            "must be one prompt: a non-empty string or list of token ids (a session records one "
            "prompt a call; send several as several calls)",
        )
    if body.get("echo"):
        raise InvalidInput.one("echo", "is not served: only echo=false (the prompt is not generated text)")
    if body.get("best_of") not in (None, 1):
        raise InvalidInput.one("best_of", "is not served: the choices the engine drops would not be recorded")
    if body.get("suffix") is not None:
        raise InvalidInput.one("suffix", "is not served: the engines do not take it")
    for key, limit in (("max_tokens", None), ("n", MAX_CHOICES)):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1 or (limit and value > limit)):
            raise InvalidInput.one(key, f"must be a positive integer{f' up to {limit}' if limit else ''}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= 20):
        raise InvalidInput.one("logprobs", "must be an integer from 0 to 20")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):  # noqa: SIM102
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > MAX_STOP:
            raise InvalidInput.one("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    if body.get("stream") not in (None, True, False):
        raise InvalidInput.one("stream", "must be a boolean")
    return prompt


def upstream_body(sent: Mapping[str, Any], prompt: Prompt) -> dict[str, Any]:
    """The engine's request: the agent's (pinned) fields, the one ``prompt``, the ids and the
    sampled tokens' logprobs asked for, without streaming."""
    upstream = {
        key: value for key, value in sent.items() if key not in ("stream", "stream_options", "prompt")
    }
    upstream["prompt"] = prompt
    upstream["stream"] = False
    upstream["return_token_ids"] = True
    if upstream.get("logprobs") is None:
        upstream["logprobs"] = 0  # the sampled token's logprob only
    return upstream


def captures(answer: Mapping[str, Any]) -> list[Reply]:
    """Each choice's text, finish reason and token record, in the order of their ``index``;
    ``LLMError`` where the engine gave no ids (nothing could be trained on)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise LLMError(f"the policy server's completion has no choices: {str(answer)[:300]}")
    metadata = answer.get("metadata")
    version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    replies = []
    for choice in sorted(choices, key=lambda c: c.get("index") or 0):
        try:
            read = read_completions({"choices": [choice]})
        except AnswerShapeError as exc:
            raise LLMError(
                f"the policy server's completion cannot be recorded: {exc} (the gateway needs vLLM "
                "0.10.2 or later, or SGLang, whose /v1/completions return token ids)"
            ) from exc
        if read.prompt_ids is None:
            raise LLMError("the policy server's completion has no prompt_token_ids: it cannot be recorded")
        tokens = TokenCapture(read.prompt_ids, read.output_ids, read.output_logprobs)
        if isinstance(version, str | int) and not isinstance(version, bool):
            tokens.weight_version = version
        # which engine answered (what its logprobs are): SGLang's has matched_stop, vLLM's stop_reason
        tokens.engine = "sglang" if "matched_stop" in choice or metadata is not None else "vllm"
        replies.append((read.text, read.finish_reason, tokens))
    return replies


def for_agent(answer: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The answer without the ids and logprobs only the capture asked for."""
    keep_ids = bool(body.get("return_token_ids"))
    keep_logprobs = body.get("logprobs") is not None
    if keep_ids and keep_logprobs:
        return answer
    choices = []
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict):
            choice = {k: v for k, v in choice.items() if keep_ids or k not in _CAPTURE_FIELDS}
            if not keep_logprobs:
                choice["logprobs"] = None
        choices.append(choice)
    return {**answer, "choices": choices}


def answer_of(replies: Sequence[Reply], model: str, answer_id: str | None = None) -> dict[str, Any]:
    """A ``text_completion`` made of recorded choices (a retried request answered from the record)."""
    prompt_tokens = len(replies[0][2].prompt_ids) if replies else 0
    completion_tokens = sum(len(tokens.output_ids) for _, _, tokens in replies)
    return {
        "id": answer_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
            for index, (text, finish_reason, _) in enumerate(replies)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunks(answer: Mapping[str, Any], body: Mapping[str, Any]) -> Iterator[bytes]:
    """A whole answer as OpenAI's completions stream: each choice's text (with its logprobs),
    then its finish reason, the usage when ``stream_options.include_usage`` asked, ``[DONE]``."""
    base = streaming.chunk_base(answer, body, "text_completion", "cmpl-gateway")
    for choice in answer.get("choices") or ():
        index = choice.get("index", 0)
        text = {"index": index, "text": choice.get("text") or "", "logprobs": choice.get("logprobs")}
        yield streaming.chunk(base, {**text, "finish_reason": None})
        yield streaming.chunk(
            base, {"index": index, "text": "", "logprobs": None, "finish_reason": choice.get("finish_reason")}
        )
    yield from streaming.stream_end(base, answer, body)


# -- chains --------------------------------------------------------------------------------


def owned_ids(session: Session, tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token mode: a legacy completion's prompt as ids. Ids are sent as given; a string that
    begins with what an earlier call's ids hold is those ids and the rest encoded, else it is
    encoded whole, with the special tokens (a BOS) the engine would add."""
    if not isinstance(prompt, str):
        return prompt
    found = continued_by_text(session.text_ends, session.text_lengths, prompt)
    if found is None:
        ids: list[int] = tokenizer.encode(prompt)
        return ids
    index, rest = found
    tokens = session.calls[index].tokens or {}
    return [*tokens["prompt_ids"], *tokens["output_ids"], *tokenizer.encode(rest, add_special_tokens=False)]


def new_text(
    session: Session, parent: int | None, text: str | None, prompt_ids: list[int], tokenizer: Any
) -> str:
    """A legacy completion's prompt as its message: the text past what its parent held (the
    parent's messages and the text the agent got), all of it where it does not begin so. A prompt
    of ids is decoded in token mode (past the parent's ids), and has no text otherwise."""
    if text is None:
        if tokenizer is None:
            return ""
        held = session.calls[parent].tokens if parent is not None else None
        start = len(held["prompt_ids"]) + len(held["output_ids"]) if held else 0
        decoded: str = tokenizer.decode(prompt_ids[start:], skip_special_tokens=False)
        return decoded
    if parent is None:
        return text
    calls = session.calls
    before = "".join(str(m.get("content") or "") for m in whole_messages(calls, parent))
    before += str(calls[parent].reply.get("content") or "")
    return text[len(before) :] if text.startswith(before) else text
