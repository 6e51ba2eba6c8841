"""The engines the toolkit talks to, by name, in one table: ``DIALECTS``.

A dialect says what a chat request asks for to get token ids back (``chat_capture``), how it
continues an aborted answer as text where it cannot from ids (``chat_continue``), and where and
how a token prompt goes (token in, token out: ``tito.TokenClient``; and the chat client's
continuation of an aborted answer from its ids). The fields are those of the engines' own code
(see the README's "Token capture" table):

- vLLM chat (``/v1/chat/completions``): ``return_token_ids`` and ``logprobs`` in; the prompt's
  ids at the top level (``prompt_token_ids``), the sampled ids in the choice (``token_ids``),
  their logprobs in ``choices[0].logprobs.content[*].logprob``.
- SGLang chat: ``return_prompt_token_ids``, ``return_token_ids``, ``return_meta_info`` and
  ``logprobs`` in; ``prompt_token_ids`` and ``token_ids`` in the choice (older SGLang: the
  sampled ids only in ``meta_info.output_token_logprobs``), ``metadata.weight_version``.
- SGLang ``/generate``: ``input_ids`` and ``sampling_params`` in; ``output_ids`` and
  ``meta_info`` (``output_token_logprobs`` as ``[logprob, id, text]``, ``finish_reason`` as
  ``{"type": ...}``, ``weight_version``) out; with ``return_routed_experts`` (a server run with
  ``--enable-return-routed-experts``), ``meta_info.routed_experts`` (base64 of int32, rows
  ``(tokens - 1 - routed_experts_start_len, layers, topk)``) too.
- vLLM ``/v1/completions`` with a token prompt: ``prompt`` (ids), ``logprobs: 0`` and
  ``return_token_ids`` in; ``prompt_token_ids``, ``token_ids`` and
  ``logprobs.token_logprobs`` in the choice.
- ``auto``: a chat request asks in both dialects (an engine ignores the fields it does not
  know), and a chat answer is read wherever either engine puts the ids (``chat_tokens``); which
  engine wrote it (``answer_engine``) says where its token route is. A token prompt goes to
  SGLang's ``/generate`` first, and to vLLM's ``/v1/completions`` once ``/generate`` is not
  found (``TOKEN_ROUTE_MISSING``).

Where the toolkit reads an engine's raw output (a token route's text), it parses it as the
engines' parsers would: ``split_reasoning`` (Qwen3's ``<think>``) and ``hermes_tool_calls``
(Qwen/Hermes ``<tool_call>{json}</tool_call>``), or any ``ToolCallParser``.

Adding an engine dialect: write one ``Dialect`` subclass here (its name, its chat fields, its
token route and the readers of its answers) and add an instance to ``DIALECTS``. Its name is
then accepted wherever an engine is named (``RolloutSettings.engine`` in ``/start_rollout``,
``ChatClient``, ``TokenClient``, the gateway's proxy): ``Engine`` is the ``Literal`` of the
table's names. The simulator (``buffer.simulator.engines``) keeps its own copy of the shapes
it serves, to test this table against.

This module only reads and writes dicts; the HTTP is ``llm.py``'s.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson

from buffer.toolkit.types import TokenCapture

#: ``parser(text) -> (content, tool_calls)``: the text without the calls, and the calls in
#: OpenAI's form (``{"id", "type": "function", "function": {"name", "arguments": str}}``).
ToolCallParser = Callable[[str], tuple[str, list[dict[str, Any]]]]

#: The statuses of a token route an engine does not serve (vLLM has no ``/generate``).
TOKEN_ROUTE_MISSING = frozenset({404, 405})

#: Chat request fields a token request does not take (a chat answer continued from its ids).
CHAT_ONLY_FIELDS = frozenset(
    {
        *("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs"),
        *("add_generation_prompt", "continue_final_message", "documents", "reasoning_effort"),
        *("separate_reasoning", "logprobs", "top_logprobs", "return_token_ids", "return_prompt_token_ids"),
        *("return_meta_info", "stream", "stream_options", "echo", "n"),
    }
)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class AnswerShapeError(ValueError):
    """An engine's answer lacks what the request asked for, or holds it malformed."""


