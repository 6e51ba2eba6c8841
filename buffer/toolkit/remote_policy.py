"""The policy of a buffer in another process, mirrored for a generator running elsewhere.

A generator in a worker process, or on another machine, cannot await the service's gate. It
keeps a ``Gate`` of its own in step with the service's by long-polling ``GET /policy/watch``
(a pause reaches it as soon as the service has it), and asks ``POST /policy/admit`` before
each group; a worker process writing to the service that started it keeps a standing demand
on its admission socket instead, where grants and the policy's changes are pushed
(``policy_channel``). Each answer carries the policy's state as it was after its grant, and
the mirror keeps the newest it heard from any of them (``order``): a group admitted for the
next version (the room a pause makes) never starts under the old one.

Each watch also tells the service, under the generator's own name, what its gate holds: how
many engine requests are past it, and which pause it is closed for. A pause's drain waits for
those requests, and the generator watches anew as soon as they are done while paused: a report
per pause and per watch, never one per request. In ``abort`` mode the engines abort them, and
they are continued after the resume.

It lives in the toolkit, not in ``buffer.policy``: it is generation-side code (the runner uses
it when the buffer it writes to is in another process), and it speaks HTTP, which the policy,
like the core, does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from buffer.current import current_job
from buffer.policy.gate import Gate
from buffer.toolkit.policy_channel import ChannelAdmission, channel_admission, close_admission
from buffer.toolkit.sink import same_service

logger = logging.getLogger(__name__)

WATCH_S = 30.0


class RemoteAdmission:
    """``Admission.admit`` over HTTP; stops asking once the service says there is no bound.

    One ask admits as many groups as the run has slots free for (``want``): after a pause
    every slot is free, and a round trip a group would keep them idle in turn. The next
    group's admission is asked for as soon as the last granted is taken, so a round trip is
    not paid between one group and the next either (the service counts what it granted as
    outstanding from then: the bound holds)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        task_type: str,
        worker: str = "",
        on_policy: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._client = client
        #: Handed the policy's state an answer carries (taken after its grant), before the
        #: groups are taken: a group admitted for the next version starts under it.
        self._on_policy = on_policy
        self._task_type = task_type
        self.bounded = True
        self._next: asyncio.Task[float] | None = None
        self._granted = 0  # groups admitted by the service, not yet taken by the run
        self._several = True  # the service admits several groups an ask (``groups``)
        #: Groups cancelled as stale in flight, said with each ask (a total: said twice, counted once).
        self._worker = worker or uuid.uuid4().hex
        self._cancelled = 0
        self._report: asyncio.Task[None] | None = None

    async def admit(self, want: int = 1) -> float:
        """Wait for the next group's admission, asking for ``want`` if none is granted; returns
        the seconds the service had no room."""
        waited_s = 0.0
        if self._next is not None and self._next.done():  # asked ahead: its groups are granted
            self._next = None
        while self.bounded and self._granted == 0:
            if self._next is None:
                self._next = asyncio.create_task(self._ask(want))
            try:
                waited_s += await self._next
            finally:
                self._next = None
        if self._granted == 0:  # no bound: nothing to take
            return waited_s
        self._granted -= 1
        if self.bounded and self._granted == 0 and self._next is None:  # for the slots still free
            self._next = asyncio.create_task(self._ask(max(1, want - 1)))
        return waited_s

    async def _ask(self, groups: int) -> float:
        waited_s = 0.0
        while self.bounded:
            try:
                body = {"task_type": self._task_type, "wait_s": WATCH_S, **self._said()}
                if self._several:
                    body["groups"] = groups
                answer = await self._client.post("/policy/admit", json=body, timeout=WATCH_S + 30)
                if answer.status_code == 422 and self._several and "groups" in answer.text:
                    self._several = False  # an older service: one group an ask
                    continue
                answer.raise_for_status()
                data = answer.json()["data"]
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                logger.warning("admission: %r; retrying in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            self.bounded = bool(data.get("bounded", True))
            waited_s += float(data.get("waited_s") or 0.0)
            if isinstance(state := data.get("policy"), dict) and self._on_policy is not None:
                self._on_policy(state)
            if data.get("admitted") and self.bounded:
                self._granted += int(data.get("groups") or 1)  # an older service admits one
                return waited_s
        return waited_s

    def offer(self, groups: int) -> None:
        """Nothing: an ask is made as the run takes the last group granted (``Admits``)."""

    def _said(self) -> dict[str, Any]:
        return {"worker": self._worker, "cancelled_stale": self._cancelled}

    def cancelled(self, groups: int) -> None:
        """Say at once that ``groups`` more groups were cancelled (a waiting ask may be the
        one their room is for)."""
        self._cancelled += groups
        if self.bounded and (self._report is None or self._report.done()):
            self._report = asyncio.create_task(self._tell(), name="admission-report")

    async def _tell(self) -> None:
        told = -1
        while told != self._cancelled:  # until what it said is the total now
            told = self._cancelled
            try:
                body = {"task_type": self._task_type, "admit": False, **self._said()}
                (await self._client.post("/policy/admit", json=body, timeout=30)).raise_for_status()
            except httpx.HTTPError as exc:  # the next ask says it again
                logger.warning("admission report: %r", exc)
                return

    async def aclose(self) -> None:
        for task in (self._next, self._report):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


class RemotePolicy:
    """A gate kept in step with the service's, and its admission, for one generator: over the
    worker process's admission socket when the buffer is the service that started it
    (``policy_channel``: grants pushed), else over HTTP."""

    def __init__(self, client: httpx.AsyncClient, task_type: str) -> None:
        self._client = client
        self.gate = Gate()
        self._watcher: asyncio.Task[None] | None = None
        #: Who this generator is to the service (``Policy.watch_begins``): unique per mirror.
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._remote = RemoteAdmission(client, task_type, self.name, self._apply)
        self._channel: ChannelAdmission | None = None
        self.admission: RemoteAdmission | ChannelAdmission = self._remote
        self._applied: tuple[int, int, int] | None = None  # the order of the state last mirrored
        #: The number of the service's last pause, as last heard (-1: not yet heard).
        self.pause = -1
        self._reports = 0

    @classmethod
    async def connect(
        cls, buffer_url: str, task_type: str, api_key: str | None = None
    ) -> RemotePolicy | None:
        """The mirror of the policy at ``buffer_url``, or None if the server has none (an
        older buffer) or cannot be reached now."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.AsyncClient(
            base_url=buffer_url.rstrip("/"), headers=headers, timeout=30.0, trust_env=False
        )
        try:
            answer = await client.get("/policy", timeout=5.0)
            if answer.status_code != 200:
                await client.aclose()
                return None
            state = answer.json()["data"]
        except Exception as exc:  # no policy to follow: the generator runs as it always did
            logger.debug("no policy at %s: %r", buffer_url, exc)
            await client.aclose()
            return None
        remote = cls(client, task_type)
        remote._apply(state)
        fd = await service_channel(buffer_url)
        if fd is not None:
            remote._channel = await channel_admission(
                fd, task_type, remote.name, remote._remote, on_policy=remote._apply
            )
            remote.admission = remote._channel or remote._remote
        remote._watcher = asyncio.create_task(remote._watch(), name="policy-watch")
        return remote

    def _apply(self, state: dict[str, Any]) -> None:
        """Mirror ``state``, heard by the watch or on the admission socket: one older than what
        was last mirrored (``order``) is ignored, so the two can arrive in any order."""
        key = order(state, self.pause)
        if self._applied is not None and key < self._applied:
            return
        self._applied = key
        version = state.get("version")
        if isinstance(pause := state.get("pause"), int):
            self.pause = pause
        if state.get("paused"):
            if version is not None:
                self.gate.version = version
            self.gate.pause()
        else:
            self.gate.resume(version)

    async def _watch(self) -> None:
        while True:
            try:
                state = await self._watch_once()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                logger.warning("policy watch: %r; retrying in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            if state is not None:
                self._apply(state)

    async def _watch_once(self) -> dict[str, Any] | None:
        """One watch, saying what the gate holds now; the service's state when it answers.
        While paused with requests past the gate, the watch is given up (None) once they are
        done, for the next one to say so."""
        self._reports += 1
        params: dict[str, Any] = {
            "paused": str(self.gate.paused).lower(),
            "wait_s": WATCH_S,
            "pause": self.pause,
            "worker": self.name,
            "in_flight": self.gate.in_flight,
            "report": self._reports,
        }
        if self.gate.version is not None:
            params["version"] = self.gate.version
        poll = asyncio.ensure_future(self._client.get("/policy/watch", params=params, timeout=WATCH_S + 30))
        idle = None
        if self.gate.paused and self.gate.in_flight > 0:
            idle = asyncio.ensure_future(self.gate.drained(WATCH_S + 30))
        try:
            waits: list[asyncio.Future[Any]] = [poll] if idle is None else [poll, idle]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not poll.done():
                return None
            answer = poll.result()
            answer.raise_for_status()
            state: dict[str, Any] = answer.json()["data"]
            return state
        finally:
            for task in (poll, idle):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def aclose(self) -> None:
        if self._channel is not None:
            await close_admission(self._channel)
        await self._remote.aclose()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self._client.aclose()


async def service_channel(buffer_url: str) -> int | None:
    """The worker process's admission socket, when ``buffer_url`` reaches the service that
    started it (its own address, or the same port on an address of this machine, as a
    trainer's view of it is: ``JobContext.policy_channel``); None for any other buffer, or
    outside a worker process."""
    job = current_job()
    if job is None or job.policy_channel is None or job.buffer_url is None:
        return None
    if buffer_url.rstrip("/") == job.buffer_url.rstrip("/"):
        return job.policy_channel
    local = await asyncio.to_thread(same_service, buffer_url, job.buffer_url)  # resolves: blocking
    return job.policy_channel if local else None


def order(state: dict[str, Any], pause: int) -> tuple[int, int, int]:
    """Where ``state`` (``version``, ``paused``, ``pause``: the number of the last pause, else
    ``pause``) comes in the policy's history: pauses count up, a pause's resume comes after it,
    versions only go up."""
    number = state.get("pause")
    version = state.get("version")
    return (
        number if isinstance(number, int) else pause,
        0 if state.get("paused") else 1,
        version if isinstance(version, int) else -1,
    )
