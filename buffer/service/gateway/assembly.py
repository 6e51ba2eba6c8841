"""A session's recorded calls as trajectories: one per conversation, token-faithful.

The main trajectory follows the path from the first call to the one that ended the session
(the last call recorded, or the one ``/end`` names): its messages are that call's messages and
its reply; each call on the path is a turn, its reply the assistant message at the position
where the next call's messages hold it (the engine's own message there, with
``reasoning_content``, marked ``generated``). Every other conversation (a planner, a
summariser, a sub-agent, a compaction: each other leaf of the call tree, ``tree.chains``) is a
trajectory of its own, named by the role the agent gave its calls; a retry the agent made is
not trained on. ``extra_info.gateway`` records the whole tree (each call's parent), the
chains and the trajectory's path; ``extra_info.role`` the chain's role.

The turns carry the ids the engine received and sampled, each with its whole prompt
(``prompt_offset`` 0): where a later prompt does not extend an earlier prompt and output (a
template that rewrites history), the trainer's conversion makes one sample per branch
(``buffer.trainer.samples.turns``). Without ids from every call on the path (an engine that ignores the
capture fields) the trajectory is text only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from buffer.logprob_kinds import logprobs_kind
from buffer.service.gateway.calls import Call
from buffer.service.gateway.sessions import Session
from buffer.service.gateway.tree import chains, whole_messages

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


class NothingRecorded(ValueError):
    """The session made no call, so there is no trajectory to write."""


def assemble(session: Session, reward: Any, *, end: int | None = None) -> dict[str, Any]:
    """The main chain's trajectory: the path to ``end`` (default: the last call)."""
    return assemble_chains(session, reward, end=end)[0]


def assemble_chains(session: Session, reward: Any, *, end: int | None = None) -> list[dict[str, Any]]:
    """One trajectory per conversation of the session (``tree.chains``): the main chain's first
    (uid ``session-<id>``, the session's instance), then each other's (uid
    ``session-<id>-<chain>``, instance ``<instance>#<chain>``: its own group, so the planners of a
    prompt's sessions are compared with each other, never with its solvers)."""
    calls = session.calls
    if not calls:
        raise NothingRecorded(f"session {session.session_id} made no chat completion")
    end = len(calls) - 1 if end is None else end
    if not 0 <= end < len(calls):
        raise IndexError(f"the session has calls 0 to {len(calls) - 1}, not {end}")
    paths = chains(calls, end)
    tree = {
        "session_id": session.session_id,
        "calls": len(calls),
        "parents": [call.parent for call in calls],
    }
    if len(paths) > 1:
        tree["chains"] = paths
    trajectories = []
    for number, (path, (role, name)) in enumerate(zip(paths, chain_names(calls, paths), strict=True)):
        trajectory = _trajectory(session, reward, path, {**tree, "path": path})
        extra = trajectory["extra_info"]
        extra["role"] = role
        if number:
            trajectory["uid"] += f"-{name}"
            trajectory["instance_id"] = f"{session.instance_id}#{name}"
            extra["chain"] = name
        trajectories.append(trajectory)
    return trajectories


def chain_names(calls: Sequence[Call], paths: Sequence[list[int]]) -> list[tuple[str, str]]:
    """Each chain's role and name: the role its last call (or the nearest before it) was given
    (``x-rollout-role``, ``metadata.role``), else ``main`` for the first chain and ``chain-N``
    for the others; the name is the role, ``<role>-2`` and on for a role met again."""
    names = []
    seen: dict[str, int] = {}
    for number, path in enumerate(paths):
        named = next((calls[index].role for index in reversed(path) if calls[index].role), None)
        role = named or ("main" if number == 0 else f"chain-{number}")
        seen[role] = seen.get(role, 0) + 1
        names.append((role, role if seen[role] == 1 else f"{role}-{seen[role]}"))
    return names


def _trajectory(session: Session, reward: Any, path: list[int], tree: dict[str, Any]) -> dict[str, Any]:
    calls = session.calls
    last = calls[path[-1]]
    messages: list[dict[str, Any]] = [dict(message) for message in whole_messages(calls, path[-1])]
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
    extra_info: dict[str, Any] = {
        **session.metadata,
        "finish_reason": _finish_reason(last),
        "gateway": tree,
    }
    if session.sampling:
        extra_info["sampling_pinned"] = session.sampling
    if session.tokenizer_path:
        extra_info["token_mode"] = True
    trajectory: dict[str, Any] = {
        "uid": f"session-{session.session_id}",
        "instance_id": session.instance_id,
        "task_type": session.task_type,
        "messages": messages,
        "reward": reward,
        "extra_info": extra_info,
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
        **({"weight_versions": tokens["weight_versions"]} if "weight_versions" in tokens else {}),
        "sampling": call.sampling or None,
        **({"sampling_asked": call.asked} if call.asked is not None else {}),
        **_logprobs_kind(call),
    }


def _logprobs_kind(call: Call) -> dict[str, Any]:
    """What the call's logprobs are (``buffer.logprob_kinds``), from the engine that answered
    and the agent's sampling fields; nothing without logprobs."""
    tokens = call.tokens or {}
    if tokens.get("output_logprobs") is None:
        return {}
    return {"logprobs": logprobs_kind(tokens.get("engine") or "auto", call.sampling)}
