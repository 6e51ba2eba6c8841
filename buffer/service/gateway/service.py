"""The gateway the routes call: sessions opened, calls proxied and recorded, sessions ended.

Durability. Each change is an event the buffer applies and journals in one step
(``RolloutBuffer.log_event``) and is acknowledged only once durable: a session's id is
returned, a call's answer reaches the agent, a reward or an end is confirmed, each after
``wait_durable``. A restart replays the events, so an acknowledged call is never lost; a call
that crashed before its answer was acknowledged is one the agent saw fail. Ending writes the
trajectory (uid ``session-<id>``, so a retried or replayed end is a duplicate, counted once)
before the session's ``close``; an end retried once the session is closed (its answer lost,
or the service restarted) answers what the first end did (``ended``).

Chains. Ending writes one trajectory per conversation of the session (``assembly``), all or
none in one write: the main chain's as ``session-<id>``, each other's as
``session-<id>-<chain>``; a replayed end writes the same uids, duplicates counted once.

Retries. An agent's SDK that retries a request (``x-stainless-retry-count`` of 1 or more, the
same body) is answered, not recorded again: by waiting on the call still in flight, or from
the call recorded. A call whose agent left (every request for it cancelled: the agent
disconnected) is cancelled at the engine after ``retry_grace_s``, unless a retry came for it.

Pause. With a pause gate (the policy-version control's, while weights are updated), a call
waits up to ``pause_wait_s`` for generation to resume, then answers 503 with ``Retry-After``;
the agent's SDK retries it. The gate is optional: ``PauseGate`` is the hook.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.writes import WriteResult
from buffer.errors import InvalidInput, NotFound, RolloutBufferError
from buffer.policy.versions import as_version
from buffer.service.gateway import completions
from buffer.service.gateway.assembly import NothingRecorded, assemble_chains
from buffer.service.gateway.calls import Call
from buffer.service.gateway.images import ImagePolicy, write_files
from buffer.service.gateway.proxy import EngineProxy, captures, chat_answer, token_reply
from buffer.service.gateway.responses import ResponseStore
from buffer.service.gateway.sampling import pin, pinned
from buffer.service.gateway.sessions import (
    EVENT_KIND,
    MAX_SESSION_TIMEOUT_S,
    Ended,
    OnTimeout,
    Session,
    SessionStore,
    close_header,
)
from buffer.service.gateway.tree import continued_by_ids, parent_of, text_key
from buffer.service.job_policy import JobPolicy
from buffer.service.models import TRAJECTORIES, parse_json
from buffer.toolkit.tito import TemplateError, TokenizerMissing
from buffer.toolkit.types import Completion, TokenCapture

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
    retry_grace_s: float = 10.0  # a call its agent left runs this long for an SDK's retry to take it


@dataclass(slots=True, eq=False)
class _Flight:
    """A call in flight, and how many requests wait for its answer (the first, and retries)."""

    task: asyncio.Future[dict[str, Any]]
    waiters: int = 0
    abandoned: asyncio.TimerHandle | None = field(default=None)


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
        #: The Responses API's stored responses, for ``previous_response_id`` (in memory).
        self.responses = ResponseStore()
        self._clock = clock
        self._flights: dict[tuple[str, str], _Flight] = {}
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
        *,
        sampling: Mapping[str, Any] | None = None,
        token_mode: bool | None = None,
        tokenizer_path: str | None = None,
    ) -> Session:
        """A new session; ``sampling`` (else the task's ``session_sampling``) pins the sampling
        fields of its calls; ``token_mode`` (else the task's ``session_token_mode``) serves it
        token in, token out with ``tokenizer_path`` (else the task's)."""
        job = self.buffer.jobs.get(task_type, {}).get("data", {})
        engines = await self._engines(remote_engine_url, job)
        if sampling is not None:
            pins = pinned(dict(sampling), "sampling")
        else:
            pins = pinned(job.get("session_sampling"), "session_sampling")
        tokenizer = await self._tokenizer(token_mode, tokenizer_path, job)
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
            sampling=pins,
            tokenizer_path=tokenizer,
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

    async def _tokenizer(self, token_mode: bool | None, path: str | None, job: dict[str, Any]) -> str | None:
        """The tokenizer of a session in token mode (loaded now: a path that does not load is
        refused at the open), or None: chat mode."""
        if token_mode is None:
            token_mode = str(job.get("session_token_mode", "")).lower() in ("true", "1")
        if not token_mode:
            return None
        path = path or job.get("tokenizer_path")
        if not path or not isinstance(path, str):
            raise InvalidInput.one(
                "tokenizer_path",
                "token mode renders with the served model's tokenizer: name it (or the task's)",
            )
        try:
            await self.proxy.renderer(path)
        except (TokenizerMissing, OSError, ValueError) as exc:
            raise InvalidInput.one("tokenizer_path", f"does not load: {exc}") from None
        return path

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

    async def complete(
        self,
        session: Session,
        body: dict[str, Any],
        *,
        text: bool = False,
        headers: Mapping[str, str] | None = None,
        role: str | None = None,
        retry_count: int | None = None,
        raw: bytes | None = None,
    ) -> dict[str, Any]:
        """Forward one chat completion (``text``: a legacy completion, ``/v1/completions``) and
        record it; the engine's answer, once durable. A request and the SDK's retries of it are
        answered by one call to the engine.

        ``role`` (else the ``x-rollout-role`` header, else the body's ``metadata.role``) names
        the call's chain; ``retry_count`` (else ``x-stainless-retry-count``) of 1 or more makes
        a request with the body of one in flight or recorded an SDK's retry: answered, not
        recorded again. ``raw``: the request as the agent sent it (an SDK's retry sends the same
        bytes), whose digest tells a retry; else the body's JSON."""
        prompt = completions.check(body) if text else None
        if prompt is None:
            _check_messages(body)
        headers = headers or {}
        role = _role(body, headers) if role is None else _checked_role(role, "role")
        if retry_count is None:
            retry_count = _retry_count(headers)
        digest = hashlib.blake2b(orjson.dumps(body) if raw is None else raw, digest_size=16).hexdigest()
        key = (session.session_id, digest)
        flight = self._flights.get(key) if retry_count > 0 else None
        if flight is None:
            if retry_count > 0 and (answered := _recorded(session, digest, body)) is not None:
                return answered
            if prompt is None:
                answer = self._call(session, body, role, digest)
            else:
                answer = self._text_call(session, body, prompt, role, digest)
            flight = _Flight(asyncio.ensure_future(answer))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda task: self._landed(key, flight))
        return await self._join(flight)

    def _landed(self, key: tuple[str, str], flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if flight.abandoned is not None:
            flight.abandoned.cancel()
        if not flight.task.cancelled():
            flight.task.exception()  # retrieved: every waiter got it, or none is left to

    async def _join(self, flight: _Flight) -> dict[str, Any]:
        """The flight's answer; a request cancelled (its agent gone) leaves it, and the last to
        leave has it cancelled at the engine after ``retry_grace_s`` unless a retry joins."""
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if not flight.waiters and not flight.task.done():
                grace_s = self.config.retry_grace_s
                if grace_s <= 0:
                    flight.task.cancel()
                else:
                    flight.abandoned = asyncio.get_running_loop().call_later(
                        grace_s, _cancel_unwaited, flight
                    )

    async def _call(
        self, session: Session, body: dict[str, Any], role: str | None, digest: str
    ) -> dict[str, Any]:
        await self._wait_unpaused()
        kept, files = self.images.keep(body["messages"])
        if files:
            await asyncio.to_thread(write_files, files)
        sent, asked = pin(body, session.sampling)
        parent, shared = parent_of(session.continuations, kept)
        served = self.buffer.policy.version or 0  # the call's version where the engine says none
        if session.tokenizer_path is not None:
            answer, replies = await self._token_call(session, sent, parent)
        else:
            answer = await self.proxy.chat(
                session.engine_urls, self.proxy.upstream_body(sent), key=session.session_id
            )
            replies = captures(answer)
        tools = body.get("tools")
        sampling = {k: v for k, v in sent.items() if k not in _NOT_SAMPLING}
        at = self._clock()
        calls = [
            Call(
                messages=kept[shared:],
                tools=tools if isinstance(tools, list) else None,
                sampling=sampling,
                reply=reply,
                finish_reason=finish_reason,
                tokens=None if tokens is None else _token_record(tokens, served),
                parent=parent,
                at=at,
                role=role,
                request=digest,
                choice=choice,
                asked=asked,
            )
            for choice, (reply, finish_reason, tokens) in enumerate(replies)
        ]
        await self._record(session, calls)
        return answer

    async def _record(self, session: Session, calls: list[Call]) -> None:
        """An answer's calls (one a choice) logged as the session's, durable before the answer
        goes back; ``UnknownSession`` where the session ended while the engine answered."""
        if self.store.get(session.session_id) is not session:
            raise UnknownSession(session.session_id)
        header = {"e": EVENT_KIND, "op": "call", "id": session.session_id}
        for call in calls:
            self.buffer.log_event(header, [call.encoded()])
        await self.buffer.wait_durable()

    async def _token_call(
        self, session: Session, sent: dict[str, Any], parent: int | None
    ) -> tuple[dict[str, Any], list[tuple[dict[str, Any], str, TokenCapture | None]]]:
        """Token mode: the prompt extended from the parent's ids (rendered for a chain's first
        call), the engine's token route, and the answer as a chat completion."""
        if sent.get("n") not in (None, 1):
            raise InvalidInput.one("n", "a session in token mode samples one choice a call")
        assert session.tokenizer_path is not None
        previous = None
        recorded = session.calls[parent].tokens if parent is not None else None
        if recorded is not None:
            capture = TokenCapture(recorded["prompt_ids"], recorded["output_ids"])
            previous = Completion(text="", finish_reason="stop", tokens=capture)
        try:
            completion = await self.proxy.complete_tokens(
                session.engine_urls, session.tokenizer_path, sent, previous, session.session_id
            )
        except TemplateError as exc:
            raise SessionUnusable(f"token mode: {exc}") from exc
        replies = [(token_reply(completion), completion.finish_reason, completion.tokens)]
        return chat_answer(replies, str(sent.get("model") or "")), replies

    async def _text_call(
        self,
        session: Session,
        body: dict[str, Any],
        prompt: completions.Prompt,
        role: str | None,
        digest: str,
    ) -> dict[str, Any]:
        """A legacy completion: sent as the agent wrote it (token mode: its prompt as the ids the
        gateway holds), each choice recorded as a call continuing the one its prompt's ids extend."""
        await self._wait_unpaused()
        sent, asked = pin(body, session.sampling)
        served = self.buffer.policy.version or 0
        tokenizer = None
        if session.tokenizer_path is not None:
            tokenizer = (await self.proxy.renderer(session.tokenizer_path)).tokenizer
            prompt = completions.owned_ids(session, tokenizer, prompt)
        upstream = completions.upstream_body(sent, prompt)
        answer = await self.proxy.completions(session.engine_urls, upstream, session.session_id)
        replies = completions.captures(answer)
        prompt_ids = replies[0][2].prompt_ids
        parent = continued_by_ids(session.ends, session.end_lengths, prompt_ids)
        text = body["prompt"] if isinstance(body["prompt"], str) else None
        if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str):
            text = body["prompt"][0]
        shown = completions.new_text(session, parent, text, prompt_ids, tokenizer)
        sampling = {k: v for k, v in sent.items() if k not in completions.NOT_SAMPLING}
        at = self._clock()
        calls = []
        for choice, (reply, finish_reason, tokens) in enumerate(replies):
            text_end = None
            if tokenizer is not None and text is not None:  # what these ids hold, as text
                held = (text + tokenizer.decode(tokens.output_ids, skip_special_tokens=False)).encode()
                text_end = [len(held), text_key(held).hex()]
            call = Call(
                messages=[{"role": "user", "content": shown}],
                tools=None,
                sampling=sampling,
                reply={"role": "assistant", "content": reply},
                finish_reason=finish_reason,
                tokens=_token_record(tokens, served),
                parent=parent,
                at=at,
                role=role,
                request=digest,
                choice=choice,
                asked=asked,
                completion="ids" if text is None else "text",
                text_end=text_end,
            )
            calls.append(call)
        await self._record(session, calls)
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
        """Write the session's trajectories (or discard them) and close the session; the main
        chain's write (``ended`` has every uid)."""
        if reward is not None:
            await self.reward(session, reward)
        results = None if discard else self._write(session, call)
        self._close(session, results)
        await self.buffer.wait_durable()
        return None if results is None else results[0]

    def ended(self, session_id: str) -> Ended | None:
        """How the session ended, when it is closed and remembered: an end retried answers it."""
        if self.store.get(session_id) is not None:
            return None
        return self.store.ended.get(session_id)

    def _write(self, session: Session, call: int | None) -> list[WriteResult]:
        checked = parse_json(TRAJECTORIES, orjson.dumps(self._chains(session, call)))
        return self.buffer.write_many(checked)  # all chains or none

    def _chains(self, session: Session, call: int | None) -> list[dict[str, Any]]:
        """The session's chains as trajectories, the main chain ending at ``call`` (else at the
        last call); refused without a reward, with nothing recorded, or with no such call."""
        if session.reward is None:
            raise SessionUnusable(
                "the session has no reward: POST /sessions/{id}/reward first, or end with one"
            )
        try:
            return assemble_chains(session, session.reward, end=call)
        except NothingRecorded as exc:
            raise SessionUnusable(str(exc)) from exc
        except IndexError as exc:
            raise InvalidInput.one("call", str(exc)) from exc

    def _close(self, session: Session, written: list[WriteResult] | None) -> None:
        """Close the session: ``written`` as those trajectories (the main chain's first), or
        discarded (None)."""
        if written is None:
            ended = Ended("discarded", session.task_type)
        else:
            main = written[0]
            ended = Ended("written", main.task_type, main.uid, tuple(result.uid for result in written))
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


#: Request fields that are no sampling field. ``tool_choice`` is one: "required" or a named tool
#: constrains decoding, so the turn's logprobs are the grammar's (``logprob_kinds.constraint``).
_NOT_SAMPLING = frozenset({"messages", "tools", "stream", "stream_options", "metadata"})
_ROLE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidInput.one("messages", "must be a non-empty list of messages")


def _checked_role(role: Any, field_name: str) -> str:
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise InvalidInput.one(field_name, "must be 1 to 64 letters, digits or '_.:-' (a chain's role)")
    return role


def _role(body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    """The role the agent or its harness gave the call: ``x-rollout-role``, else ``metadata.role``."""
    role = headers.get("x-rollout-role")
    if role is not None:
        return _checked_role(role, "x-rollout-role")
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and metadata.get("role") is not None:
        return _checked_role(metadata["role"], "metadata.role")
    return None


def _retry_count(headers: Mapping[str, str]) -> int:
    try:
        return int(headers.get("x-stainless-retry-count") or 0)
    except ValueError:
        return 0


def _recorded(session: Session, digest: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer recorded for the latest request with this body (each of its choices), or None."""
    last = next(
        (i for i in range(len(session.calls) - 1, -1, -1) if session.calls[i].request == digest), None
    )
    if last is None:
        return None
    first = last - session.calls[last].choice
    if session.calls[first].completion is not None:
        texts = [
            (str(call.reply.get("content") or ""), call.finish_reason, _capture(call.tokens))
            for call in session.calls[first : last + 1]
        ]
        return completions.answer_of(
            texts, str(body.get("model") or ""), f"cmpl-{session.session_id}-{first}"
        )
    replies = []
    for call in session.calls[first : last + 1]:
        tokens = call.tokens
        capture = None if tokens is None else TokenCapture(tokens["prompt_ids"], tokens["output_ids"])
        replies.append((call.reply, call.finish_reason, capture))
    return chat_answer(replies, str(body.get("model") or ""), f"chatcmpl-{session.session_id}-{first}")


def _capture(tokens: dict[str, Any] | None) -> TokenCapture:
    if tokens is None:
        return TokenCapture([], [])
    return TokenCapture(tokens["prompt_ids"], tokens["output_ids"])


def _token_record(tokens: TokenCapture, served: int) -> dict[str, Any]:
    return {
        "prompt_ids": tokens.prompt_ids,
        "output_ids": tokens.output_ids,
        "output_logprobs": tokens.output_logprobs,
        "weight_version": tokens.weight_version,
        "weight_versions": tokens.weight_versions
        or [[_or(as_version(tokens.weight_version), served), len(tokens.output_ids)]],
        "engine": tokens.engine,
    }


def _cancel_unwaited(flight: _Flight) -> None:
    """No request came back for the call: cancel it at the engine."""
    if not flight.waiters:
        flight.task.cancel()


def _or(version: int | None, served: int) -> int:
    """The engine's version where it reports a number, else the service's when the call was made."""
    return served if version is None else version
