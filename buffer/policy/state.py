"""The policy the engines serve, as the trainer reports it, and what the buffer does with it."""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from buffer.errors import RolloutBufferError
from buffer.policy.admission import Admission
from buffer.policy.gate import Gate
from buffer.signal import Signal

PauseMode = Literal["abort", "drain"]
#: Upper bounds of the served-lag histogram (versions; +Inf implied).
LAG_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
#: How long a worker whose watch has ended still counts as live: one that follows the policy
#: watches again at once; one silent longer has gone, and what it had in flight with it.
WORKER_GRACE_S = 10.0


class PolicyError(RolloutBufferError):
    """A version lower than the current one: versions only go up."""

    status_code = 409


@dataclass(slots=True)
class _Worker:
    """A generator elsewhere mirroring the gate (``GET /policy/watch``): what it last said."""

    report: int = -1  # its own count of reports: one overtaken by a later one is dropped
    pause: int | None = None  # the pause its gate is closed for; None while open
    in_flight: int = 0  # its engine requests past its gate
    watching: int = 0  # its watches open now
    seen_at: float = 0.0


class Policy:
    """One buffer's policy version, pause state, admissions and their counters; thread-safe.

    ``version`` stays None until the trainer first says one; until then nothing is stale and
    no lag is measured (a trainer that never calls ``/policy`` sees the buffer as before)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        outcomes: Callable[[str], tuple[int, int, int]] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        #: A task's groups made in full, by outcome (the buffer's ``group_outcomes``): admission's
        #: keep-rate. None: every group pending is counted as one the trainer will be served.
        self._outcomes = outcomes
        self.version: int | None = None
        self.gate = Gate(clock)
        self.mode: PauseMode | None = None
        #: Pauses so far: a worker says which one its gate is closed for.
        self.pauses = 0
        #: Workers mirroring the gate, by the name they watch under.
        self._workers: dict[str, _Worker] = {}
        #: Notified when a worker reports or stops watching (``drained``).
        self.reported = Signal()
        #: The engines the current pause named, told at its resume; cleared by the resume.
        self.engine_urls: list[str] = []
        #: The engines' kind as the trainer said it ("auto": found per URL), and as found.
        self.engine_kind = "auto"
        self.engine_kinds: dict[str, str] = {}
        self.admissions: dict[str, Admission] = {}
        #: The trainer's batch (groups) as ``POST /policy`` declared it, by task (None: every task).
        self.batches: dict[str | None, int] = {}
        #: Served groups by version lag (trainer's version - the group's lowest).
        self.lag: Counter[int] = Counter()
        self.lag_sum = 0
        self.served_groups: Counter[str] = Counter()
        self.served_items: Counter[str] = Counter()
        self.stale: Counter[str] = Counter()
        self.mixed_reads = 0
        self.short_reads = 0
        #: Notified when the version or the pause state changes (``GET /policy/watch``).
        self.changed = Signal()
        #: Why the last resume was refused (a lower version): paused until a valid one; None after.
        self.resume_refused: str | None = None

    # -- versions and pause --------------------------------------------------------------

    def set_version(self, version: int) -> None:
        with self._lock:
            if self.version is not None and version < self.version:
                raise PolicyError(f"version {version} is lower than the current version {self.version}")
            changed = version != self.version
            self.version = version
            self.gate.version = version
        if changed:  # the trainer's next batch: admission counts what it serves from here
            for admission in list(self.admissions.values()):
                admission.new_version()
        self.notify()
        self.changed.notify()

    def pause(self, mode: PauseMode) -> bool:
        """Close the gate; False when it already was."""
        self.mode = mode
        with self._lock:
            closed = self.gate.pause()
            if closed:
                self.pauses += 1
        self.notify()  # what is admitted now starts under the next version: room for a batch more
        self.changed.notify()
        return closed

    def resume(self, version: int | None) -> None:
        """Open the gate at ``version``; a lower one than the current is refused (``PolicyError``)
        and generation stays paused until a valid one comes, the reason in ``resume_refused``."""
        if version is not None:
            try:
                self.set_version(version)
            except PolicyError as exc:
                self.resume_refused = f"resume refused, generation stays paused: {exc}"
                raise
        self.resume_refused = None
        self.mode = None
        self.gate.resume(self.version)
        self.changed.notify()

    def name_engines(self, urls: list[str], kind: str) -> None:
        """The engines this pause named (none: none), replacing any an earlier pause named:
        only these are told at the resume. Their kinds found before are kept, no others."""
        with self._lock:
            self.engine_urls = list(urls)
            self.engine_kind = kind
            for url in [url for url in self.engine_kinds if url not in self.engine_urls]:
                del self.engine_kinds[url]

    def forget_engines(self, told: list[str]) -> None:
        """The resume told ``told``: forgotten, unless a later pause has named its own since."""
        with self._lock:
            if self.engine_urls is told:
                self.engine_urls = []

    def state(self) -> dict[str, Any]:
        """What a generator elsewhere mirrors: the version and whether it may send requests."""
        return {"version": self.version, "paused": self.gate.paused}

    def mirrored(self) -> dict[str, Any]:
        """``state`` and the number of the last pause (``pause``), taken together: a mirror
        orders what it hears by them (``buffer.toolkit.remote_policy.order``)."""
        with self._lock:
            return {"version": self.version, "paused": self.gate.paused, "pause": self.pauses}

    # -- workers: generators elsewhere, mirroring the gate ------------------------------------

    def watch_begins(self, worker: str, report: int, pause: int | None, in_flight: int) -> None:
        """``worker`` watches the policy and says what its gate holds: ``in_flight`` requests,
        closed for pause number ``pause`` (None: open). It counts as live while it watches."""
        with self._lock:
            state = self._workers.setdefault(worker, _Worker())
            state.watching += 1
            state.seen_at = self._clock()
            if report >= state.report:
                state.report, state.pause, state.in_flight = report, pause, max(0, in_flight)
        self.reported.notify()

    def watch_ends(self, worker: str) -> None:
        with self._lock:
            state = self._workers.get(worker)
            if state is not None:
                state.watching -= 1
                state.seen_at = self._clock()
        self.reported.notify()

    def _live_workers(self) -> dict[str, _Worker]:
        """Workers watching, or that stopped within ``WORKER_GRACE_S``; forgets the others.
        Call under the lock."""
        now = self._clock()
        for name, state in list(self._workers.items()):
            if state.watching <= 0 and now - state.seen_at > WORKER_GRACE_S:
                del self._workers[name]
        return dict(self._workers)

    def in_flight(self) -> int:
        """Engine requests past the gate: the service's own, and each live worker's as it last said."""
        with self._lock:
            workers = sum(state.in_flight for state in self._live_workers().values())
        return self.gate.in_flight + workers

    def unpaused_workers(self) -> int:
        """Live workers that have not yet said their gate is closed for the current pause."""
        with self._lock:
            return sum(1 for state in self._live_workers().values() if state.pause != self.pauses)

    def _workers_drained(self) -> bool:
        with self._lock:
            return all(
                state.pause == self.pauses and state.in_flight == 0 for state in self._live_workers().values()
            )

    def _workers_closed(self) -> bool:
        with self._lock:
            return all(state.pause == self.pauses for state in self._live_workers().values())

    async def closed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every live worker to say its gate is closed for this
        pause, whatever it still has in flight. An abort waits for this: a request an engine
        aborts before the worker's gate is closed is continued at once and sent to the paused
        engine, where it stays in flight until the resume."""
        return await self._reported_until(self._workers_closed, timeout_s)

    async def drained(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for no engine request in flight: none past the service's own
        gate, and every live worker has said its gate is closed for this pause with none past
        it. A worker that dies stops counting once its watch ends and its grace is over."""
        deadline = self._clock() + timeout_s
        while True:
            if not await self.gate.drained(max(0.0, deadline - self._clock())):
                return False
            workers = await self._reported_until(self._workers_drained, max(0.0, deadline - self._clock()))
            if not workers:
                return False
            if self.gate.in_flight <= 0:
                return True

    async def _reported_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """``condition`` of the workers' reports, checked at each report and each second (a
        grace running out notifies nobody)."""
        return await self.reported.wait_until(condition, timeout_s, clock=self._clock, poll_s=1.0)

    # -- admission ---------------------------------------------------------------------

    def admission(self, task_type: str) -> Admission | None:
        return self.admissions.get(task_type)

    def start_admission(
        self,
        task_type: str,
        max_staleness: int | None,
        batch_groups: int | None,
        consumed: Callable[[], int],
        *,
        guess_groups: int = 1,
    ) -> Admission:
        """A new admission for a generator starting on ``task_type``: it counts from now.

        ``batch_groups``: the trainer's batch as it declared it (None: not declared); else the
        batch learnt from an earlier job's reads, else ``guess_groups`` until the first read."""
        with self._lock:
            old = self.admissions.get(task_type)
            if batch_groups is None:  # said by POST /policy before this job started
                batch_groups = self.batches.get(task_type, self.batches.get(None))
            declared = batch_groups is not None
            if batch_groups is None and old is not None and (old.declared or not old._guess):
                batch_groups, declared = old.batch_groups, old.declared
            admission = Admission(
                max_staleness,
                guess_groups if batch_groups is None else batch_groups,
                consumed,
                lambda: self.served_groups[task_type],
                lambda: self.gate.paused,
                declared=declared,
                versioned=self.version is not None,
                outcomes=None if self._outcomes is None else functools.partial(self._outcomes, task_type),
            )
            if batch_groups is not None and not declared:
                admission._guess = False  # learnt from the trainer's reads
            self.admissions[task_type] = admission
        return admission

    def start_job_admission(
        self, task_type: str, data: Mapping[str, Any], consumed: Callable[[], int]
    ) -> Admission:
        """The admission of a job of ``task_type`` run with ``data``, started or resumed after a
        restart alike: its ``max_staleness``, the trainer's ``rollout_batch_size`` (groups) if
        declared, else a first guess of ``num_process`` trajectories' groups."""
        group_size = max(1, int(data.get("num_repeat_per_sample") or 1))
        declared = data.get("rollout_batch_size")
        staleness = data.get("max_staleness")
        return self.start_admission(
            task_type,
            None if staleness is None else int(staleness),
            None if declared is None else int(declared),
            consumed,
            guess_groups=-(-int(data.get("num_process") or 100) // group_size),
        )

    def declare_batch(self, batch_groups: int, task_type: str | None = None) -> None:
        """The trainer's batch, in groups (``POST /policy``): for ``task_type``, or every task."""
        with self._lock:
            self.batches[task_type] = batch_groups
            admissions = [a for name, a in self.admissions.items() if task_type in (None, name)]
        for admission in admissions:
            admission.declare(batch_groups)

    def notify(self) -> None:
        for admission in list(self.admissions.values()):
            admission.notify()

    def written(self, task_type: str, item: Mapping[str, Any]) -> None:
        """A trajectory of ``task_type`` was written (a buffer's write observer): the group it
        finished may have been kept or dropped, which changes what admission lets start."""
        admission = self.admissions.get(task_type)
        if admission is not None:
            admission.notify()

    # -- reads ---------------------------------------------------------------------------

    def lag_of(self, span: tuple[int, int] | None) -> int | None:
        """How many versions the trainer is ahead of a group's lowest; None when unknown."""
        if span is None or self.version is None:
            return None
        return max(0, self.version - span[0])

    def served(self, task_type: str, items: int, lag: int | None) -> None:
        with self._lock:
            self.served_groups[task_type] += 1
            self.served_items[task_type] += items
            if lag is not None:
                self.lag[lag] += 1
                self.lag_sum += lag

    def count_stale(self, task_type: str, groups: int) -> None:
        with self._lock:
            self.stale[task_type] += groups

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            total = sum(self.served_groups.values())
            return {
                "version": self.version,
                "paused": self.gate.paused,
                "pause": self.pauses,
                "mode": self.mode,
                "resume_refused": self.resume_refused,
                "engine_urls": list(self.engine_urls),
                "engine_kinds": dict(self.engine_kinds),
                "gate": self.gate.snapshot(),
                "workers": {
                    name: {"paused": state.pause == self.pauses, "in_flight": state.in_flight}
                    for name, state in self._live_workers().items()
                },
                "served_groups": dict(self.served_groups),
                "shares": {task: round(n / total, 4) for task, n in self.served_groups.items()}
                if total
                else {},
                "stale_groups": dict(self.stale),
                "lag": {str(lag): count for lag, count in sorted(self.lag.items())},
                "mixed_reads": self.mixed_reads,
                "short_reads": self.short_reads,
                "admission": {task: a.snapshot() for task, a in self.admissions.items()},
            }


_registry: dict[str, Policy] = {}
_registry_lock = threading.Lock()


def _key(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def register_policy(buffer_url: str, policy: Policy) -> None:
    """Let in-process generators that write to ``buffer_url`` find its policy."""
    with _registry_lock:
        _registry[_key(buffer_url)] = policy


_current: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("current_policy", default=None)


def set_current_policy(policy: Policy) -> None:
    """Make ``policy`` the one generators started from this context find (a job's task
    copies the context it was created in)."""
    _current.set(policy)


def find_policy(buffer_url: str | None) -> Policy | None:
    """The policy of the service whose job this is, or of the one at ``buffer_url`` if it
    runs in this process; None for a generator writing to a buffer elsewhere."""
    if (policy := _current.get()) is not None:
        return policy
    if not buffer_url:
        return None
    with _registry_lock:
        return _registry.get(_key(buffer_url))


def follow_policy(
    policy: Policy, buffer_url: str, task_type: str, data: Mapping[str, Any], consumed: Callable[[], int]
) -> Admission:
    """A job of ``task_type`` starts (or is resumed after a restart) with ``data``: let its
    generator find the buffer's policy (in this process), and count its admissions from now."""
    register_policy(buffer_url, policy)
    set_current_policy(policy)  # the job's task is created in this context
    policy.gate.reset_stats()
    return policy.start_job_admission(task_type, data, consumed)
