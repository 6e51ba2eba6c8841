"""The sessions' state, changed only by events, so the journal can replay it.

Every change is an event ``{"e": "x:gateway", "op": ...}`` that ``RolloutBuffer.log_event`` applies
here and appends to the journal under the buffer's lock, in one step: what the state holds is
exactly what the journal will replay. The events:

- ``open``: a session, with its task, instance, engine, key, timeout, metadata, the sampling
  fields it pins and its tokenizer (token mode);
- ``call``: one recorded chat completion (payload: the call as JSON), with its parent call;
- ``reward``: the reward the agent's scorer posted;
- ``close``: the session was written (its trajectories' ``uids``, the main chain's first) or
  discarded; it is gone, and
  remembered as ended (the last ``ENDED_KEPT``), so a retried end answers what the first did.

A compaction writes the sessions still open, and those remembered as ended, as the same
events (``snapshot``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from buffer.core.records import encode
from buffer.service.gateway.calls import Call
from buffer.service.gateway.tree import continued, ids_key

EVENT_KIND = "x:gateway"
OnTimeout = Literal["write", "discard"]

#: A session's metadata, as JSON: kept in memory and journaled while the session is open.
MAX_METADATA_BYTES = 64 * 2**10
#: The longest a session may stay idle before it times out (a week): it must expire some day.
MAX_SESSION_TIMEOUT_S = 7 * 24 * 3600.0
#: Sessions ended that are remembered, newest kept: an end retried after a crash or a lost
#: answer finds what the first end did (a few hundred bytes each).
ENDED_KEPT = 10_000


@dataclass(slots=True)
class Session:
    session_id: str
    task_type: str
    instance_id: str | int
    engine_urls: list[str]  # one engine, or a pool
    api_key: str
    timeout_s: float
    on_timeout: OnTimeout
    created_at: float  # wall clock: the age survives a restart
    last_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    reward: Any = None
    #: ``tree.continued`` of each call -> the latest call with it: how a call's parent is found.
    continuations: dict[int, int] = field(default_factory=dict)
    #: ``tree.continued`` of each call, by index.
    digests: list[int] = field(default_factory=list)
    #: The sampling fields every call is sent with (``sampling.pin``); empty: the agent's own.
    sampling: dict[str, Any] = field(default_factory=dict)
    #: The served model's tokenizer: token mode (``tokens``); None: the engine renders (chat mode).
    tokenizer_path: str | None = None
    #: Legacy completions: ``completions.ids_key`` of each call's prompt and output ids -> the
    #: latest call with them, and the lengths recorded; ``text_ends`` the same of the text a
    #: token-mode call's ids hold (``Call.text_end``), by length in bytes.
    ends: dict[bytes, int] = field(default_factory=dict)
    end_lengths: set[int] = field(default_factory=set)
    text_ends: dict[bytes, int] = field(default_factory=dict)
    text_lengths: set[int] = field(default_factory=set)

    def open_header(self) -> dict[str, Any]:
        return {
            "e": EVENT_KIND,
            "op": "open",
            "id": self.session_id,
            "t": self.task_type,
            "i": self.instance_id,
            "engine": self.engine_urls,
            "key": self.api_key,
            "timeout_s": self.timeout_s,
            "on_timeout": self.on_timeout,
            "at": self.created_at,
            "meta": self.metadata,
            **({"sampling": self.sampling} if self.sampling else {}),
            **({"tokenizer": self.tokenizer_path} if self.tokenizer_path else {}),
        }


@dataclass(frozen=True, slots=True)
class Ended:
    """How a session ended: ``written`` (as ``uid``, to ``task_type``) or ``discarded``."""

    how: str
    task_type: str
    uid: str | None = None
    #: Every trajectory written (the main chain's is ``uid``), when there were several.
    uids: tuple[str, ...] = ()


class SessionStore:
    """The open sessions by id. Changed only through ``apply`` (under the buffer's lock)."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.closed: dict[str, int] = {"written": 0, "discarded": 0}
        #: The sessions ended, oldest first, at most ``ENDED_KEPT``.
        self.ended: OrderedDict[str, Ended] = OrderedDict()

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def apply(self, header: dict[str, Any], parts: Sequence[bytes]) -> None:
        op = header["op"]
        if op == "open":
            at = header["at"]
            self.sessions[header["id"]] = Session(
                header["id"],
                header["t"],
                header["i"],
                header["engine"] if isinstance(header["engine"], list) else [header["engine"]],
                header["key"],
                header["timeout_s"],
                header["on_timeout"],
                at,
                at,
                header.get("meta") or {},
                sampling=header.get("sampling") or {},
                tokenizer_path=header.get("tokenizer"),
            )
            return
        if op == "close":
            self._close(header)
            return
        session = self.sessions.get(header["id"])
        if session is None:  # a record for a session closed before: nothing to change
            return
        if op == "call":
            call = Call.from_json(parts[0])
            if call.completion is not None:
                _index_completion(session, call, len(session.calls))
            else:
                digest = continued(call, 0 if call.parent is None else session.digests[call.parent])
                session.continuations[digest] = len(session.calls)
                session.digests.append(digest)
            session.calls.append(call)
            session.last_at = max(session.last_at, call.at)
        elif op == "reward":
            session.reward = header["reward"]
            session.last_at = max(session.last_at, header["at"])
        else:
            raise ValueError(f"unknown gateway event {op!r}")

    def _close(self, header: dict[str, Any]) -> None:
        """A session ended (or, from a snapshot, one remembered as ended: counted no more)."""
        session = self.sessions.pop(header["id"], None)
        if session is not None:
            self.closed[header["how"]] = self.closed.get(header["how"], 0) + 1
        task_type = header.get("t") or (session.task_type if session is not None else "")
        self.ended[header["id"]] = Ended(
            header["how"], task_type, header.get("uid"), tuple(header.get("uids") or ())
        )
        self.ended.move_to_end(header["id"])
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def snapshot(self) -> Iterator[bytes]:
        """The open sessions, and those remembered as ended, as the events that rebuild them
        (called under the buffer's lock: references are taken now; the calls are immutable once
        recorded)."""
        sessions = [(s.open_header(), list(s.calls), s.reward, s.last_at) for s in self.sessions.values()]
        ended = list(self.ended.items())

        def records() -> Iterator[bytes]:
            for header, calls, reward, last_at in sessions:
                yield encode(header)
                for call in calls:
                    yield encode({"e": EVENT_KIND, "op": "call", "id": header["id"]}, [call.to_json()])
                if reward is not None:
                    yield encode(
                        {"e": EVENT_KIND, "op": "reward", "id": header["id"], "reward": reward, "at": last_at}
                    )
            for session_id, how_ended in ended:
                yield encode(close_header(session_id, how_ended))

        return records()


def _index_completion(session: Session, call: Call, index: int) -> None:
    """A legacy completion, found by the ids (and, token mode, the text) a later call extends;
    never by its messages: a chat call does not continue it."""
    session.digests.append(0)
    if call.tokens is not None:
        ids = [*call.tokens["prompt_ids"], *call.tokens["output_ids"]]
        session.ends[ids_key(ids)] = index
        session.end_lengths.add(len(ids))
    if call.text_end is not None:
        length, digest = call.text_end
        session.text_ends[bytes.fromhex(digest)] = index
        session.text_lengths.add(length)


def close_header(session_id: str, ended: Ended) -> dict[str, Any]:
    """The ``close`` event of a session that ended as ``ended``."""
    header: dict[str, Any] = {
        "e": EVENT_KIND,
        "op": "close",
        "id": session_id,
        "how": ended.how,
        "t": ended.task_type,
    }
    if ended.uid is not None:
        header["uid"] = ended.uid
    if len(ended.uids) > 1:
        header["uids"] = list(ended.uids)
    return header
