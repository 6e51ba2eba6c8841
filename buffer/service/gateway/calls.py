"""One recorded chat completion of a session (``Call``), and its form in the journal.

A leaf: the sessions' state (``sessions``), the tree of calls (``tree``), the trajectory
(``assembly``) and the gateway (``service``) all read calls; a call knows none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class Call:
    """One chat completion the agent made: what the engine was sent and what it answered.

    ``messages`` are those after the parent's messages and reply (all of them for a root):
    a session of n turns keeps each message once, not n times (``tree.whole_messages``).
    ``role`` is what the agent named the call (``x-rollout-role``, ``metadata.role``);
    ``request`` the digest of the agent's request body (an SDK's retry repeats it); ``choice``
    the choice of that request (``n > 1``: one call per choice, siblings); ``asked`` the
    agent's own values of the sampling fields the session pinned (``sampling`` is what the
    engine was sent)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    reply: dict[str, Any]  # the assistant message, as the engine answered it
    finish_reason: str
    #: prompt_ids, output_ids, output_logprobs, weight_version, engine (the one that answered, where
    #: its answer shows it); None from an engine without ids
    tokens: dict[str, Any] | None
    parent: int | None
    at: float
    role: str | None = None
    request: str | None = None
    choice: int = 0
    asked: dict[str, Any] | None = None
    completion: str | None = None
    text_end: list[Any] | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "messages": self.messages,
                "tools": self.tools,
                "sampling": self.sampling,
                "reply": self.reply,
                "finish_reason": self.finish_reason,
                "tokens": self.tokens,
                "parent": self.parent,
                "at": self.at,
                "role": self.role,
                "request": self.request,
                "choice": self.choice,
                "asked": self.asked,
                **({"completion": self.completion} if self.completion is not None else {}),
                **({"text_end": self.text_end} if self.text_end is not None else {}),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Call:
        if type(raw) is Encoded:
            return raw.call
        data = orjson.loads(raw)
        return cls(**data)

    def encoded(self) -> Encoded:
        """The call's JSON, for the journal, carrying the call itself: the sessions' state takes
        it as it is (``from_json``), not a decoding of its JSON (a call's dicts are its request's
        and its answer's, which nothing changes once the call is made)."""
        record = Encoded(self.to_json())
        record.call = self
        return record


class Encoded(bytes):
    """A call's JSON, and the call."""

    call: Call
