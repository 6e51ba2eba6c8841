"""Sync calls off the event loop, their results handed back in batches.

A sync reward runs in a thread so a slow one never blocks the loop. ``asyncio.to_thread`` per
trajectory cost a generator's worker a quarter of its CPU at 2,000 trajectories in flight: an
executor future chained to an asyncio one, a thread woken and a wake-up of the loop per call.
``Offload`` keeps a few threads on one queue, busy threads take the next call without a
wake-up, and the results that finish while the loop is busy go back in one wake-up of it: the
first result to finish schedules the hand-back, the others join it.

As with ``to_thread``: up to ``max_threads`` calls run at once (the default executor's
``min(32, cores + 4)``), each in a copy of its caller's context; an exception is raised to the
awaiting caller; a caller cancelled while its call runs just does not get the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

_Call = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]
_Done = tuple["asyncio.Future[Any]", Any, BaseException | None]


class Offload:
    """Threads for sync calls of one event loop (made on it); ``close`` stops them."""

    def __init__(self, max_threads: int | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._max_threads = max_threads or min(32, (os.cpu_count() or 1) + 4)
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._done: list[_Done] = []  # results for the loop's next hand-back

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in one of the threads."""
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls.put((contextvars.copy_context(), fn, args, future))
        with self._lock:
            start = self._idle == 0 and self._threads < self._max_threads
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name="offload", daemon=True).start()
        return await future

    def close(self) -> None:
        """Let the threads end once the calls queued before are done (none is waited for)."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._calls.put(None)

    def _work(self) -> None:
        calls = self._calls
        while True:
            try:
                call = calls.get_nowait()
            except queue.Empty:
                with self._lock:
                    self._idle += 1
                call = calls.get()
                with self._lock:
                    self._idle -= 1
            if call is None:
                break
            context, fn, args, future = call
            try:
                outcome: _Done = (future, context.run(fn, *args), None)
            except BaseException as exc:  # the caller's to judge, as with to_thread
                outcome = (future, None, exc)
            with self._lock:
                self._done.append(outcome)
                wake = len(self._done) == 1  # else a hand-back is on its way: it takes this one too
            if wake:
                with contextlib.suppress(RuntimeError):  # the loop is closed: no one waits any more
                    self._loop.call_soon_threadsafe(self._hand_back)
        with self._lock:
            self._threads -= 1

    def _hand_back(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        _settle(done)


def _settle(done: list[_Done]) -> None:
    for future, result, error in done:
        if future.done():  # its caller was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
