"""Waking long-polling reads when a group becomes ready, from any thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable


class ReadySignal:
    """A broadcast: every waiter wakes on the next ``notify``. Create it on the event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._event = asyncio.Event()

    def notify(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self._fire()
        else:
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``condition()``; returns its last value. Never blocks the loop."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = self._event  # taken before the check, so a notify in between is not missed
            if condition():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return condition()
