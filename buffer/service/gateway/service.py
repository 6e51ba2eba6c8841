"""The gateway the routes call: sessions opened, calls proxied and recorded, sessions ended.

Durability. Each change is an event the buffer applies and journals in one step
(``RolloutBuffer.log_event``) and is acknowledged only once durable: a session's id is
returned, a call's answer reaches the agent, a reward or an end is confirmed, each after
``wait_durable``. A restart replays the events, so an acknowledged call is never lost; a call
that crashed before its answer was acknowledged is one the agent saw fail. Ending writes the
trajectory (uid ``session-<id>``, so a retried or replayed end is a duplicate, counted once)
before the session's ``close``; an end retried once the session is closed (its answer lost,
or the service restarted) answers what the first end did (``ended``).

Pause. With a pause gate (the policy-version control's, while weights are updated), a call
waits up to ``pause_wait_s`` for generation to resume, then answers 503 with ``Retry-After``;
the agent's SDK retries it. The gate is optional: ``PauseGate`` is the hook.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.writes import WriteResult
from buffer.errors import InvalidInput, NotFound, RolloutBufferError
from buffer.service.gateway.assembly import NothingRecorded, assemble
from buffer.service.gateway.calls import Call
from buffer.service.gateway.images import ImagePolicy, write_files
from buffer.service.gateway.proxy import EngineProxy, capture
from buffer.service.gateway.sessions import (
    EVENT_KIND,
    MAX_SESSION_TIMEOUT_S,
    Ended,
    OnTimeout,
    Session,
    SessionStore,
    close_header,
)
from buffer.service.gateway.tree import parent_of
from buffer.service.job_policy import JobPolicy
from buffer.service.models import TRAJECTORY, parse_json

logger = logging.getLogger(__name__)


class PauseGate(Protocol):
    """Generation paused (weights being updated): the engine clients wait for it to resume."""

    def is_paused(self) -> bool: ...

    async def wait_resumed(self, timeout_s: float) -> bool:
        """True once generation runs again, False when ``timeout_s`` passed first."""
        ...


class UnknownSession(NotFound):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no open session {session_id!r} (never opened, or already ended)")


class WrongSessionKey(RolloutBufferError):
    status_code = 401


class NoEngine(RolloutBufferError):
    status_code = 409


class SessionUnusable(RolloutBufferError):
    status_code = 409


class GenerationPaused(RolloutBufferError):
    status_code = 503

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("generation is paused (the policy's weights are being updated); retry")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    timeout_s: float = 1800.0  # a session with no call, reward or end for this long times out
    on_timeout: OnTimeout = "discard"  # "write" writes it when it has a reward
    pause_wait_s: float = 30.0
    retry_after_s: int = 5
    require_session_key: bool = False  # the service has an API key: the agent sends its session's


class Gateway:
    def __init__(
        self,
        buffer: RolloutBuffer,
        proxy: EngineProxy,
        images: ImagePolicy,
        job_policy: JobPolicy,
        service_url: str,
        *,
        config: GatewayConfig | None = None,
        pause_gate: PauseGate | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.buffer = buffer
        self.proxy = proxy
        self.images = images
        self.job_policy = job_policy
        self.service_url = service_url
        self.config = config or GatewayConfig()
        self.pause_gate = pause_gate
        self.store = SessionStore()
        self._clock = clock
        buffer.add_extension(EVENT_KIND, self.store)  # before a restore, to replay the sessions

    # -- sessions ----------------------------------------------------------------------

    async def open(
        self,
        task_type: str,
        instance_id: str | int,
        remote_engine_url: str | list[str] | None,
        metadata: dict[str, Any],
        timeout_s: float | None = None,
        on_timeout: OnTimeout | None = None,
    ) -> Session:
        job = self.buffer.jobs.get(task_type, {}).get("data", {})
        engines = await self._engines(remote_engine_url, job)
        now = self._clock()
        session = Session(
            session_id=uuid.uuid4().hex,
            task_type=task_type,
            instance_id=instance_id,
            engine_urls=engines,
            api_key="sk-session-" + secrets.token_urlsafe(24),
            timeout_s=timeout_s or _positive(job.get("session_timeout_s")) or self.config.timeout_s,
            on_timeout=on_timeout or _on_timeout(job.get("session_on_timeout")) or self.config.on_timeout,
            created_at=now,
            last_at=now,
            metadata=metadata,
        )
        self.buffer.log_event(session.open_header())
        await self.buffer.wait_durable()
        logger.info("session %s (%s, %r) on %s", session.session_id, task_type, instance_id, engines)
        return session

    async def _engines(self, requested: str | list[str] | None, job: dict[str, Any]) -> list[str]:
        if requested is None:
            requested = job.get("remote_engine_url")
            if requested is None:
                raise NoEngine(
                    "no remote_engine_url: name one in the body, or start the task with /start_rollout "
                    "and its remote_engine_url"
                )
        urls = [requested] if isinstance(requested, str) else list(requested)
        if not urls:
            raise InvalidInput.one("remote_engine_url", "names no engine")
        await self.job_policy.check({"remote_engine_urls": urls}, self.service_url)
        return urls

    def session(self, session_id: str, authorization: str | None = None, *, agent: bool = False) -> Session:
        session = self.store.get(session_id)
        if session is None:
            raise UnknownSession(session_id)
        if agent and self.config.require_session_key:
            sent = (authorization or "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(sent.encode(), session.api_key.encode()):
                raise WrongSessionKey("send the session's api_key as 'Authorization: Bearer <key>'")
        return session

    # -- calls -------------------------------------------------------------------------

    async def complete(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """Forward one chat completion and record it; the engine's answer, once durable."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise InvalidInput.one("messages", "must be a non-empty list of messages")
        await self._wait_unpaused()
        kept, files = self.images.keep(messages)
        if files:
            await asyncio.to_thread(write_files, files)
        upstream = self.proxy.upstream_body(body)
        answer = await self.proxy.chat(session.engine_urls, upstream, key=session.session_id)
        reply, finish_reason, tokens = capture(answer)
        if self.store.get(session.session_id) is not session:
            raise UnknownSession(session.session_id)  # ended while the engine answered
        tools = body.get("tools")
        parent, shared = parent_of(session.continuations, kept)
        call = Call(
            messages=kept[shared:],
            tools=tools if isinstance(tools, list) else None,
            sampling={k: v for k, v in body.items() if k not in _NOT_SAMPLING},
            reply=reply,
            finish_reason=finish_reason,
            tokens=None
            if tokens is None
            else {
                "prompt_ids": tokens.prompt_ids,
                "output_ids": tokens.output_ids,
                "output_logprobs": tokens.output_logprobs,
                "weight_version": tokens.weight_version,
                "engine": tokens.engine,
            },
            parent=parent,
            at=self._clock(),
        )
        header = {"e": EVENT_KIND, "op": "call", "id": session.session_id}
        self.buffer.log_event(header, [call.to_json()])
        await self.buffer.wait_durable()
        return answer

    async def _wait_unpaused(self) -> None:
        gate = self.pause_gate
        if gate is None or not gate.is_paused():
            return
        if not await gate.wait_resumed(self.config.pause_wait_s):
            raise GenerationPaused(self.config.retry_after_s)

    # -- rewards and ends ----------------------------------------------------------------

    async def reward(self, session: Session, reward: float | dict[str, float]) -> None:
        header = {
            "e": EVENT_KIND,
            "op": "reward",
            "id": session.session_id,
            "reward": reward,
            "at": self._clock(),
        }
        self.buffer.log_event(header)
        await self.buffer.wait_durable()

    async def end(
        self, session: Session, *, reward: Any = None, discard: bool = False, call: int | None = None
    ) -> WriteResult | None:
        """Write the session's trajectory (or discard it) and close the session."""
        if reward is not None:
            await self.reward(session, reward)
        result = None if discard else self._write(session, call)
        self._close(session, result)
        await self.buffer.wait_durable()
        return result

    def ended(self, session_id: str) -> Ended | None:
        """How the session ended, when it is closed and remembered: an end retried answers it."""
        if self.store.get(session_id) is not None:
            return None
        return self.store.ended.get(session_id)

    def _write(self, session: Session, call: int | None) -> WriteResult:
        if session.reward is None:
            raise SessionUnusable(
                "the session has no reward: POST /sessions/{id}/reward first, or end with one"
            )
        try:
            trajectory = assemble(session, session.reward, end=call)
        except NothingRecorded as exc:
            raise SessionUnusable(str(exc)) from exc
        except IndexError as exc:
            raise InvalidInput.one("call", str(exc)) from exc
        checked = parse_json(TRAJECTORY, orjson.dumps(trajectory))
        return self.buffer.write(checked)

    def _close(self, session: Session, written: WriteResult | None) -> None:
        """Close the session: ``written`` as that trajectory, or discarded (None)."""
        if written is None:
            ended = Ended("discarded", session.task_type)
        else:
            ended = Ended("written", written.task_type, written.uid)
        self.buffer.log_event(close_header(session.session_id, ended))

    def expire(self) -> int:
        """Time out the sessions idle past their timeout: written (with a reward, when the
        session says ``write``) or discarded. Returns how many."""
        now = self._clock()
        expired = [s for s in list(self.store.sessions.values()) if now - s.last_at > s.timeout_s]
        for session in expired:
            written = None
            if session.on_timeout == "write" and session.reward is not None and session.calls:
                try:
                    written = self._write(session, None)
                except RolloutBufferError as exc:
                    logger.warning("session %s timed out and cannot be written: %s", session.session_id, exc)
            logger.info(
                "session %s timed out after %.0f s: %s",
                session.session_id,
                now - session.last_at,
                "discarded" if written is None else "written",
            )
            self._close(session, written)
        return len(expired)


def _positive(value: Any) -> float | None:
    """A task's ``session_timeout_s`` (slime sends numbers as strings), at most
    ``MAX_SESSION_TIMEOUT_S`` (``"inf"`` too: a session must expire some day), or None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return min(number, MAX_SESSION_TIMEOUT_S) if number > 0 else None


def _on_timeout(value: Any) -> OnTimeout | None:
    if value == "write":
        return "write"
    if value == "discard":
        return "discard"
    return None


_NOT_SAMPLING = frozenset({"messages", "tools", "stream", "stream_options", "tool_choice"})
