"""A session's recorded calls as one trajectory: the path that ended, token-faithful.

The trajectory follows the path from the first call to the one that ended the session (the
last call recorded, or the one ``/end`` names): its messages are that call's messages and its
reply; each call on the path is a turn, its reply the assistant message at the position where
the next call's messages hold it (the engine's own message there, with ``reasoning_content``,
marked ``generated``). Calls off the path (retries, abandoned branches) are not trained on;
``extra_info.gateway`` records the whole tree (each call's parent) and the path.

The turns carry the ids the engine received and sampled, each with its whole prompt
(``prompt_offset`` 0): where a later prompt does not extend an earlier prompt and output (a
template that rewrites history), the trainer's conversion makes one sample per branch
(``buffer.trainer.samples.turns``). Without ids from every call on the path (an engine that ignores the
capture fields) the trajectory is text only.
"""

from __future__ import annotations

from typing import Any

from buffer.logprob_kinds import logprobs_kind
from buffer.service.gateway.calls import Call
from buffer.service.gateway.sessions import Session
from buffer.service.gateway.tree import path_to, whole_messages

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


class NothingRecorded(ValueError):
    """The session made no call, so there is no trajectory to write."""


def assemble(session: Session, reward: Any, *, end: int | None = None) -> dict[str, Any]:
    calls = session.calls
    if not calls:
        raise NothingRecorded(f"session {session.session_id} made no chat completion")
    end = len(calls) - 1 if end is None else end
    if not 0 <= end < len(calls):
        raise IndexError(f"the session has calls 0 to {len(calls) - 1}, not {end}")
    path = path_to(calls, end)
    last = calls[end]
    messages: list[dict[str, Any]] = [dict(message) for message in whole_messages(calls, end)]
    messages.append(_reply(last))
    turns: list[dict[str, Any]] | None = []
    position = -1
    for index in path:
        call = calls[index]
        position += len(call.messages) + 1  # the call's own messages, then its reply
        messages[position] = _reply(call)
        if turns is not None and call.tokens is not None:
            turns.append(_turn(call, position))
        else:
            turns = None
    trajectory: dict[str, Any] = {
        "uid": f"session-{session.session_id}",
        "instance_id": session.instance_id,
        "task_type": session.task_type,
        "messages": messages,
        "reward": reward,
        "extra_info": {
            **session.metadata,
            "finish_reason": _finish_reason(last),
            "gateway": {
                "session_id": session.session_id,
                "calls": len(calls),
                "parents": [call.parent for call in calls],
                "path": path,
            },
        },
    }
    if last.tools:
        trajectory["tools"] = last.tools
    if turns:
        trajectory["turns"] = turns
    return trajectory


def _reply(call: Call) -> dict[str, Any]:
    reply = {key: value for key, value in call.reply.items() if value is not None or key == "content"}
    if reply.get("content") is None and not reply.get("tool_calls"):
        reply["content"] = ""
    reply["role"] = "assistant"
    reply["generated"] = True
    return reply


def _finish_reason(call: Call) -> str:
    return call.finish_reason if call.finish_reason in FINISH_REASONS else "stop"


def _turn(call: Call, position: int) -> dict[str, Any]:
    tokens = call.tokens
    assert tokens is not None
    return {
        "prompt_ids": tokens["prompt_ids"],
        "prompt_offset": 0,
        "output_ids": tokens["output_ids"],
        "output_logprobs": tokens.get("output_logprobs"),
        "finish_reason": _finish_reason(call),
        "message_index": position,
        "weight_version": tokens.get("weight_version"),
        "sampling": call.sampling or None,
        **_logprobs_kind(call),
    }


def _logprobs_kind(call: Call) -> dict[str, Any]:
    """What the call's logprobs are (``buffer.logprob_kinds``), from the engine that answered
    and the agent's sampling fields; nothing without logprobs."""
    tokens = call.tokens or {}
    if tokens.get("output_logprobs") is None:
        return {}
    return {"logprobs": logprobs_kind(tokens.get("engine") or "auto", call.sampling)}
