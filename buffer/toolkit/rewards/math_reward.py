"""``MathReward``: is the model's final answer mathematically the label?

Two paths. The fast one (``answers.decide_fast``) settles the common cases in microseconds:
the boxed answer written like the label, or two plain numbers. Everything else goes to
math-verify, which parses LaTeX into sympy (some 8 ms a comparison, unbounded on nasty
input) and times itself out with ``signal.alarm``, so it only works in a main thread. It
runs in a small process pool, created on first use:

- at most ``max_workers`` comparisons are in flight, so ``timeout_s`` measures a comparison,
  not its wait in a queue; a busy pool slows callers down instead of failing them;
- a comparison that overruns ``timeout_s`` scores 0.0 with a warning, and its workers are
  killed (sympy can be stuck in C code no alarm interrupts) and replaced;
- comparisons lost to a worker that died are run once more on a fresh pool.

Workers start with the ``spawn`` method: forking a process that runs threads (the event
loop's executor, httpx) can deadlock the child.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from decimal import Decimal
from types import TracebackType
from typing import Any

from buffer.toolkit.rewards.answers import decide_fast, extract_boxed, normalize_answer
from buffer.toolkit.types import Episode, Sample

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # for worker processes to start and import sympy
_CANNOT_START = (
    "math-verify's worker processes do not start; a script that uses MathReward must create it"
    " under `if __name__ == '__main__':` (see the multiprocessing docs, 'Safe importing of main module')"
)


def math_verify_verdict(gold: str, prediction: str, budget_s: float) -> bool:
    """math-verify's judgement, in a worker process: does ``prediction`` state ``gold``?

    Both are texts math-verify extracts an answer from (``\\boxed{...}``, ``$...$``, or a
    sentence like "The answer is 42"). Each parse and comparison gets what is left of
    ``budget_s``, at least a second (``signal.alarm`` counts whole seconds).
    """
    from math_verify import parse, verify  # type: ignore[import-untyped]  # sympy: workers only

    deadline = time.monotonic() + budget_s

    def left_s() -> int:
        return max(1, math.ceil(deadline - time.monotonic()))

    expected = parse(gold, parsing_timeout=left_s())
    if not expected:
        return False
    answer = parse(prediction, parsing_timeout=left_s())
    if not answer:
        return False
    return bool(verify(expected, answer, timeout_seconds=left_s()))


def _warm_up() -> None:
    """Import sympy and build math-verify's parsers, before any comparison is timed."""
    math_verify_verdict("$1$", "$1$", 10.0)


