"""A request's prompt as the simulated model reads it, kept for the group's other samples.

A chat request's messages are rendered with the chat template (a final assistant message to
continue, as the imitated engine renders it: ``engines.Dialect.continues_by``); a token prompt
(``/generate``, ``/v1/completions``) is decoded and read back into messages. Either way the model plans the
replies it may give (``replies.plan_reply``) and finds the assistant reply the prompt ends in,
if any, to continue it. A group's samples send the same prompt, so each is read once: the last
``RENDER_CACHE_SIZE`` prompts of each kind are kept (the oldest dropped first).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from buffer.simulator.conversation import SimMessage, parse_prompt
from buffer.simulator.engines import Dialect
from buffer.simulator.model import RENDER_CACHE_SIZE, OpenReply, SimModel, remember
from buffer.simulator.protocol import ChatMessage, ChatRequest
from buffer.simulator.replies import ReplyPlan, plan_reply


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A token prompt's reply plan, and the reply so far it ends in (ids and text), if any."""

    plan: ReplyPlan
    partial_ids: list[int] | None
    partial_text: str | None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's prompt as the model reads it: its ids, the replies it may get, the
    assistant reply it ends in (``continue_final_message``), whether the model reasons first."""

    ids: array[int]
    plan: ReplyPlan
    open_reply: OpenReply | None
    thinking: bool


class Prompts:
    """The prompts read so far, of chat requests and of token prompts."""

    def __init__(self, model: SimModel, dialect: Dialect) -> None:
        self.model = model
        self.dialect = dialect  # how a final assistant message is continued
        self._chat: dict[bytes, ChatPrompt] = {}
        self._tokens: dict[bytes, TokenPrompt] = {}

    def chat(self, request: ChatRequest) -> ChatPrompt:
        """The prompt of a chat request; ``ValueError`` if it cannot be rendered."""
        key = _chat_prompt_key(request)
        prompt = self._chat.get(key) if key is not None else None
        if prompt is None:
            prompt = self._read_chat(request)
            if key is not None:
                remember(self._chat, key, prompt, RENDER_CACHE_SIZE)
        return prompt

    def _read_chat(self, request: ChatRequest) -> ChatPrompt:
        model = self.model
        continuing = request.continue_final_message and request.messages[-1].role == "assistant"
        tools = request.tools or []
        template_kwargs = request.chat_template_kwargs or {}
        rendered = [_template_message(message) for message in request.messages]
        if continuing and self.dialect.continues_by == "prefix":
            prompt_ids = model.render(
                rendered[:-1], tools, False, template_kwargs, prefix=request.messages[-1].text()
            )
        else:
            prompt_ids = model.render(rendered, tools, continuing, template_kwargs)
        thinking = model.thinking and template_kwargs.get("enable_thinking", True) is not False
        history = request.messages[:-1] if continuing else request.messages
        plan = plan_reply(
            [SimMessage(m.role, m.text()) for m in history], tools, request.tool_choice, thinking
        )
        open_reply = model.open_reply(prompt_ids) if continuing else None
        return ChatPrompt(array("i", prompt_ids), plan, open_reply, thinking)

    def tokens(self, prompt_ids: list[int]) -> TokenPrompt:
        """The reply plan for a rendered prompt, recovered from its text, and the reply it continues.

        The ids must be in the vocabulary (``Simulator.bad_ids``)."""
        key = array("i", prompt_ids).tobytes()
        cached = self._tokens.get(key)
        if cached is not None:
            return cached
        model = self.model
        conversation = parse_prompt(model.decode(prompt_ids, skip_special_tokens=False))
        open_reply = model.open_reply(prompt_ids)
        thinking = model.thinking and not (open_reply is not None and open_reply.thinking_off)
        plan = plan_reply(conversation.messages, conversation.tools, "auto", thinking)
        if open_reply is None:
            prompt = TokenPrompt(plan, None, None)
        else:
            prompt = TokenPrompt(plan, open_reply.ids, open_reply.text)
        return remember(self._tokens, key, prompt, RENDER_CACHE_SIZE)


def _chat_prompt_key(request: ChatRequest) -> bytes | None:
    """What a chat request's prompt depends on, as bytes; None if it cannot be written as JSON."""
    messages = [
        (message.role, message.content, message.tool_calls, message.tool_call_id, message.model_extra)
        for message in request.messages
    ]
    key = [messages, request.tools, request.continue_final_message, request.chat_template_kwargs]
    try:
        return orjson.dumps([*key, request.tool_choice])
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, say
        return None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template reads it: text content, tool calls as sent."""
    rendered: dict[str, Any] = message.model_dump(exclude_none=True)
    rendered["content"] = message.text() if message.content is not None else None
    return rendered
