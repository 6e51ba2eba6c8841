"""The gateway of a gateway process: sessions recorded here, trajectories written to a buffer elsewhere.

A gateway process (``rollout-buffer gateway``, ``buffer.service.gateway_process``) owns the
sessions opened at it: their events are journaled in its own data folder, so a restart of it
replays them, as the service's own gateway does. What differs is where a session goes at its
end: to the main buffer at ``buffer_url``, all the session's chains in one ``/buffer/write_batch``
(retried while the buffer is down or busy), and only then is the session closed here. A crash
between the two leaves the session open; the end retried writes the same uids
(``session-<id>[...]``), which the main buffer counts once: exactly once, and the end answers
what the buffer said (``duplicate: true`` for a replayed end it had counted before). Two ends of
one session at once share one write. A trajectory the main buffer refuses ends nothing: the end
answers why.

Calls wait while the main buffer's policy is paused: the process mirrors it
(``buffer.toolkit.remote_policy``) and its calls are recorded at the mirrored version.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from tenacity import wait_exponential

from buffer.core.writes import WriteResult
from buffer.errors import RolloutBufferError
from buffer.keys import key_or_env
from buffer.service.gateway.service import Gateway, SessionUnusable
from buffer.service.gateway.sessions import Session
from buffer.service.models import TRAJECTORIES, parse_json
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.sink import BatchTooLarge, RejectedTrajectory, WriteRefused, post_batch
from buffer.toolkit.transport import Reply, Transport

logger = logging.getLogger(__name__)

#: The first wait before a write the main buffer could not take is sent again, doubled each time.
RETRY_S = 0.5
MAX_RETRY_S = 30.0


class MainBufferRefused(RolloutBufferError):
    """The main buffer answered the session's write with a status no retry helps (a 401, a 404)."""

    status_code = 502


class RemoteGateway(Gateway):
    """``Gateway`` whose ends write to the buffer at ``buffer_url`` (``api_key`` for it).

    The writes go over the toolkit's HTTP/1.1 transport, kept open (``transport`` replaces it:
    tests, ``HttpxTransport`` on a mock)."""

    def __init__(
        self,
        *args: Any,
        buffer_url: str,
        api_key: str | None = None,
        transport: Transport | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.buffer_url = buffer_url.rstrip("/")
        self._transport = transport or Http11Transport(max_connections=64, timeout_s=60.0)
        self._headers = {"content-type": "application/json"}
        if key := key_or_env(api_key, self.buffer_url):
            self._headers["authorization"] = f"Bearer {key}"
        self._endings: dict[str, asyncio.Future[WriteResult | None]] = {}
        self._expiring: set[asyncio.Task[Any]] = set()

    async def end(
        self, session: Session, *, reward: Any = None, discard: bool = False, call: int | None = None
    ) -> WriteResult | None:
        """Write the session's trajectories to the main buffer (or discard them), then close it
        here; an end while another is under way waits for that one."""
        if reward is not None:
            await self.reward(session, reward)
        ending = self._endings.get(session.session_id)
        if ending is None:
            ending = asyncio.ensure_future(self._finish(session, call, discard))
            self._endings[session.session_id] = ending
            ending.add_done_callback(lambda done: self._ended(session.session_id, done))
        return await asyncio.shield(ending)

    def _ended(self, session_id: str, ending: asyncio.Future[WriteResult | None]) -> None:
        self._endings.pop(session_id, None)
        if not ending.cancelled():
            ending.exception()  # retrieved: every waiter got it, or none is left to

    async def _finish(self, session: Session, call: int | None, discard: bool) -> WriteResult | None:
        results = None if discard else await self._send(*self._trajectories(session, call))
        if self.store.get(session.session_id) is session:  # not closed meanwhile (a timeout)
            self._close(session, results)
        await self.buffer.wait_durable()
        return None if results is None else results[0]

    def _trajectories(self, session: Session, call: int | None) -> tuple[list[dict[str, Any]], bytes]:
        """The session's chains as trajectories, and their JSON, validated as the main buffer will
        (refused here, with the field named, rather than after a round trip)."""
        trajectories = self._chains(session, call)
        content = orjson.dumps(trajectories)
        parse_json(TRAJECTORIES, content)
        return trajectories, content

    async def _send(self, trajectories: list[dict[str, Any]], content: bytes) -> list[WriteResult]:
        """All the chains in one batch, sent again until the main buffer takes it (while it cannot
        be reached, or answers 429 or 5xx: ``post_batch``); what it wrote, as it answered."""
        url = f"{self.buffer_url}/buffer/write_batch"
        wait = wait_exponential(multiplier=RETRY_S, max=MAX_RETRY_S)  # RETRY_S doubled, up to MAX_RETRY_S
        try:
            reply = await post_batch(
                lambda body: self._transport.post(url, body, self._headers), content, url, wait
            )
        except (RejectedTrajectory, BatchTooLarge) as exc:
            status = 422 if isinstance(exc, RejectedTrajectory) else 413
            raise SessionUnusable(
                f"the main buffer refused the session's trajectories: HTTP {status}: {exc}"
            ) from exc
        except WriteRefused as exc:
            raise MainBufferRefused(str(exc)) from exc
        return _written(trajectories, reply)

    def expire(self) -> int:
        """Time out the idle sessions: each is ended in the background (written when it says
        ``write`` and has a reward, else discarded)."""
        now = self._clock()
        expired = [s for s in list(self.store.sessions.values()) if now - s.last_at > s.timeout_s]
        for session in expired:
            if session.session_id in self._endings:
                continue
            write = session.on_timeout == "write" and session.reward is not None and bool(session.calls)
            logger.info(
                "session %s timed out after %.0f s: %s",
                session.session_id,
                now - session.last_at,
                "written" if write else "discarded",
            )
            task = asyncio.ensure_future(self._expire(session, write))
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)
        return len(expired)

    async def _expire(self, session: Session, write: bool) -> None:
        try:
            await self.end(session, discard=not write)
        except RolloutBufferError as exc:
            logger.warning("session %s timed out and cannot be written: %s", session.session_id, exc)
            if self.store.get(session.session_id) is session:
                self._close(session, None)
        except Exception:
            logger.exception("ending session %s at its timeout failed", session.session_id)

    async def aclose(self) -> None:
        for task in list(self._expiring):
            task.cancel()
        await asyncio.gather(*self._expiring, return_exceptions=True)
        await self._transport.aclose()


def _written(trajectories: list[dict[str, Any]], reply: Reply) -> list[WriteResult]:
    """The main buffer's answer to the batch of ``trajectories``: each one's uid and task, a
    duplicate when the buffer had them all (a replayed end: the session's chains are written in
    one write, all or none, so a replay finds all of them or none)."""
    data = orjson.loads(reply.body).get("data") or {}
    duplicate = bool(trajectories) and data.get("duplicates") == len(trajectories)
    return [WriteResult(str(t["uid"]), str(t["task_type"]), duplicate) for t in trajectories]
