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
import logging
import time
from collections.abc import Sequence
from typing import Any

from buffer.toolkit.engines import (
    DIALECTS,
    TOKEN_ROUTE_MISSING,
    Engine,
    Generated,
    ToolCallParser,
    dialect,
    hermes_tool_calls,
    split_reasoning,
)
from buffer.toolkit.llm import EngineClient, LLMError, _sampling_record, engine_base_url, engine_root_url
from buffer.toolkit.parts import continued, step_of
from buffer.toolkit.types import Completion, Message, TokenCapture

logger = logging.getLogger(__name__)

__all__ = [
    "TemplateError",
    "TokenClient",
    "TokenRenderer",
    "TokenizerMissing",
    "ToolCallParser",
    "hermes_tool_calls",
    "load_tokenizer",
    "split_reasoning",
    "tokenizer_for",
]

_PROBE = "\u2063probe\u2063"  # a text no template writes, to find where content sits


class TokenizerMissing(RuntimeError):
    """Token-in/token-out mode needs ``transformers``, which the base install leaves out."""


class TemplateError(ValueError):
    """The chat template cannot render an observation without rewriting earlier tokens."""


def load_tokenizer(path: str, *, local_files_only: bool = False) -> Any:
    """The served model's tokenizer (a local directory or a Hub name), via ``transformers``;
    ``local_files_only``: a Hub name only from the local cache, never downloaded."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerMissing(
            "token-in/token-out mode renders prompts with the served model's tokenizer and needs "
            "transformers: pip install 'rollout-buffer[train]' (no torch is pulled)"
        ) from exc
    return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)


def tokenizer_for(path: str | None, token_mode: bool | None, task: str = "") -> Any:
    """The tokenizer token mode renders with, or ``None`` for chat mode.

    ``token_mode`` true needs ``path`` and fails saying why it cannot load; false is chat mode.
    None (the default) is token mode when ``path`` loads (a Hub name only from the local cache:
    the default downloads nothing), else chat mode, said in the log: a path that does not load
    must not stop a run that the chat protocol can make."""
    if token_mode is False:
        return None
    if not path:
        if token_mode:
            raise ValueError(
                "token_mode needs tokenizer_path: the served model's tokenizer renders the prompts"
            )
        return None
    if token_mode:
        return load_tokenizer(path)
    try:
        return load_tokenizer(path, local_files_only=True)
    except (TokenizerMissing, OSError, ValueError) as exc:
        logger.warning(
            "%s: chat mode: tokenizer_path %r does not load for token in, token out (%s); set "
            "token_mode: true to fail instead (and to download a Hub name), false to choose chat mode",
            task,
            path,
            exc,
        )
        return None


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
    post to ``<root>/generate``, "vllm" to ``<base>/v1/completions``; with "auto", a server
    where ``/generate`` is not found (404) is asked at ``/v1/completions`` from then on.
    Pass the conversation's last completion as ``previous`` and the prompt is extended from its
    ids; without it the prompt is rendered from ``messages``. Each part of an aborted answer is
    checked against the answer so far where the engine reports the prompt it received (vLLM):
    one that differs is recorded from its own prompt, never spliced (``llm.continued``)."""

    mode = "token"

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
        #: The dialect whose token route is asked: ``auto`` starts with SGLang's ``/generate``.
        self.route = DIALECTS["sglang"] if self.dialect.name == "auto" else self.dialect
        route = self.route
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
        record = TokenCapture(prompt, [], [])
        sampled: list[int] = []  # every id sampled, whatever prompt each part had
        attempts = 0
        continuations = counted = 0  # counted: those of aborts no pause made (``_pauses``)
        mismatched = 0
        empty_in_a_row = 0
        finish_reason = "stop"
        while True:
            remaining = None if budget is None else budget - len(sampled)
            sent = [*record.prompt_ids, *record.output_ids]
            pauses = self._pauses()
            part, tries = await self._ask(sent, remaining, sampling, seed)
            attempts += tries
            sampled += part.output_ids
            step = step_of(part, sent)
            record, extended = continued(record, step)
            if not extended:
                mismatched += 1
                self._tell_once(
                    "continuation mismatch",
                    "the policy server reports a prompt that is not the one sent (%d ids for %d); the "
                    "answer's part is recorded from the prompt it reports (said once; "
                    "extra_info.mismatched_continuations counts them)",
                    len(step.prompt_ids),
                    len(sent),
                )
            finish_reason = part.finish_reason
            if finish_reason == "abort":
                if budget is not None and len(sampled) >= budget:
                    finish_reason = "length"
                elif self._pauses() != pauses or counted < self.continuation.max_continuations:
                    counted += self._pauses() == pauses
                    continuations += 1
                    empty_in_a_row = 0 if part.output_ids else empty_in_a_row + 1
                    wait_s = self.continuation.backoff_s(empty_in_a_row)
                    if wait_s:
                        await asyncio.sleep(wait_s)
                    continue
            break
        record.engine = self.route.name  # which engine answered: what its logprobs are depends on it
        text = self.renderer.decode(sampled)
        reasoning, content = split_reasoning(text) if self.reasoning else (None, text)
        content, calls = self.tool_parser(content)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return Completion(
            text=content,
            finish_reason=finish_reason,
            tool_calls=calls or None,
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(sampled)},
            latency_s=time.monotonic() - started,
            attempts=attempts,
            continuations=continuations,
            reasoning_content=reasoning,
            tokens=record,
            sampling=_sampling_record(sampling, seed),
            mode="token",
            mismatched_continuations=mismatched,
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

    async def _ask(
        self, prompt: list[int], remaining: int | None, sampling: dict[str, Any], seed: int | None
    ) -> tuple[Generated, int]:
        """One answer of the token route; with ``auto``, vLLM's once SGLang's is not found."""
        route = self.route
        try:
            return await self._generate(route, self.model, prompt, remaining, sampling, seed)
        except LLMError as exc:
            if self.dialect.name != "auto" or route.name != "sglang" or exc.status not in TOKEN_ROUTE_MISSING:
                raise
        self.route = DIALECTS["vllm"]
        self._tell_once(
            "token route",
            "engine auto: the policy server has no /generate; asking vLLM's /v1/completions instead",
        )
        part, tries = await self._generate(self.route, self.model, prompt, remaining, sampling, seed)
        return part, tries + 1


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
