"""``SimModel``: the tokenizer and chat template the simulated engine serves, with fast paths.

Prompts are rendered by the tokenizer's own ``apply_chat_template``, so the prompt ids the
simulator reports are exactly those a client gets from the same tokenizer. Encoding and decoding
of replies go to the Rust tokenizer directly, and each id's text is decoded once at start-up:
at thousands of requests in flight, the simulator's own CPU time per request is what limits it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson

from buffer.simulator.conversation import EMPTY_THINK, IM_START

RENDER_CACHE_SIZE = 1024  # prompts; a group's samples are in flight together
REPLY_CACHE_SIZE = 4096  # texts of replies (a prompt's drafts are a handful)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(cache: dict[_K, _V], key: _K, value: _V, size: int) -> _V:
    """``cache[key] = value``, the oldest entry dropped first once ``cache`` holds ``size``."""
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


@dataclass(frozen=True, slots=True)
class OpenReply:
    """The assistant turn a prompt ends in: its text so far, and that text's ids in the prompt."""

    ids: list[int]
    text: str
    thinking_off: bool


class SimModel:
    def __init__(self, tokenizer: PreTrainedTokenizerFast, thinking: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        template = tokenizer.chat_template
        self.thinking = ("<think>" in str(template)) if thinking is None else thinking
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(eos, int) or eos == tokenizer.unk_token_id:
            raise ValueError("the tokenizer has no <|im_end|> token: the simulator needs a ChatML tokenizer")
        self.eos_id: int = eos
        start = tokenizer.convert_tokens_to_ids(IM_START)
        assert isinstance(start, int)
        self.im_start_id: int = start
        self.vocab_size = len(tokenizer)
        self.token_text = [
            self._backend.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)
        ]
        #: Each id's text as UTF-8 bytes, as chat logprobs list them.
        self.token_bytes = [list(text.encode()) for text in self.token_text]
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # The prompts of a group's samples are the same: rendered once (oldest dropped first).
        self._rendered: dict[bytes, array[int]] = {}
        # The drafts of a prompt are the same for each of its samples: encoded once.
        self._replies: dict[str, tuple[int, ...]] = {}
        self._header = self.encode("assistant\n")
        self._empty_think = self.encode(EMPTY_THINK)

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_reply(self, text: str) -> tuple[int, ...]:
        """``encode(text)`` of a reply text, from a cache: a group's samples draw the same drafts."""
        ids = self._replies.get(text)
        if ids is None:
            ids = remember(self._replies, text, tuple(self.encode(text)), REPLY_CACHE_SIZE)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        prefix: str | None = None,
    ) -> list[int]:
        """The ids of ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``.

        With ``continue_final_message``, the final assistant message is left open instead, as
        transformers renders it (vLLM's way: the template writes the reply so far again, and
        refuses one it cannot find again). With ``prefix``, that text follows the generation
        prompt (SGLang's way: ``messages`` without the reply so far, then the reply's text).
        Either way the prompt is encoded as one text. Raises ``ValueError`` for messages the
        template cannot render."""
        from jinja2 import TemplateError  # the sim extra's, as transformers is

        key = orjson.dumps([messages, tools, continue_final_message, template_kwargs, prefix])
        cached = self._rendered.get(key)
        if cached is None:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=list(tools or []) or None,
                    tokenize=False,
                    add_generation_prompt=not continue_final_message,
                    continue_final_message=continue_final_message,
                    **(template_kwargs or {}),
                )
            except TemplateError as exc:
                raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
            # What apply_chat_template(tokenize=True) does next, without its Python wrapping.
            ids = array("i", self.encode(cast(str, text) + (prefix or "")))  # 4 bytes an id, not 36
            cached = remember(self._rendered, key, ids, RENDER_CACHE_SIZE)
        return list(cached)

    def open_reply(self, prompt_ids: Sequence[int]) -> OpenReply | None:
        """The assistant turn ``prompt_ids`` ends in, after its generation prompt; else None."""
        try:
            start = len(prompt_ids) - 1 - list(reversed(prompt_ids)).index(self.im_start_id)
        except ValueError:
            return None
        body = list(prompt_ids[start + 1 :])
        if body[: len(self._header)] != self._header or self.eos_id in body:
            return None
        body = body[len(self._header) :]
        thinking_off = body[: len(self._empty_think)] == self._empty_think
        if thinking_off:
            body = body[len(self._empty_think) :]
        return OpenReply(body, self.decode(body, skip_special_tokens=False), thinking_off)
