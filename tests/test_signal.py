"""The wake-up call the long-polling reads and the policy wait on (``buffer.signal``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from buffer.signal import Signal

pytestmark = pytest.mark.anyio


async def test_a_wait_ends_when_a_thread_makes_the_condition_true_and_notifies() -> None:
    signal = Signal()
    ready: list[int] = []

    def producer() -> None:
        ready.append(1)
        signal.notify()

    waiting = asyncio.ensure_future(signal.wait_until(lambda: bool(ready), timeout_s=60.0))
    await asyncio.sleep(0)  # the waiter has its ticket
    threading.Thread(target=producer).start()
    assert await asyncio.wait_for(waiting, 30.0) is True


async def test_a_condition_already_true_returns_at_once_and_leaves_no_waiter() -> None:
    signal = Signal()
    assert await signal.wait_until(lambda: True, timeout_s=60.0) is True
    assert signal._waiters == []


async def test_a_condition_never_true_returns_false_when_the_time_is_up() -> None:
    signal = Signal()
    assert await signal.wait_until(lambda: False, timeout_s=0.01) is False
    assert signal._waiters == []


async def test_a_notify_that_does_not_make_the_condition_true_keeps_the_wait_going() -> None:
    signal = Signal()
    checks: list[int] = []

    def condition() -> bool:
        checks.append(1)
        return len(checks) >= 3

    waiting = asyncio.ensure_future(signal.wait_until(condition, timeout_s=60.0))
    for _ in range(3000):  # each notify wakes the waiter, which checks again and waits on
        if waiting.done():
            break
        signal.notify()
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(waiting, 30.0) is True
    assert len(checks) == 3