class MathReward:
    """``await MathReward()(sample, episode)``: 1.0 when the answer equals ``sample.label``.

    The answer is the last ``\\boxed{...}`` of the response; without one, math-verify looks
    for an answer in the whole response. An empty response, an empty box or nothing
    math-verify can read scores 0.0; bad model output never raises. A sample without a
    label raises ``ValueError`` (the data set is wrong, not the model), and worker processes
    that cannot start raise ``RuntimeError``: a script that uses ``MathReward`` needs the
    ``if __name__ == "__main__":`` guard of every ``multiprocessing`` program.

    It owns a process pool: ``close()`` / ``await aclose()``, or use it as a (async) context
    manager. Call it from one event loop.
    """

    def __init__(self, *, max_workers: int = 1, timeout_s: float = 10.0) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # close() may run in another thread (aclose)
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(max_workers)
        self._starting = asyncio.Lock()

    @property
    def pool_started(self) -> bool:
        """Whether math-verify's worker processes are running (only the slow path starts them)."""
        return self._pool is not None

    async def __call__(self, sample: Sample, episode: Episode) -> float:
        if self._closed:
            raise RuntimeError("this MathReward is closed")
        label = _label_text(sample.label)
        expected = normalize_answer(label)
        if not expected:
            raise ValueError(f"sample {sample.instance_id!r} has an empty label")
        response = episode.response
        if not response.strip():
            return 0.0
        boxed = extract_boxed(response)
        if boxed is None:
            prediction = response  # math-verify has its own extraction
        else:
            answer = normalize_answer(boxed)
            if not answer:
                return 0.0
            verdict = decide_fast(answer, expected)
            if verdict is not None:
                return verdict
            prediction = f"\\boxed{{{answer}}}"
        return await self._verify(f"\\boxed{{{expected}}}", prediction)

    async def _verify(self, gold: str, prediction: str) -> float:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # asyncio primitives belong to one loop
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_workers)
            self._starting = asyncio.Lock()
        async with self._slots:
            for attempt in (1, 2):
                pool = await self._running_pool()
                try:
                    future = loop.run_in_executor(pool, math_verify_verdict, gold, prediction, self.timeout_s)
                    verdict = await asyncio.wait_for(future, self.timeout_s)
                except TimeoutError:
                    logger.warning(
                        "math-verify took over %.1f s to compare %.200r with %.200r; scoring 0.0",
                        self.timeout_s,
                        prediction,
                        gold,
                    )
                    self._discard(pool)
                    return 0.0
                except asyncio.CancelledError:
                    self._discard(pool)  # the worker may be stuck on it; nobody is waiting any more
                    raise
                except BrokenProcessPool:
                    self._discard(pool)
                    if attempt == 1:
                        continue  # perhaps another comparison killed it; a new pool has started fine
                    logger.warning("math-verify's worker died comparing %.200r; scoring 0.0", prediction)
                    return 0.0
                return 1.0 if verdict else 0.0
        raise AssertionError("unreachable")  # pragma: no cover

    async def _running_pool(self) -> ProcessPoolExecutor:
        """The pool, started if need be, its workers past start-up before any comparison."""
        async with self._starting:
            with self._lock:
                if self._closed:
                    raise RuntimeError("this MathReward is closed")
                if self._pool is not None:
                    return self._pool
            pool = ProcessPoolExecutor(self.max_workers, mp_context=multiprocessing.get_context("spawn"))
            loop = asyncio.get_running_loop()
            try:
                warm_ups = [loop.run_in_executor(pool, _warm_up) for _ in range(self.max_workers)]
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*warm_ups, return_exceptions=True), _START_TIMEOUT_S
                )
                errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
                if errors and isinstance(errors[0], BrokenProcessPool):
                    raise RuntimeError(_CANNOT_START) from errors[0]
                if errors:
                    raise errors[0]  # math-verify missing, most likely
                with self._lock:
                    if self._closed:
                        raise RuntimeError("this MathReward is closed")
                    self._pool = pool
            except TimeoutError as exc:
                _kill(pool)
                raise RuntimeError(_CANNOT_START) from exc
            except BaseException:
                _kill(pool)
                raise
            return pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        """Kill a broken or stuck pool; the next comparison starts a new one."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        _kill(pool)

    def close(self) -> None:
        """Stop the workers: each may finish its comparison for up to ``timeout_s``."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = _processes(pool)
        pool.shutdown(wait=False)
        deadline = time.monotonic() + self.timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> MathReward:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> MathReward:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _label_text(label: Any) -> str:
    if label is None:
        raise ValueError("the sample has no label to compare the answer with")
    if isinstance(label, float) and math.isfinite(label):
        return format(Decimal(repr(label)), "f")  # 1e-07 → 0.0000001, which math-verify reads
    return label if isinstance(label, str) else str(label)


def _processes(pool: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    # CPython keeps its workers in ``_processes`` (pid → process) until shutdown.
    return list((getattr(pool, "_processes", None) or {}).values())


def _kill(pool: ProcessPoolExecutor) -> None:
    # Comparisons still queued fail with BrokenProcessPool, and are run again on a new pool.
    processes = _processes(pool)
    pool.shutdown(wait=False)
    for process in processes:
        process.kill()