@dataclass(slots=True)
class Generated:
    """One answer of a token endpoint (``/generate`` or ``/v1/completions``)."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str
    weight_version: str | int | None = None
    prompt_ids: list[int] | None = None  # as the engine echoed them, where it does
    #: SGLang's ``meta_info.routed_experts`` (base64 of int32) and ``routed_experts_start_len``.
    routed_experts: str | None = None
    routed_experts_start: int = 0


def chat_tokens(answer: dict[str, Any], choice: dict[str, Any]) -> TokenCapture | None:
    """The token record of a chat answer, or ``None`` when the engine returned no ids
    (a server that ignores the capture fields: the trajectory then stays text only)."""
    meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else {}
    assert isinstance(meta, dict)
    prompt_ids = choice.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = answer.get("prompt_token_ids")  # vLLM puts it at the top level
    output_ids = choice.get("token_ids")
    meta_logprobs = meta.get("output_token_logprobs")
    if output_ids is None and isinstance(meta_logprobs, list):
        output_ids = [_entry(item, 1) for item in meta_logprobs]
    if prompt_ids is None or output_ids is None:
        return None
    logprobs = _chat_logprobs(choice)
    if logprobs is None and isinstance(meta_logprobs, list):
        logprobs = _floats([_entry(item, 0) for item in meta_logprobs])
    metadata = answer.get("metadata")
    version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    if version is None:
        version = meta.get("weight_version")
    return _capture(prompt_ids, output_ids, logprobs, version)


def answer_engine(answer: dict[str, Any], choice: dict[str, Any]) -> str | None:
    """Which engine wrote a chat answer, from where it put the ids: vLLM the prompt's at the top
    level, SGLang in the choice (or its ``meta_info``); ``None`` when it holds neither."""
    if isinstance(answer.get("prompt_token_ids"), list):
        return "vllm"
    if isinstance(choice.get("prompt_token_ids"), list) or isinstance(choice.get("meta_info"), dict):
        return "sglang"
    return None


def _chat_logprobs(choice: dict[str, Any]) -> list[float] | None:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    try:
        values = [entry["logprob"] for entry in content]
    except (KeyError, TypeError) as exc:
        raise AnswerShapeError(f"a logprobs.content entry has no logprob: {exc!r}") from exc
    return _floats(values)


def generate_request(
    prompt_ids: list[int], max_new_tokens: int | None, sampling: dict[str, Any], seed: int | None
) -> dict[str, Any]:
    """SGLang ``/generate``: the OpenAI-style sampling names mapped to SGLang's."""
    params = {key: value for key, value in sampling.items() if key not in _BUDGET_KEYS}
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    if seed is not None:
        params.setdefault("sampling_seed", seed)
    params.setdefault("skip_special_tokens", False)
    params.setdefault("no_stop_trim", True)
    return {
        "input_ids": prompt_ids,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }


def read_generate(answer: dict[str, Any]) -> Generated:
    meta = answer.get("meta_info")
    if not isinstance(meta, dict):
        raise AnswerShapeError(f"/generate answered without meta_info: {str(answer)[:300]}")
    entries = meta.get("output_token_logprobs")
    output_ids = answer.get("output_ids")
    if output_ids is None:
        if not isinstance(entries, list):
            raise AnswerShapeError("/generate answered no output_ids nor meta_info.output_token_logprobs")
        output_ids = [_entry(item, 1) for item in entries]
    logprobs = _floats([_entry(item, 0) for item in entries]) if isinstance(entries, list) else None
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    text = answer.get("text")
    capture = _capture([], output_ids, logprobs, meta.get("weight_version"))
    experts = meta.get("routed_experts")
    start = meta.get("routed_experts_start_len")
    return Generated(
        text=text if isinstance(text, str) else "",
        output_ids=capture.output_ids,
        output_logprobs=capture.output_logprobs,
        finish_reason=reason if isinstance(reason, str) and reason else "stop",
        weight_version=capture.weight_version,
        routed_experts=experts if isinstance(experts, str) and experts else None,
        routed_experts_start=start if type(start) is int and start >= 0 else 0,
    )


