"""A worker's progress (``current_job().progress``, the toolkit's counts), pushed to the service.

Each worker process writes its reports down a pipe the service starts it with (beside its
lifeline), one JSON object a line; the service reads the pipe on its event loop and keeps each
worker's last report, from which ``/jobs``, ``/metrics``, the dashboard and the demo all read
(``Job.reported_progress``). The worker's last report goes down the pipe before it closes it
at its exit, and the service reads to the end of file before it takes the worker for gone: no
count is lost at an exit, and none is read from a file caught half written or already removed.

Why a pipe and not Prometheus' multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
``MultiProcessCollector``): what a job reports is more than counters and histograms (its plan's
``total``, ``in_flight``, ``elapsed_s``, failures by kind, the gate's figures) and ``GET
/jobs/{id}`` shows it per job and per worker, where multiprocess files are summed per metric
over every process; a job's counts leave the metrics when the service forgets the job, where
those files stay until deleted; a Ray actor on another machine shares no folder with the
service; and the toolkit would have to keep process-wide metric objects (module globals) and
depend on ``prometheus_client`` in every generator's process. A pipe carries the same report
whatever the worker is, and the service still builds its metrics from it at scrape time
(``buffer.service.metrics``).

Reports are pushed, not polled: ``ReportedProgress`` (the job's ``progress`` dict in a worker)
hands every change to ``ProgressPipe.send``, which serialises it there and lets a thread of its
own write the latest (reports made meanwhile fold into it): a service slow to read never holds
up the generator. A job's workers' reports add up to one (``merged_reports``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

logger = logging.getLogger(__name__)

#: A report longer than this (a generator putting its data set in its progress) is dropped.
MAX_REPORT_BYTES = 1024 * 1024
#: How long a worker's exit waits for its last report to go down the pipe.
CLOSE_WAIT_S = 5.0

Report = Callable[[dict[str, Any]], None]


class ReportedProgress(dict[str, Any]):
    """A job's ``progress`` in a worker: each change (a key set, ``update``, ...) is reported
    whole to ``report``. A change inside a value (a nested dict), or by ``|=``, is not seen:
    set the key, or ``update``."""

    def __init__(self, report: Report) -> None:
        super().__init__()
        self._report = report

    def _changed(self) -> None:
        self._report(dict(self))

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, key: str, default: Any = None) -> Any:
        value = super().setdefault(key, default)
        self._changed()
        return value

    def pop(self, key: str, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._changed()
        return value

    def popitem(self) -> tuple[str, Any]:
        item = super().popitem()
        self._changed()
        return item

    def clear(self) -> None:
        super().clear()
        self._changed()

    def __reduce__(self) -> Any:  # copies and pickles are plain dicts
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return f"ReportedProgress({dict.__repr__(self)})"


class ProgressPipe:
    """The worker's end of its progress pipe (``fd``, written by a thread of its own)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Condition()
        self._latest: bytes | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._write, name="progress", daemon=True)
        self._thread.start()

    def send(self, progress: dict[str, Any]) -> None:
        """Report ``progress`` (any thread): the latest report not yet written replaces it."""
        line = json.dumps(progress, default=str).encode() + b"\n"
        if len(line) > MAX_REPORT_BYTES:
            logger.warning("a progress report of %d bytes is too long to send; dropped", len(line))
            return
        with self._lock:
            self._latest = line
            self._lock.notify()

    def close(self) -> None:
        """Write what is left and close the pipe: the service reads its end of file."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(CLOSE_WAIT_S)
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _write(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._latest is not None or self._closing)
                line, self._latest = self._latest, None
                closing = self._closing
            if line is not None:
                try:
                    _write_all(self._fd, line)
                except OSError:  # the service is gone: nobody reads any more
                    return
            if closing and line is None:
                return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextlib.asynccontextmanager
async def pipe_stream(fd: int, limit: int) -> AsyncIterator[asyncio.StreamReader]:
    """The read end of a pipe ``fd`` as a stream on the running loop (opening a pipe does not
    block), closed on leaving, ``fd`` with it; ``limit`` bounds a line."""
    loop = asyncio.get_running_loop()
    stream = asyncio.StreamReader(limit=limit)
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), pipe)
    except BaseException:
        pipe.close()
        raise
    try:
        yield stream
    finally:
        transport.close()


async def receive(fd: int, keep: Report, name: str) -> None:
    """Read the reports of the pipe ``fd`` (closed when done) until its end of file, handing
    each to ``keep``; ``name`` tags what is logged."""
    async with pipe_stream(fd, MAX_REPORT_BYTES) as stream:
        while True:
            try:
                line = await stream.readline()
            except (asyncio.LimitOverrunError, ValueError):
                logger.warning("%s: a progress report too long to read; the rest is ignored", name)
                while await stream.read(65536):  # drained, so its writer never blocks
                    pass
                return
            if not line:
                return
            try:
                report = json.loads(line)
            except ValueError:
                logger.warning("%s: a progress report that is not JSON; ignored", name)
                continue
            if isinstance(report, dict):
                keep(report)


#: What a worker reports of now, not of its whole run: left out once it has ended.
RATES = ("trajectories_per_s", "in_flight")


def merged_reports(reports: list[tuple[dict[str, Any], bool]]) -> dict[str, Any]:
    """One job's progress from its workers' last reports, each with whether that worker has
    ended (while others run, an ended one's counts stay, not its ``RATES``): numbers added up
    (``elapsed_s``: the longest), counts by name (finish reasons, latency buckets) added up by
    name, anything else the first's. The reports themselves are left as they are."""
    running = not all(ended for _, ended in reports)
    merged: dict[str, Any] = {}
    for report, ended in reports:
        for key, value in report.items():
            if ended and running and key in RATES:
                continue
            if key not in merged:
                merged[key] = dict(value) if isinstance(value, dict) else value
            elif key == "elapsed_s" and _number(value) and _number(merged[key]):
                merged[key] = max(merged[key], value)
            elif _number(value) and _number(merged[key]):
                merged[key] += value
            elif isinstance(value, dict) and isinstance(merged[key], dict):
                for name, count in value.items():
                    if _number(count) and _number(merged[key].get(name, 0)):
                        merged[key][name] = merged[key].get(name, 0) + count
    return merged


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
