"""Sync calls in ``Offload``'s threads: off the loop, concurrent, in the caller's context, with
their exceptions, and a slow call does not hold back the results of the calls before it."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from buffer.toolkit.offload import Offload

pytestmark = pytest.mark.anyio

where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")


async def test_calls_run_off_the_loop_in_the_callers_context_and_raise_to_it() -> None:
    offload = Offload()
    loop_thread = threading.get_ident()

    def call(n: int) -> tuple[int, bool, str]:
        return n * 2, threading.get_ident() != loop_thread, where.get()

    def fail() -> None:
        raise KeyError("bad")

    where.set("caller")
    try:
        results = await asyncio.gather(*(offload.run(call, n) for n in range(200)))
        assert results == [(n * 2, True, "caller") for n in range(200)]
        with pytest.raises(KeyError, match="bad"):
            await offload.run(fail)
    finally:
        offload.close()


async def test_blocking_calls_run_at_once_up_to_max_threads() -> None:
    offload = Offload(max_threads=4)
    together = threading.Barrier(4, timeout=60)  # passed only by 4 calls running at once
    try:
        await asyncio.gather(*(offload.run(together.wait) for _ in range(4)))
    finally:
        offload.close()


async def test_a_slow_call_does_not_hold_back_the_results_before_it() -> None:
    offload = Offload(max_threads=1)
    release = threading.Event()
    try:
        quick = asyncio.ensure_future(offload.run(lambda: "quick"))
        slow = asyncio.ensure_future(offload.run(release.wait, 60))
        assert await quick == "quick"
        assert not slow.done()  # the slow call is still running: the quick one did not wait for it
        release.set()
        assert await slow is True
    finally:
        release.set()
        offload.close()


async def test_a_cancelled_caller_leaves_the_others_their_results() -> None:
    offload = Offload(max_threads=1)
    try:
        gone = asyncio.ensure_future(offload.run(time.sleep, 0.1))
        kept = asyncio.ensure_future(offload.run(lambda: 7))
        await asyncio.sleep(0.01)
        gone.cancel()
        assert await kept == 7
    finally:
        offload.close()
