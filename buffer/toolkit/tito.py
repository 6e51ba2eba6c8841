"""Token in, token out: the toolkit renders the prompt and the engine only samples.

The chat protocol hands the engine messages and gets text back; each turn the engine renders the
whole conversation again, and what the trainer sees is a re-tokenisation of text. Here the
client holds the token ids instead (what slime's agent trajectories, AReaL and verifiers do):

- the first prompt is rendered once with the served model's tokenizer and chat template;
- each later prompt is the previous one, plus the ids the engine sampled, plus the tokens of the
  *observation* (the template's end of the assistant turn, the tool or user messages and the next
  generation prompt), so no earlier token is ever re-tokenised;
- the engine is SGLang's ``/generate`` or vLLM's ``/v1/completions`` with a token prompt, and an
  aborted answer is continued from its ids (prompt + output so far), logprobs concatenated;
- the model's tool calls are parsed here, from the decoded text (``hermes_tool_calls``:
  Qwen/Hermes ``<tool_call>{json}</tool_call>``; pass another ``ToolCallParser`` for other
  formats), and ``<think>...</think>`` becomes ``reasoning_content``.

The observation's text is what the template writes after an assistant turn: the rest of its
end of turn that the model did not sample (``"\n"`` after Qwen's ``<|im_end|>``), then the new
messages and the generation prompt, as rendered in a short conversation (a user message, a
stand-in assistant turn, the new messages), whatever the history. A template that cannot be
read that way is refused (``TemplateError``), never spliced.

``transformers`` is an optional extra (``pip install 'rollout-buffer[train]'``): the toolkit loads
it only in this mode, and says so when it is missing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from buffer.toolkit.engines import AnswerShapeError, Engine, Generated, dialect
from buffer.toolkit.llm import EngineClient, LLMError, _sampling_record, engine_base_url, engine_root_url
from buffer.toolkit.types import Completion, Message, TokenCapture

#: ``parser(text) -> (content, tool_calls)``: the text without the calls, and the calls in
#: OpenAI's form (``{"id", "type": "function", "function": {"name", "arguments": str}}``).
ToolCallParser = Callable[[str], tuple[str, list[dict[str, Any]]]]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_BUDGET_KEYS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
_PROBE = "\u2063probe\u2063"  # a text no template writes, to find where content sits


class TokenizerMissing(RuntimeError):
    """Token-in/token-out mode needs ``transformers``, which the base install leaves out."""


class TemplateError(ValueError):
    """The chat template cannot render an observation without rewriting earlier tokens."""


def load_tokenizer(path: str) -> Any:
    """The served model's tokenizer (a local directory or a Hub name), via ``transformers``."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerMissing(
            "token-in/token-out mode renders prompts with the served model's tokenizer and needs "
            "transformers: pip install 'rollout-buffer[train]' (no torch is pulled)"
        ) from exc
    return AutoTokenizer.from_pretrained(path)


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


class TokenRenderer:
    """Prompts and observations as token ids, with one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._turn_end: str | None = None

    def render(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None, *, prompt: bool
    ) -> str:
        text: str = self.tokenizer.apply_chat_template(
            [_for_template(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=prompt,
            tokenize=False,
            **self.kwargs,
        )
        return text

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def first_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """The whole first prompt, generation prompt included (the template writes any BOS)."""
        return self.encode(self.render(messages, tools, prompt=True))

    def observation(
        self,
        assistant: Message,
        new: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        output_ids: Sequence[int],
    ) -> list[int]:
        """The tokens that follow an assistant turn whose sampled ids were ``output_ids``: the
        rest of the template's end of turn, the ``new`` messages and the generation prompt."""
        return self.encode(self._closing(output_ids) + self._suffix(assistant, new, tools))

    def _suffix(
        self, assistant: Message, new: Sequence[Message], tools: Sequence[dict[str, Any]] | None
    ) -> str:
        """What the template writes for ``new`` after an assistant turn's end, generation prompt
        included. Rendered after a stand-in assistant turn, so a template that rewrites earlier
        turns once later messages come (Qwen3 drops their reasoning) changes nothing here; if the
        template refuses the stand-in, after the real assistant message."""
        user = {"role": "user", "content": "?"}
        turn_end = self._template_turn_end()
        try:
            full = self.render([user, {"role": "assistant", "content": _PROBE}, *new], tools, prompt=True)
        except Exception:  # a template that checks tool results against tool calls
            full = ""
        at = full.find(_PROBE)
        if at >= 0 and full.startswith(turn_end, at + len(_PROBE)):
            return full[at + len(_PROBE) + len(turn_end) :]
        base = self.render([user, assistant], tools, prompt=False)
        full = self.render([user, assistant, *new], tools, prompt=True)
        if not full.startswith(base):
            raise TemplateError(
                "the chat template renders the conversation differently once later messages are "
                "added; its observation tokens cannot be appended without re-tokenising"
            )
        return full[len(base) :]

    def _closing(self, output_ids: Sequence[int]) -> str:
        """What the template writes after an assistant turn's content that the model did not
        sample: ``"\\n"`` after Qwen's ``<|im_end|>``; all of ``"<|im_end|>\\n"`` after a stop string."""
        turn_end = self._template_turn_end()
        if output_ids:
            last = self.tokenizer.decode([output_ids[-1]], skip_special_tokens=False)
            if last and turn_end.startswith(last):
                return turn_end[len(last) :]
        return turn_end

    def _template_turn_end(self) -> str:
        if self._turn_end is None:
            user = {"role": "user", "content": "?"}
            head = self.render([user], None, prompt=True)
            base = self.render([user, {"role": "assistant", "content": _PROBE}], None, prompt=False)
            at = base.rfind(_PROBE)
            if not base.startswith(head) or at < 0:
                raise TemplateError("cannot find where the chat template ends an assistant turn")
            self._turn_end = base[at + len(_PROBE) :]
        return self._turn_end


