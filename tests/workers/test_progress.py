"""A worker's progress goes to the service down a pipe: every change pushed, the last one kept."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from buffer.workers.progress import ProgressPipe, ReportedProgress, receive


@pytest.mark.anyio
async def test_every_report_reaches_the_service_and_the_last_is_kept_at_the_close() -> None:
    read_end, write_end = os.pipe()
    received: list[dict[str, Any]] = []
    receiver = asyncio.create_task(receive(read_end, received.append, "job-1/0"))
    pipe = ProgressPipe(write_end)
    progress = ReportedProgress(pipe.send)
    for completed in range(1, 501):  # faster than the pipe is read: they fold into the latest
        progress.update({"completed": completed, "finish_reasons": {"stop": completed}})
    progress["failed"] = 2
    await asyncio.to_thread(pipe.close)
    await asyncio.wait_for(receiver, 30)  # its end of file
    assert received[-1] == {"completed": 500, "finish_reasons": {"stop": 500}, "failed": 2}
    assert all(report["completed"] <= 500 for report in received)


@pytest.mark.anyio
async def test_a_line_that_is_not_a_report_is_skipped() -> None:
    read_end, write_end = os.pipe()
    received: list[dict[str, Any]] = []
    receiver = asyncio.create_task(receive(read_end, received.append, "job-1/0"))
    os.write(write_end, b'not json\n[1, 2]\n{"completed": 1}\n')
    os.close(write_end)
    await asyncio.wait_for(receiver, 30)
    assert received == [{"completed": 1}]


def test_a_copy_of_the_reported_progress_is_a_plain_dict() -> None:
    reports: list[dict[str, Any]] = []
    progress = ReportedProgress(reports.append)
    progress.setdefault("completed", 0)
    progress.pop("completed")
    assert reports == [{"completed": 0}, {}]
    assert type(dict(progress)) is dict
