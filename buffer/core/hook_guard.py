"""A time limit on a generator's hooks, which run in the service.

Hooks (``is_valid_group``, ``filter_item``, ...) are plain functions the buffer calls while it
finishes a group, on the service's event loop. Python cannot interrupt a function that blocks,
so each hook a generator overrides runs on a daemon thread of its own and its caller waits at
most ``limit_s`` for the answer: a hook that blocks holds the service up once, for at most that
long, and raises ``HookTimeout`` (the group is set aside, as for any failing hook). While that
call is still stuck, later calls fail at once rather than queue behind it; once it returns, the
hook is used again. The defaults of ``default_func`` are the buffer's own and run directly.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

from buffer.core.hooks import HookFn, Hooks
from default_func import HOOKS


class HookTimeout(Exception):
    """A hook did not return within its time limit."""


@dataclasses.dataclass(slots=True)
class _Call:
    args: tuple[Any, ...]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    started: float = dataclasses.field(default_factory=time.monotonic)
    result: Any = None
    error: BaseException | None = None


class GuardedHook:
    """``fn`` called on its own thread, waited for at most ``limit_s``."""

    def __init__(self, name: str, fn: HookFn, limit_s: float) -> None:
        self.name = name
        self.__wrapped__ = fn
        self._fn = fn
        self._limit_s = limit_s
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stuck: _Call | None = None

    def __call__(self, *args: Any) -> Any:
        stuck = self._stuck
        if stuck is not None:
            if not stuck.done.is_set():
                waited = time.monotonic() - stuck.started
                raise HookTimeout(f"{self.name} is still in a call it started {waited:.0f} s ago")
            self._stuck = None
        call = _Call(args)
        self._ensure_thread()
        self._calls.put(call)
        if not call.done.wait(self._limit_s):
            self._stuck = call
            raise HookTimeout(f"{self.name} did not return within {self._limit_s:g} s")
        if call.error is not None:
            raise call.error
        return call.result

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"hook-{self.name}", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call.result = self._fn(*call.args)
            except BaseException as exc:  # handed to the caller, which decides
                call.error = exc
            finally:
                call.done.set()


def guard_hooks(hooks: Hooks, limit_s: float) -> Hooks:
    """``hooks`` with each overridden one under a time limit of ``limit_s``."""
    guarded: dict[str, Any] = {
        name: GuardedHook(name, getattr(hooks, name), limit_s) for name in HOOKS if name in hooks.overridden
    }
    return dataclasses.replace(hooks, **guarded) if guarded else hooks