def completions_request(
    model: str, prompt_ids: list[int], max_tokens: int | None, sampling: dict[str, Any], seed: int | None
) -> dict[str, Any]:
    """vLLM ``/v1/completions`` with the prompt as token ids."""
    body: dict[str, Any] = {key: value for key, value in sampling.items() if key not in _BUDGET_KEYS}
    body.update(model=model, prompt=prompt_ids, logprobs=0, return_token_ids=True, stream=False)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if seed is not None:
        body.setdefault("seed", seed)
    body.setdefault("skip_special_tokens", False)
    body.setdefault("include_stop_str_in_output", True)
    return body


def read_completions(answer: dict[str, Any]) -> Generated:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AnswerShapeError(f"/v1/completions answered no choices: {str(answer)[:300]}")
    choice = choices[0]
    output_ids = choice.get("token_ids")
    if output_ids is None:
        raise AnswerShapeError("/v1/completions answered no token_ids (a vLLM without return_token_ids?)")
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    token_logprobs = None
    if isinstance(values, list):
        token_logprobs = _floats([math.nan if v is None else v for v in values])
    capture = _capture(choice.get("prompt_token_ids") or [], output_ids, token_logprobs, None)
    text = choice.get("text")
    reason = choice.get("finish_reason")
    return Generated(
        text=text if isinstance(text, str) else "",
        output_ids=capture.output_ids,
        output_logprobs=capture.output_logprobs,
        finish_reason=reason if isinstance(reason, str) and reason else "stop",
        prompt_ids=capture.prompt_ids or None,
    )


def error_message(body: bytes | str) -> str:
    """The engine's own words from an error answer: vLLM's ``{"error": {"message"}}``, the
    flat ``{"message"}`` of SGLang and older vLLM, FastAPI's ``{"detail"}``, else the text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text.strip()[:500]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        said = error.get("message") if isinstance(error, dict) else None
        if isinstance(said, str):
            return said[:500]
        for key in ("message", "detail", "error"):
            if isinstance(parsed.get(key), str):
                return str(parsed[key])[:500]
    return text.strip()[:500]


def hermes_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Qwen/Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    A block that is not such JSON stays in the content, as the model wrote it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``<think>reasoning</think>content`` -> (reasoning, content); no ``</think>``: no reasoning."""
    head, sep, tail = text.partition("</think>")
    if not sep:
        return None, text
    return head.replace("<think>", "", 1).strip("\n"), tail.lstrip("\n")


def _fields(**fields: Any) -> Mapping[str, Any]:
    """Request fields shared by every request of a dialect: read-only."""
    return MappingProxyType(fields)


