"""Admission pushed to a worker process over a socket of its own: room granted the moment it appears.

A worker asking ``POST /policy/admit`` pays a round trip per ask: the answer travels back, and
room that appears while no ask waits at the service (between an answer and the next ask) is
granted only when the next arrives. A worker process the service started has instead a
connected socket to the service (``buffer.workers.process``, one end each) on which it keeps a
*standing demand* per task and the service pushes grants:

- the worker says, as totals, how many groups it has asked for in all (``asked``: those it took
  plus one per group its free slots could start now, raised as slots free up), how many it
  took, whether it waits for one now (``waiting``, since ``since`` on the host's monotonic
  clock), and how many it cancelled as stale in flight: ``{"task", "worker", "asked", "taken",
  "waiting", "since", "cancelled"}``, one JSON object a line, whenever one of them changes, and
  ``"done": true`` when the run ends (what it was granted and did not take is freed);
- the service admits up to ``asked - granted`` whenever the task's admission may have room
  (each read, write, version, pause and report calls it back: ``Admission.listen``) and says
  its new total: ``{"task", "granted", "bounded", "no_room_s"}`` (``no_room_s``: the seconds,
  in all, the worker waited while there was no room for it: the slot breakdown's bound);
- the service says the policy's state (``{"policy": {"version", "paused", "pause"}}``) when it
  changes, before any grant made after the change: a group granted for the next version (the
  room a pause makes) never starts a request under the old one, as it could if the pause came
  by the worker's watch after the grant.

The bound is as exact as over HTTP: a group counts as admitted (outstanding) from its grant,
whether or not the worker has taken it yet, and never more is granted than asked for, which is
never more than the worker's free slots could start. Totals make every message idempotent.
When the worker ends (its end of the socket closes), what was granted and not taken is
released (``Admission.release``). An asyncio protocol: each message is handled in the loop turn
it arrives in, each room in the turn after it was made. No HTTP, nothing of the service's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from buffer.policy.admission import Admission
from buffer.policy.state import Policy

logger = logging.getLogger(__name__)

#: A line longer than this is no message of the protocol: the channel is closed.
MAX_LINE = 64 * 1024
#: How often the service looks again without being called back (a change nothing announced).
POLL_S = 1.0
#: A worker's wait that began longer ago than this, by its clock, is taken as beginning now.
MAX_CLOCK_SKEW_S = 1.0


@dataclass(slots=True)
class _Demand:
    """One task's standing demand of one worker, as it last said, and what it was granted."""

    worker: str = ""
    asked: int = 0
    taken: int = 0
    waiting: bool = False
    waiting_since: float | None = None  # when the worker began to wait, as it says (monotonic)
    cancelled: int = 0
    granted: int = 0
    bounded: bool = True
    said_bounded: bool | None = None  # what the worker was last told
    admission: Admission | None = None  # the admission its grants were counted in
    no_room_s: float = 0.0
    starved_at: float | None = None  # waiting with no room since (monotonic)


