"""A worker's processes as the kernel sees them: who descends from whom, and tying a worker's
life to its service's.

Standard library only (a worker imports it before its generator, and the service too):

- ``set_parent_death_signal``: Linux's ``PR_SET_PDEATHSIG``, the signal the kernel sends this
  process when the thread that started it exits;
- ``become_subreaper``: Linux's ``PR_SET_CHILD_SUBREAPER``: a process orphaned below this one
  (a generator's ``setsid`` daemon whose parent exited) is re-parented to it, not to init, so
  it stays among ``descendants`` and is killed with them;
- ``descendants`` and ``kill_descendants``: the process tree below a pid, read from
  ``/proc/*/stat`` (empty where there is no ``/proc``);
- ``watch_lifeline``: a thread that blocks on the read end of a pipe whose write end only the
  service holds; end of file means the service is gone (the kernel closes a dead process's
  files), on every system with pipes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: How many times ``kill_descendants`` looks again for processes started while it was killing.
KILL_ROUNDS = 50


def _prctl(option: int, value: int) -> bool:
    if sys.platform != "linux":
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` (0: nothing) to this process when its parent's thread that
    started it exits (Linux); whether it could."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Make orphans below this process its children again rather than init's (Linux); whether
    it could."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _living_parents() -> dict[int, int]:
    """Every living process's parent (zombies left out: they run no code)."""
    parents: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return parents
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] not in ("Z", "X"):
                parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def descendants(pid: int) -> list[int]:
    """The living processes below ``pid``, parents before their children."""
    children: dict[int, list[int]] = {}
    for child, parent in _living_parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    queue = list(children.get(pid, ()))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, ()))
    return found


def kill_descendants(pid: int, rounds: int = KILL_ROUNDS) -> bool:
    """SIGKILL every process below ``pid``, again until none is left (one may start another
    while it goes: with ``pid`` a subreaper, the orphan stays below it and is found next
    round); whether none is left. Blocking (reads /proc): call it in a thread from async code."""
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            return True
        for child in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        time.sleep(0.01)
    return not descendants(pid)


def watch_lifeline(fd: int, gone: Callable[[], None]) -> None:
    """Call ``gone`` (in a daemon thread) once the pipe ``fd`` reads end of file: the process
    holding its write end has exited."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 4096):
                pass
        gone()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