class TokenClient(EngineClient):
    """A policy client in token-in/token-out mode, with the chat client's ``complete``.

    ``engine`` names the dialect's token route (``engines.DIALECTS``): "sglang" (and "auto")
    post to ``<root>/generate``, "vllm" to ``<base>/v1/completions``.
    Pass the conversation's last completion as ``previous`` and the prompt is extended from its
    ids; without it the prompt is rendered from ``messages``."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        renderer: TokenRenderer,
        *,
        engine: Engine = "sglang",
        model: str = "default",
        tool_parser: ToolCallParser = hermes_tool_calls,
        reasoning: bool = True,
        **client: Any,
    ) -> None:
        self.dialect = dialect(engine)  # ValueError for a name the table does not have, before any I/O
        super().__init__(**client)
        self.renderer = renderer
        self.engine = engine
        self.model = model
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        route = self.dialect
        at = engine_base_url if route.token_path_under_v1 else engine_root_url
        self._engines(base_url, lambda url: at(url) + route.token_path)

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        previous: Completion | None = None,
        **sampling: Any,
    ) -> Completion:
        started = time.monotonic()
        prompt = self.prompt_ids(messages, tools, previous)
        budget = sampling.get(
            "max_tokens", sampling.get("max_completion_tokens", sampling.get("max_new_tokens"))
        )
        output: list[int] = []
        logprobs: list[float] | None = []
        attempts = 0
        continuations = 0
        empty_in_a_row = 0
        version: str | int | None = None
        finish_reason = "stop"
        while True:
            remaining = None if budget is None else budget - len(output)
            answer, tries = await self._post(self._request(prompt + output, remaining, sampling, seed))
            attempts += tries
            part = self._read(answer)
            output += part.output_ids
            if logprobs is not None and part.output_logprobs is not None:
                logprobs += part.output_logprobs
            else:
                logprobs = None
            version = part.weight_version if part.weight_version is not None else version
            finish_reason = part.finish_reason
            if finish_reason == "abort":
                if budget is not None and len(output) >= budget:
                    finish_reason = "length"
                elif continuations < self.continuation.max_continuations:
                    continuations += 1
                    empty_in_a_row = 0 if part.output_ids else empty_in_a_row + 1
                    wait_s = self.continuation.backoff_s(empty_in_a_row)
                    if wait_s:
                        await asyncio.sleep(wait_s)
                    continue
            break
        text = self.renderer.decode(output)
        reasoning, content = split_reasoning(text) if self.reasoning else (None, text)
        content, calls = self.tool_parser(content)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return Completion(
            text=content,
            finish_reason=finish_reason,
            tool_calls=calls or None,
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(output)},
            latency_s=time.monotonic() - started,
            attempts=attempts,
            continuations=continuations,
            reasoning_content=reasoning,
            tokens=TokenCapture(prompt, output, logprobs, version),
            sampling=_sampling_record(sampling, seed),
        )

    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None, previous: Completion | None
    ) -> list[int]:
        """The prompt of the next turn: rendered once, then only ever extended."""
        if previous is None or previous.tokens is None:
            return self.renderer.first_prompt(messages, tools)
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise ValueError("a previous completion but no assistant message in the conversation")
        tokens = previous.tokens
        observation = self.renderer.observation(
            messages[last], messages[last + 1 :], tools, tokens.output_ids
        )
        return [*tokens.prompt_ids, *tokens.output_ids, *observation]

    def _request(
        self, prompt: list[int], remaining: int | None, sampling: dict[str, Any], seed: int | None
    ) -> dict[str, Any]:
        return self.dialect.token_request(self.model, prompt, remaining, sampling, seed)

    def _read(self, answer: dict[str, Any]) -> Generated:
        try:
            return self.dialect.read_tokens(answer)
        except AnswerShapeError as exc:
            raise LLMError(f"the policy server's answer is malformed: {exc}") from exc


def _for_template(message: Message) -> Message:
    """A message as chat templates expect it: no toolkit keys, tool-call arguments as objects
    (templates write them with ``tojson``, which would quote a JSON string)."""
    out = {key: value for key, value in message.items() if key != "generated"}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(function, dict) and isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = arguments
                call = {**call, "function": {**function, "arguments": parsed}}
            fixed.append(call)
        out["tool_calls"] = fixed
    if out.get("content") is None:
        out["content"] = ""
    return out
