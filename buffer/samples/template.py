"""What a chat template writes around an assistant message, found by rendering probe conversations.

Three things locate every assistant turn in a rendered conversation, whatever the template:

- the generation prompt: what ``add_generation_prompt=True`` appends ("<|im_start|>assistant\\n",
  "<|start_header_id|>assistant<|end_header_id|>\\n\\n", Qwen3's "<|im_start|>assistant\\n<think>\\n");
- the assistant headers: the generation prompt, and the shorter prefix of it that the template writes before
  a reply it renders differently (Qwen3 writes "<|im_start|>assistant\\n" without "<think>\\n" before
  the replies that precede the last user query; DeepSeek-R1-distill writes "<｜Assistant｜>" without it);
- the end-of-turn token: the first added token the template writes after a reply ("<|im_end|>",
  "<|eot_id|>", "<｜end▁of▁sentence｜>").

Nothing here is a table of known templates: each is read off the tokenizer's own template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from buffer.samples.sample import SampleConversionError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_QUESTION = "ROLLOUT_BUFFER_PROBE_QUESTION"
_FOLLOW_UP = "ROLLOUT_BUFFER_PROBE_FOLLOW_UP"
_REPLY = "ROLLOUT_BUFFER_PROBE_REPLY"


@dataclass(frozen=True, slots=True)
class ChatTemplateAnalysis:
    """The strings that delimit an assistant turn in one tokenizer's chat template."""

    generation_prompt: str
    headers: tuple[str, ...]  # longest first; the last (shortest) is the one searched for
    end_of_turn: str

    @property
    def search_header(self) -> str:
        return self.headers[-1]

    def header_at(self, text: str, position: int) -> str:
        """The longest assistant header that ``text`` has at ``position``."""
        for header in self.headers:
            if text.startswith(header, position):
                return header
        raise SampleConversionError(f"no assistant header at character {position}")


Tools = Sequence[Mapping[str, Any]]


def template_tools(tools: Tools | None) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """Tool schemas as ``apply_chat_template`` takes them."""
    return None if tools is None else [dict(tool) for tool in tools]


@cache
def template_errors() -> tuple[type[Exception], ...]:
    """What a failing chat template raises: jinja2's errors (its raise_exception too), and bad input."""
    errors: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError)
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders templates with jinja2
        return errors
    return (TemplateError, *errors)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Tools | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The conversation as the chat template writes it."""
    text = tokenizer.apply_chat_template(
        list(messages),
        tools=template_tools(tools),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    if not isinstance(text, str):
        raise SampleConversionError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def added_token_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's added and special tokens: the markers a template writes between messages.

    Not only those flagged special: real tokenizers add "<｜Assistant｜>" or "<think>" as plain added tokens.
    """
    strings = {str(token) for token in tokenizer.added_tokens_decoder.values()}
    strings.update(str(token) for token in tokenizer.all_special_tokens)
    return sorted((s for s in strings if s), key=len, reverse=True)


def analyse_chat_template(
    tokenizer: PreTrainedTokenizerBase, *, tools: Tools | None = None
) -> ChatTemplateAnalysis:
    """Render a few probe conversations and read the assistant turn's delimiters off them."""
    try:
        return _analyse(tokenizer, tools)
    except SampleConversionError:
        raise
    except template_errors() as exc:
        raise SampleConversionError(f"the chat template cannot render a probe conversation: {exc}") from exc


def _analyse(tokenizer: PreTrainedTokenizerBase, tools: Tools | None) -> ChatTemplateAnalysis:
    question = {"role": "user", "content": _QUESTION}
    reply = {"role": "assistant", "content": _REPLY}
    follow_up = {"role": "user", "content": _FOLLOW_UP}
    markers = added_token_strings(tokenizer)

    bare = render_chat(tokenizer, [question], tools=tools)
    prompted = render_chat(tokenizer, [question], tools=tools, add_generation_prompt=True)
    if not prompted.startswith(bare) or len(prompted) == len(bare):
        raise SampleConversionError(
            "the chat template writes no generation prompt after the messages "
            "(add_generation_prompt=True adds nothing), so assistant turns cannot be found"
        )
    generation_prompt = prompted[len(bare) :]

    headers = {generation_prompt}
    last = render_chat(tokenizer, [question, reply], tools=tools)
    history = render_chat(tokenizer, [question, reply, follow_up], tools=tools)
    for probe in (last, history):
        at = probe.find(_REPLY)
        if at < 0:
            raise SampleConversionError("the chat template does not write an assistant message's content")
        length = _header_length_before(probe[:at], generation_prompt, markers)
        if length:
            headers.add(generation_prompt[:length])

    after_reply = last[last.find(_REPLY) + len(_REPLY) :]
    return ChatTemplateAnalysis(
        generation_prompt=generation_prompt,
        headers=tuple(sorted(headers, key=len, reverse=True)),
        end_of_turn=_first_marker(after_reply, markers),
    )


def _header_length_before(before: str, generation_prompt: str, markers: list[str]) -> int:
    """How much of the generation prompt the template wrote right before a reply (0: none of it).

    A prefix counts only if it holds the prompt's first marker whole ("<|im_start|>"), so that a lone
    "\\n" or "<" can never pass for a header.
    """
    found = [(generation_prompt.find(m), -len(m), m) for m in markers if m in generation_prompt]
    if found:
        at, _, marker = min(found)
        least = at + len(marker)
    else:
        least = len(generation_prompt)
    for length in range(len(generation_prompt), least - 1, -1):
        if before.endswith(generation_prompt[:length]):
            return length
    return 0


def _first_marker(text: str, markers: list[str]) -> str:
    """The added token that occurs first in ``text`` (the longest, if several start there)."""
    best: tuple[int, int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or (at, -len(marker)) < best[:2]):
            best = (at, -len(marker), marker)
    if best is None:
        raise SampleConversionError(
            "the chat template writes no added or special token after an assistant message, "
            "so the end of an assistant turn cannot be found"
        )
    return best[2]
