"""A wake-up call that works across threads and event loops: the one the service uses.

The buffer's core is called from generator threads as well as the event loop, and the policy's
gate is awaited on the loops of the service and of in-process generators alike, so each waiter
keeps a ticket (a future on its own loop) and ``notify`` resolves every ticket thread-safely. The
long-polling reads wait on one (``wait_until``: ready items), the policy on three (the gate's
opening, its idleness, admission), the trainer's watch on another (a policy change).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable


class Ticket:
    """One waiter's place in a ``Signal``: taken before the condition is checked, so a
    ``notify`` between the check and the wait is not missed."""

    def __init__(self, signal: Signal, loop: asyncio.AbstractEventLoop) -> None:
        self._signal = signal
        self._loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    async def wait(self, timeout_s: float | None = None) -> None:
        """Return at the ``notify`` after the ticket was taken, or after ``timeout_s``."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.future), timeout_s)
        finally:
            self.cancel()

    def cancel(self) -> None:
        self._signal._forget(self)


class Signal:
    """``notify`` wakes every coroutine waiting, whatever loop or thread each runs on.

    The buffer's core is called from generator threads as well as the event loop, so an
    ``asyncio.Event`` (bound to one loop, not thread-safe) will not do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[Ticket] = []

    def ticket(self) -> Ticket:
        ticket = Ticket(self, asyncio.get_running_loop())
        with self._lock:
            self._waiters.append(ticket)
        return ticket

    async def wait(self, timeout_s: float | None = None) -> None:
        """Return at the next ``notify``, or after ``timeout_s``."""
        await self.ticket().wait(timeout_s)

    async def wait_until(
        self,
        condition: Callable[[], bool],
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ) -> bool:
        """Wait up to ``timeout_s`` (by ``clock``) for ``condition()``, checked at each
        ``notify`` and, with ``poll_s``, at least that often (for a condition that time alone
        can make true); returns its last value. The ticket is taken before each check, so a
        notify in between is not missed."""
        deadline = clock() + timeout_s
        while True:
            ticket = self.ticket()
            if condition():
                ticket.cancel()
                return True
            remaining = deadline - clock()
            if remaining <= 0:
                ticket.cancel()
                return False
            await ticket.wait(remaining if poll_s is None else min(remaining, poll_s))

    def _forget(self, ticket: Ticket) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._waiters.remove(ticket)

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for ticket in waiters:
            with contextlib.suppress(RuntimeError):  # a loop that has closed
                ticket._loop.call_soon_threadsafe(_resolve, ticket.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