class Dialect(ABC):
    """How the toolkit talks to one engine (or, for ``auto``, to either)."""

    name: ClassVar[str]
    #: Chat request fields asking for the prompt's ids, the sampled ids and their logprobs.
    chat_capture: ClassVar[Mapping[str, Any]]
    #: Chat request fields that continue the final assistant message (an aborted answer, as text).
    chat_continue: ClassVar[Mapping[str, Any]]
    #: The token route: its path, from the server's root or (``token_path_under_v1``) under ``/v1``.
    token_path: ClassVar[str]
    token_path_under_v1: ClassVar[bool]
    #: Token request fields that make its text read as a chat answer's (special tokens
    #: skipped, stop strings trimmed): for a chat answer continued from its ids.
    chat_text: ClassVar[Mapping[str, Any]]

    @abstractmethod
    def token_request(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> dict[str, Any]:
        """The body of a token prompt, with the OpenAI-style sampling fields in the engine's names."""

    @abstractmethod
    def read_tokens(self, answer: dict[str, Any]) -> Generated:
        """The token route's answer; ``AnswerShapeError`` if it lacks what was asked for."""


class SGLang(Dialect):
    name = "sglang"
    chat_capture = _fields(
        logprobs=True,
        return_prompt_token_ids=True,
        return_token_ids=True,
        return_meta_info=True,  # older SGLang has the sampled ids only there
    )
    chat_continue = _fields(continue_final_message=True)
    token_path = "/generate"
    token_path_under_v1 = False
    chat_text = _fields(skip_special_tokens=True, no_stop_trim=False)

    def token_request(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> dict[str, Any]:
        return generate_request(prompt_ids, max_tokens, sampling, seed)

    def read_tokens(self, answer: dict[str, Any]) -> Generated:
        return read_generate(answer)


class VLLM(Dialect):
    name = "vllm"
    chat_capture = _fields(logprobs=True, return_token_ids=True)
    # vLLM refuses ``continue_final_message`` with its default ``add_generation_prompt: true``.
    chat_continue = _fields(continue_final_message=True, add_generation_prompt=False)
    token_path = "/completions"
    token_path_under_v1 = True
    chat_text = _fields(skip_special_tokens=True, include_stop_str_in_output=False)

    def token_request(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> dict[str, Any]:
        return completions_request(model, prompt_ids, max_tokens, sampling, seed)

    def read_tokens(self, answer: dict[str, Any]) -> Generated:
        return read_completions(answer)


class Auto(SGLang):
    """Either engine: chat fields of both; token prompts on SGLang's ``/generate`` (the token
    client moves to vLLM's ``/v1/completions`` where ``/generate`` is not found)."""

    name = "auto"
    chat_capture = _fields(logprobs=True, return_token_ids=True, return_prompt_token_ids=True)
    chat_continue = _fields(continue_final_message=True, add_generation_prompt=False)


#: The dialects by name, in the order the API lists them (``auto`` first: the default).
DIALECTS: dict[str, Dialect] = {entry.name: entry for entry in (Auto(), VLLM(), SGLang())}

if TYPE_CHECKING:
    Engine = str
else:
    #: An engine's name as the API takes it: one of ``DIALECTS`` (validated, and listed in the schema).
    Engine = Literal[tuple(DIALECTS)]

#: The names ``Engine`` accepts.
ENGINES: tuple[str, ...] = tuple(DIALECTS)


def dialect(engine: str) -> Dialect:
    """The dialect named ``engine``; ``ValueError`` naming the known ones for any other name."""
    try:
        return DIALECTS[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(DIALECTS)}") from None


_BUDGET_KEYS = frozenset({"max_tokens", "max_completion_tokens", "max_new_tokens"})


def _entry(item: Any, index: int) -> Any:
    if not isinstance(item, (list, tuple)) or len(item) <= index:
        raise AnswerShapeError(f"output_token_logprobs entry is not [logprob, id, text]: {item!r}")
    return item[index]


def _capture(prompt_ids: Any, output_ids: Any, logprobs: list[float] | None, version: Any) -> TokenCapture:
    prompt = _ids(prompt_ids, "prompt ids")
    output = _ids(output_ids, "output ids")
    if logprobs is not None and len(logprobs) != len(output):
        raise AnswerShapeError(f"{len(logprobs)} logprobs for {len(output)} output ids")
    if logprobs is not None and not math.isfinite(sum(logprobs)):  # a NaN or an infinity anywhere
        logprobs = None  # an engine that gives no number for some token: no logprobs rather than wrong ones
    weight_version = version if isinstance(version, (str, int)) and not isinstance(version, bool) else None
    return TokenCapture(prompt, output, logprobs, weight_version)


def _ids(value: Any, what: str) -> list[int]:
    # set(map(type, ...)) runs in C: a per-item isinstance cost 100 us for a 256-token answer
    if not isinstance(value, list) or not set(map(type, value)) <= _INT:
        raise AnswerShapeError(f"{what} are not a list of integers: {str(value)[:200]}")
    return value


def _floats(values: list[Any]) -> list[float]:
    """Logprobs as floats (an integer 0 is one); anything else is a malformed answer."""
    kinds = set(map(type, values))
    if kinds <= _FLOAT:
        return values
    if kinds <= _NUMBER:
        return [float(v) for v in values]
    raise AnswerShapeError(f"logprobs are not all numbers: {str(values)[:200]}")


_INT = frozenset({int})
_FLOAT = frozenset({float})
_NUMBER = frozenset({int, float})
