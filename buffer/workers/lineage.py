"""A worker's processes as the kernel sees them: who descends from whom, and tying a worker's
life to its service's.

Standard library only (a worker imports it before its generator, and the service too):

- ``set_parent_death_signal``: Linux's ``PR_SET_PDEATHSIG``, the signal the kernel sends this
  process when the thread that started it exits;
- ``become_subreaper``: Linux's ``PR_SET_CHILD_SUBREAPER``: a process orphaned below this one
  (a generator's ``setsid`` daemon whose parent exited) is re-parented to it, not to init, so
  it stays among ``descendants`` and is killed with them;
- ``descendants`` and ``kill_descendants``: the process tree below a pid, read from
  ``/proc/*/stat`` (empty where there is no ``/proc``); ``reap_children``, a worker's last
  act, so that the orphans it adopted and outlived are not handed on as zombies;
- ``watch_lifeline``: a thread that blocks on the read end of a pipe whose write end only the
  service holds; end of file means the service is gone (the kernel closes a dead process's
  files), on every system with pipes;
- ``WORKER_MARK`` and ``end_lineage``: the service's side, for a worker killed from outside
  (SIGKILL: the OOM killer, an operator), which could kill nothing it started. Each worker's
  environment carries a mark of its own, which every process below it inherits (detached or
  not); once the worker has exited, the service kills every process carrying the mark, or in
  the worker's session or process group, and those below them (re-parented to init, which
  reaps them: the service is no subreaper, it would collect every stray zombie). Processes
  are held by pidfd between reading ``/proc`` and signalling, so a pid reused meanwhile is
  never hit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: How many times ``kill_descendants`` and ``end_lineage`` look again for processes started
#: while they were killing.
KILL_ROUNDS = 50
#: The environment variable that marks a worker's processes: a value of its own for each worker
#: (``new_mark``), inherited by whatever its generator starts.
WORKER_MARK = "ROLLOUT_BUFFER_WORKER"


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


def reap_children() -> None:
    """Wait for every exited child of this process. Only as its last act: it takes the exit
    status a ``subprocess.Popen`` of its own still waits for. A worker's, so that the orphans
    it adopted and outlived are not left as zombies (they would be init's after it)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def watch_lifeline(fd: int, gone: Callable[[], None]) -> None:
    """Call ``gone`` (in a daemon thread) once the pipe ``fd`` reads end of file: the process
    holding its write end has exited."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 4096):
                pass
        gone()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def new_mark(name: str) -> str:
    """A value of ``WORKER_MARK`` no other worker has: ``name`` (to read in ``ps e``), then a
    random part."""
    return f"{name}:{secrets.token_hex(8)}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Process:
    pid: int
    parent: int
    group: int
    session: int
    #: Clock ticks after boot when it started: with its pid, which process this is.
    started: int
    zombie: bool
    #: Its ``WORKER_MARK`` (None: without one, or unreadable, a zombie's or another user's).
    mark: str | None = None


def _read_stat(pid: int) -> _Process | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return _Process(
            pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0] in ("Z", "X")
        )
    except (OSError, IndexError, ValueError):
        return None


def _processes() -> dict[int, _Process]:
    """Every process in ``/proc``, with its mark (empty where there is none). ``/proc`` is listed
    again until it shows none not read yet: a process that forks and exits (a daemon leaving
    its parent) while it is read is not missed, its child being new in the next listing."""
    found: dict[int, _Process] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    seen: set[int] = set()
    for _ in range(KILL_ROUNDS):
        new = {int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()} - seen
        if not new:
            break
        seen |= new
        for pid in new:
            if (process := _read_stat(pid)) is not None:
                found[pid] = dataclasses.replace(process, mark=_mark_of(pid))
    return found


def _mark_of(pid: int) -> str | None:
    """The ``WORKER_MARK`` process ``pid`` started with; None without one, or unreadable (a
    zombie's, another user's)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = WORKER_MARK.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _members(mark: str, leader: int) -> list[_Process]:
    """The processes left of the worker ``leader`` (exited) whose environment carried ``mark``:
    those carrying it, those in its session or process group that carry no other worker's
    (unless ``leader``'s pid has a new process: then its session is no longer the worker's),
    and every process below one of them. Never this process nor its ancestors, nor ``leader``."""
    processes = _processes()
    spared = {leader}
    pid = os.getpid()
    while pid in processes and pid not in spared:  # this process and its ancestors
        spared.add(pid)
        pid = processes[pid].parent
    own_session = leader not in processes  # while a process is in it, its number is not reused
    found: dict[int, _Process] = {}
    for process in processes.values():
        if process.pid in spared:
            continue
        carried = process.mark
        in_session = own_session and leader in (process.session, process.group) and carried is None
        if carried == mark or in_session:
            found[process.pid] = process
    children: dict[int, list[_Process]] = {}
    for process in processes.values():
        children.setdefault(process.parent, []).append(process)
    queue = list(found.values())
    while queue:
        for child in children.get(queue.pop().pid, ()):
            if child.pid not in found and child.pid not in spared:
                found[child.pid] = child
                queue.append(child)
    return list(found.values())


def _hold(process: _Process) -> int | None:
    """A pidfd for ``process``, if it is still the process read from ``/proc`` (not exited and
    reaped, its pid given to another, in between); None if not. Without pidfds (Linux < 5.3),
    a living one is SIGKILLed by pid here, and not reaped."""
    try:
        fd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return None
    except OSError:
        now = _read_stat(process.pid)
        if not process.zombie and now is not None and now.started == process.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
        return None
    now = _read_stat(process.pid)
    if now is None or now.started != process.started:
        os.close(fd)
        return None
    return fd


def _settle(held: dict[int, int]) -> bool:
    """Reap what of ``held`` exited as this process's child (adopted: its parent died first);
    forget what exited as another's, which that one reaps. Whether any of them still runs."""
    running = False
    for pid, fd in list(held.items()):
        try:
            if os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is None:
                running = True  # its SIGKILL is on its way
                continue
        except ChildProcessError:  # not this process's child (or reaped by its parent)
            if not _exited(fd):
                running = True
                continue
        except OSError:
            pass
        os.close(fd)
        del held[pid]
    return running


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd reads then)."""
    poll = select.poll()  # not select(): a service's descriptors go past FD_SETSIZE
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def end_lineage(mark: str, leader: int, rounds: int = KILL_ROUNDS) -> bool:
    """SIGKILL what is left of the worker ``leader`` (exited and reaped: ``_members``), again
    until nothing is (one may fork while it goes), and reap those re-parented to this process;
    whether none is left running. Each is held by a pidfd from its reading to its end, so no
    other process is signalled or reaped; a process this one did not adopt is never waited for.
    Blocking (reads /proc): call it in a thread from async code."""
    held: dict[int, int] = {}
    try:
        for _ in range(rounds):
            members = _members(mark, leader)
            for process in members:
                if process.pid not in held and (fd := _hold(process)) is not None:
                    held[process.pid] = fd
                    if not process.zombie:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            signal.pidfd_send_signal(fd, signal.SIGKILL)
            running = _settle(held)
            if not running and not any(not process.zombie for process in members):
                return True
            time.sleep(0.01)
        return not _settle(held)
    finally:
        for fd in held.values():
            os.close(fd)
