"""A worker process's end of its admission socket: grants pushed by the service, no ask per room.

A worker process the service started holds one end of a connected socket whose other end the
service serves (``buffer.policy.channel``; the descriptor is ``JobContext.policy_channel``).
On it the worker's runs keep a standing demand per task (the groups their free slots could
start) and the service grants groups the moment the trainer's reads, the filters' drops or a
new version make room: the grant travels down a socket, and no room waits for an ask to arrive.

Runs on one event loop share the socket (their tasks tell their messages apart); each run ends
by saying it is done, and the service frees what it granted that run and the run did not take.
A run on another loop while one is open, or with no socket, asks over HTTP
(``remote_policy.RemoteAdmission``, the ``fallback``), as does a run whose socket breaks (its
grants not taken are freed by the service when its end closes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from buffer.policy.admission import Admits
from buffer.policy.channel import LineProtocol

logger = logging.getLogger(__name__)

#: What is handed the policy's state the service says (``RemotePolicy``'s mirror).
PolicyHeard = Callable[[dict[str, Any]], None]


class PolicyChannel(LineProtocol):
    """The worker's end of its admission socket, on one event loop: each message is handled in
    the loop turn it arrives in (a grant wakes the run waiting for it the turn after)."""

    def __init__(self) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._admissions: dict[str, ChannelAdmission] = {}
        self.broken = False
        self._policy: dict[str, Any] | None = None  # the policy's state as last said

    @classmethod
    async def open(cls, fd: int) -> PolicyChannel:
        """The socket ``fd`` (a copy of it: closing this leaves ``fd`` open for a later run)."""
        sock = socket.socket(fileno=os.dup(fd))
        try:
            transport, channel = await asyncio.get_running_loop().create_connection(cls, sock=sock)
        except BaseException:
            sock.close()
            raise
        if channel._transport is None:  # its connection_made failed
            transport.close()
            raise OSError("the admission socket did not connect")
        return channel

    def admission(
        self, task_type: str, worker: str, fallback: Admits, on_policy: PolicyHeard | None = None
    ) -> ChannelAdmission | None:
        """This run's admission for ``task_type``; None while another run of the task holds it.
        ``on_policy`` is handed the policy's state as the service says it (the last said first)."""
        if self.broken or task_type in self._admissions:
            return None
        admission = ChannelAdmission(self, task_type, worker, fallback, on_policy)
        self._admissions[task_type] = admission
        if on_policy is not None and self._policy is not None:
            on_policy(self._policy)
        return admission

    def send(self, message: dict[str, Any]) -> None:
        if self.broken or self._transport is None:
            return
        self._transport.write(json.dumps(message).encode() + b"\n")

    def done(self, admission: ChannelAdmission) -> None:
        if self._admissions.get(admission.task_type) is admission:
            del self._admissions[admission.task_type]

    @property
    def idle(self) -> bool:
        return not self._admissions

    # -- the protocol ---------------------------------------------------------------------

    def too_long(self) -> None:
        self._break(ValueError("an admission message too long"))

    def heard(self, message: dict[str, Any]) -> None:
        if isinstance(state := message.get("policy"), dict):
            self._policy = state
            for admission in list(self._admissions.values()):
                admission.policy(state)
            return
        run = self._admissions.get(str(message["task"]))
        if run is not None:
            run.heard(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(exc)

    def _break(self, why: BaseException | None) -> None:
        if self.broken:
            return
        self.broken = True
        if self._admissions:
            logger.warning("admission channel to the service closed (%r): asking over HTTP", why)
        for admission in list(self._admissions.values()):
            admission.wake()
        if self._transport is not None:
            self._transport.close()

    async def aclose(self) -> None:
        """Close this copy of the socket, once what was said is written."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()  # writes what is buffered first
        self.broken = True


class ChannelAdmission:
    """``Admits`` over the channel: a standing demand the service grants as room appears.

    ``admit(want)`` raises the demand to the groups taken plus ``want`` (the groups the run's
    free slots could start now, this one included), takes a group granted if one is, else says
    it waits and waits for a grant. The service never grants more than asked: what is granted
    and not yet taken is never more than the run's free slots could start."""

    def __init__(
        self,
        channel: PolicyChannel,
        task_type: str,
        worker: str,
        fallback: Admits,
        on_policy: PolicyHeard | None = None,
    ) -> None:
        self._channel = channel
        self._on_policy = on_policy
        self.task_type = task_type
        self._worker = worker
        self._fallback = fallback
        self.asked = 0
        self.taken = 0
        self.granted = 0
        self.bounded = True
        self._waiting = False
        self._cancelled = 0
        self._since = 0.0  # when it began to wait for a grant (monotonic)
        self._handed = 0  # of the cancelled, those the fallback was told of
        self._no_room_s = 0.0
        self._event = asyncio.Event()
        self._said: tuple[int, int, bool, int] | None = None

    async def admit(self, want: int = 1) -> float:
        if self._channel.broken:
            self._hand_over()
            return await self._fallback.admit(want)
        if not self.bounded:
            return 0.0
        self.asked = max(self.asked, self.taken + max(1, want))
        if self.granted > self.taken:
            self.taken += 1
            self._say()
            return 0.0
        seen = self._no_room_s
        self._waiting = True
        self._since = time.monotonic()
        self._say()
        try:
            while self.bounded and self.granted <= self.taken and not self._broken():
                self._event.clear()
                await self._event.wait()
        finally:
            self._waiting = False
        if self._broken() and self.bounded:
            self._hand_over()
            return await self._fallback.admit(want)
        if self.bounded:
            self.taken += 1
        self._say()
        return max(0.0, self._no_room_s - seen)

    def _broken(self) -> bool:
        return self._channel.broken

    def offer(self, groups: int) -> None:
        """The run's free slots could start ``groups`` groups now: the standing demand covers
        them before the run asks, so room the service has is granted at once."""
        if self._channel.broken or not self.bounded:
            return
        if self.taken + groups > self.asked:
            self.asked = self.taken + groups
            self._say()

    def cancelled(self, groups: int) -> None:
        """``groups`` more groups were cancelled as stale: said at once (their room may be for
        this run's own demand)."""
        self._cancelled += groups
        if self._channel.broken:
            self._hand_over()
        else:
            self._say()

    def _hand_over(self) -> None:
        """The channel broke: the fallback says the cancelled groups from now, all of them (a
        total, under the same worker's name: the service counts none twice)."""
        if self._handed < self._cancelled:
            self._fallback.cancelled(self._cancelled - self._handed)
            self._handed = self._cancelled

    def heard(self, message: dict[str, Any]) -> None:
        """The service's grant: its totals."""
        self.granted = max(self.granted, int(message.get("granted", 0)))
        self.bounded = bool(message.get("bounded", True))
        self._no_room_s = max(self._no_room_s, float(message.get("no_room_s", 0.0)))
        self._event.set()

    def policy(self, state: dict[str, Any]) -> None:
        """The policy's state, said before any grant made after it changed."""
        if self._on_policy is not None:
            self._on_policy(state)

    def wake(self) -> None:
        self._event.set()

    def _say(self, **more: Any) -> None:
        said = (self.asked, self.taken, self._waiting, self._cancelled)
        if said == self._said and not more:
            return
        self._said = said
        self._channel.send(
            {
                "task": self.task_type,
                "worker": self._worker,
                "asked": self.asked,
                "taken": self.taken,
                "waiting": self._waiting,
                "since": self._since if self._waiting else None,
                "cancelled": self._cancelled,
                **more,
            }
        )

    async def aclose(self) -> None:
        """The run is over: the service frees what it granted and this run did not take."""
        self._say(done=True)
        self._channel.done(self)


_open: PolicyChannel | None = None


async def channel_admission(
    fd: int | None, task_type: str, worker: str, fallback: Admits, *, on_policy: PolicyHeard | None = None
) -> ChannelAdmission | None:
    """An admission over the process's admission socket ``fd``, shared by the runs of this event
    loop; None (ask over HTTP) without one, or while runs on another loop hold it."""
    global _open
    if fd is None:
        return None
    if _open is not None and (_open.broken or _open._loop.is_closed()) and _open.idle:
        _open = None
    if _open is not None and _open._loop is not asyncio.get_running_loop():
        return None
    if _open is None:
        try:
            _open = await PolicyChannel.open(fd)
        except OSError as exc:
            logger.warning("no admission channel (%r): asking over HTTP", exc)
            return None
    return _open.admission(task_type, worker, fallback, on_policy)


async def close_admission(admission: ChannelAdmission) -> None:
    """End a run's admission; the last run of the loop closes its copy of the socket."""
    global _open
    await admission.aclose()
    channel = admission._channel
    if channel.idle:
        if _open is channel:
            _open = None
        await channel.aclose()