class LineProtocol(asyncio.Protocol):
    """Either end of an admission socket: a JSON object a line, each handed to ``heard``; one
    not understood is logged and ignored, a line past ``MAX_LINE`` handed to ``too_long``."""

    #: Who this end talks to, for the log.
    name = "admission channel"

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's classes

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE:
                self.too_long()
            return
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                self.heard(json.loads(line))
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("%s: an admission message not understood (%r); ignored", self.name, exc)
        self.lines_handled()

    def heard(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def too_long(self) -> None:
        raise NotImplementedError

    def lines_handled(self) -> None:
        """After the lines one read brought were handed on."""


class WorkerChannel(LineProtocol):
    """The service's end of one worker's admission socket (``serve_worker``)."""

    def __init__(self, policy: Policy, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.policy = policy
        self.name = name
        self._clock = clock
        self.demands: dict[str, _Demand] = {}
        self._said_state: dict[str, Any] | None = None  # the policy's state as last said
        self._listening: dict[int, tuple[Admission, Callable[[], None]]] = {}
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- the protocol ---------------------------------------------------------------------

    def too_long(self) -> None:
        logger.warning("%s: an admission message too long; the channel is closed", self.name)
        self.close()

    def heard(self, message: dict[str, Any]) -> None:
        self.said(message)

    def lines_handled(self) -> None:
        self.pump(changed=self._said_state is None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        for _, stop in self._listening.values():
            stop()
        self._listening.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- what the worker says ---------------------------------------------------------------

    def said(self, message: dict[str, Any]) -> None:
        task = str(message["task"])
        demand = self.demands.setdefault(task, _Demand())
        demand.worker = str(message.get("worker") or self.name)
        demand.asked = max(demand.asked, int(message.get("asked", 0)))
        demand.taken = max(demand.taken, int(message.get("taken", 0)))
        demand.waiting = bool(message.get("waiting", False))
        since = message.get("since")
        demand.waiting_since = float(since) if demand.waiting and isinstance(since, (int, float)) else None
        if not demand.waiting:
            demand.starved_at = None
        cancelled = int(message.get("cancelled", 0))
        if cancelled > demand.cancelled:
            demand.cancelled = cancelled
            admission = self.policy.admission(task)
            if admission is not None:
                admission.report_cancelled(demand.worker, cancelled)
        if message.get("done"):  # the run is over: what it did not take is free, its totals start again
            self._release(demand)
            del self.demands[task]

    # -- grants -----------------------------------------------------------------------------

    def pump(self, *, changed: bool = False) -> None:
        """Grant each task what its admission has room for now, up to its demand; say the
        policy's state first when it changed (taken after the grants: a grant made for the
        next version comes after the pause that made its room). Called at each admission's
        notify (each write, each read): nothing to do unless the worker asks for more, or the
        policy ``changed``."""
        if self._transport is None or self._transport.is_closing():
            return
        if not changed and all(demand.asked <= demand.granted for demand in self.demands.values()):
            return
        answers = []
        for task, demand in self.demands.items():
            admission = self.policy.admission(task)
            if admission is not None and id(admission) not in self._listening:
                self._listening[id(admission)] = (admission, admission.listen(self.pump))
            if self._grant(demand, admission) or demand.said_bounded != demand.bounded:
                demand.said_bounded = demand.bounded
                answers.append(
                    {
                        "task": task,
                        "granted": demand.granted,
                        "bounded": demand.bounded,
                        "no_room_s": round(demand.no_room_s, 6),
                    }
                )
        state = self.policy.mirrored()
        if state != self._said_state:
            self._said_state = state
            answers.insert(0, {"policy": state})
        if answers:
            self._transport.write(b"".join(json.dumps(answer).encode() + b"\n" for answer in answers))

    def _grant(self, demand: _Demand, admission: Admission | None) -> int:
        """Admit what ``demand`` still asks for that there is room for; how many were."""
        want = demand.asked - demand.granted
        if want <= 0:
            return 0
        if admission is None or admission.capacity is None:  # no bound: the worker stops asking
            if admission is not None:
                admission.try_admit(want)
                admission.pushed += want
                demand.admission = admission
            demand.bounded = False
            demand.granted += want
            return want
        demand.admission = admission
        granted = admission.try_admit(want)
        now = self._clock()
        if granted:
            demand.granted += granted
            admission.pushed += granted
            if demand.starved_at is not None:
                demand.no_room_s += now - demand.starved_at
                demand.starved_at = None
        elif demand.waiting and demand.taken >= demand.granted and demand.starved_at is None:
            # The worker waits and there is no room for it: the bound's time, from when it began
            # to wait (the host's monotonic clock): no room was made for it meanwhile either.
            since = demand.waiting_since
            fresh = since is not None and now - MAX_CLOCK_SKEW_S < since <= now
            demand.starved_at = since if fresh else now
        return granted

    def release(self) -> None:
        """The worker is gone: what it was granted and did not take is freed."""
        for demand in self.demands.values():
            self._release(demand)

    @staticmethod
    def _release(demand: _Demand) -> None:
        unused = demand.granted - demand.taken
        if demand.admission is not None and demand.bounded and unused > 0:
            demand.admission.release(unused)
            demand.granted = demand.taken


async def serve_worker(
    policy: Policy, sock: socket.socket, name: str, channel: WorkerChannel | None = None
) -> None:
    """Serve one worker's admission on ``sock`` (the other end is the worker's) until it closes
    its end, or this is cancelled; what it was granted and did not take is freed then."""
    loop = asyncio.get_running_loop()
    channel = channel or WorkerChannel(policy, name)
    try:
        transport, _ = await loop.create_connection(lambda: channel, sock=sock)
    except OSError as exc:
        logger.warning("%s: no admission channel (%r): the worker asks over HTTP", name, exc)
        sock.close()
        return
    try:
        while not channel.closed.done():  # the policy's changes (a resume) said as they come
            ticket = policy.changed.ticket()
            channel.pump(changed=True)
            await asyncio.wait(
                [channel.closed, ticket.future], timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            ticket.cancel()
    finally:
        transport.close()
        channel.connection_lost(None)  # at once, not at the loop's next turn
