"""A worker's stdout and stderr, forwarded to the service's log line by line, capped.

A generator may print without end (200 MB a second): its worker's pipes are read as fast as it
writes (it never blocks on a full pipe, the event loop never waits on it), and at most
``MAX_OUTPUT_BYTES_S`` a second of it, in lines cut at ``MAX_LINE_BYTES``, reaches the
service's log, under the ``buffer.workers.output`` logger, each line tagged with its worker.
What is left out is counted, and the count logged once a second while it goes on.

A line the worker's own logging wrote (``... INFO buffer.workers.child: ...``) keeps its level;
any other line from stdout is INFO, from stderr WARNING (a traceback's lines take the level of
the line that began it).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from buffer.workers.progress import pipe_stream

logger = logging.getLogger(__name__)

#: How much of a worker's output reaches the service's log, a second (more is counted and dropped).
MAX_OUTPUT_BYTES_S = 64 * 1024
#: Where a longer line is cut (the rest of it is counted and dropped).
MAX_LINE_BYTES = 4 * 1024
#: How often at most the count of what was dropped is logged.
DROP_REPORT_INTERVAL_S = 1.0
_READ_BYTES = 256 * 1024
_LEVEL = re.compile(rb"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class WorkerOutput:
    """One worker's output: both its streams share its budget."""

    def __init__(
        self,
        name: str,
        max_bytes_s: int = MAX_OUTPUT_BYTES_S,
        max_line_bytes: int = MAX_LINE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.max_bytes_s = max_bytes_s
        self.max_line_bytes = max_line_bytes
        self._clock = clock
        self._allowance = float(max_bytes_s)
        self._refilled = clock()
        self._reported = self._refilled
        #: What was left out since the last report: lines (whole or their cut tails) and bytes.
        self.dropped_lines = 0
        self.dropped_bytes = 0

    async def forward(self, fd: int, level: int) -> None:
        """Log the lines of the pipe ``fd`` (closed when done) until its end of file (``level``:
        a line's unless it says)."""
        async with pipe_stream(fd, _READ_BYTES) as stream:
            await self._forward(stream, level)

    async def _forward(self, stream: asyncio.StreamReader, level: int) -> None:
        line = bytearray()
        cut = False  # the rest of the current line is being dropped
        last_level = level
        while chunk := await stream.read(_READ_BYTES):
            start = 0
            while start < len(chunk):
                end = chunk.find(b"\n", start)
                piece = memoryview(chunk)[start : len(chunk) if end < 0 else end]
                if cut:
                    self.dropped_bytes += len(piece)
                else:
                    room = self.max_line_bytes - len(line)
                    line += piece[:room]
                    if len(piece) > room:
                        self.dropped_bytes += len(piece) - room
                        last_level = self._emit(bytes(line), level, last_level, cut=True)
                        line.clear()
                        cut = True
                if end < 0:
                    break
                if not cut:
                    last_level = self._emit(bytes(line), level, last_level)
                line.clear()
                cut = False
                start = end + 1
        if line and not cut:
            self._emit(bytes(line), level, last_level)
        self._report(force=True)

    def _emit(self, raw: bytes, level: int, last_level: int, *, cut: bool = False) -> int:
        """Log one line if the budget allows (else count it); the level it was given."""
        named = _LEVEL.match(raw)
        if named is not None:
            level = logging.getLevelName(named.group(1).decode())
        elif raw[:1].isspace() or raw.startswith(b"Traceback"):
            level = last_level
        now = self._clock()
        self._allowance = min(
            float(self.max_bytes_s), self._allowance + (now - self._refilled) * self.max_bytes_s
        )
        self._refilled = now
        if len(raw) + 1 <= self._allowance:  # its newline counted: an empty line costs too
            self._allowance -= len(raw) + 1
            text = raw.decode(errors="replace").rstrip("\r")
            logger.log(level, "%s: %s%s", self.name, text, " [cut]" if cut else "")
        else:
            self.dropped_lines += 1
            self.dropped_bytes += len(raw)
        self._report()
        return level

    def _report(self, *, force: bool = False) -> None:
        now = self._clock()
        if not (self.dropped_lines or self.dropped_bytes):
            return
        if not force and now - self._reported < DROP_REPORT_INTERVAL_S:
            return
        logger.warning(
            "%s: %d lines and %d bytes of its output left out of the log (more than %d bytes a "
            "second, or lines longer than %d bytes)",
            self.name,
            self.dropped_lines,
            self.dropped_bytes,
            self.max_bytes_s,
            self.max_line_bytes,
        )
        self.dropped_lines = self.dropped_bytes = 0
        self._reported = now
