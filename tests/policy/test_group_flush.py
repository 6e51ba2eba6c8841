"""A worker's group goes to the buffer once whole, not at the end of the sink's flush interval.

Issue 24: a generator in a worker process writes over HTTP in batches, waiting up to 50 ms for
more before each POST. A group is served (or dropped by the filter, which frees its place in
admission) only once whole, so that wait was added to every group: at 0.05 s requests the
trainer waited 0.10-0.14 s a step for its batch against 0.055 s with the generator in the
service's process. The runner now tells the sink when a group's last trajectory is written.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.sink import HttpSink
from buffer.toolkit.types import Episode
from tests.policy.test_demand import FakeLLM
from tests.support.calls import until
from tests.support.factories import trajectory

pytestmark = pytest.mark.anyio

BUFFER = "http://buffer.test:8889"


@respx.mock
async def test_a_flush_sends_what_is_queued_without_waiting_out_the_interval() -> None:
    route = respx.post(f"{BUFFER}/buffer/write_batch").mock(
        side_effect=lambda request: httpx.Response(
            200, json={"success": True, "data": {"written": len(json.loads(request.content))}}
        )
    )
    sink = HttpSink(BUFFER, flush_interval_s=30.0, client=httpx.AsyncClient())
    await sink.write(trajectory("q0"))
    await sink.write(trajectory("q1"))
    sink.flush()
    await until(lambda: route.called, 5, "the batch sent at once")
    assert [len(json.loads(call.request.content)) for call in route.calls] == [2]
    await sink.write(trajectory("q2"))  # the next waits for its own batch, or the close
    await asyncio.sleep(0.05)
    assert route.call_count == 1
    await sink.aclose()
    assert route.call_count == 2


class Flushed:
    """A sink that says, at each flush, the group its last trajectory was of, and how many of
    that group it had."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []
        self.flushes: list[tuple[str, int]] = []

    async def write(self, item: dict[str, Any]) -> None:
        self.written.append(item)

    def flush(self) -> None:
        group = self.written[-1]["instance_id"]
        self.flushes.append((group, sum(item["instance_id"] == group for item in self.written)))

    async def aclose(self) -> None:
        return None


async def test_the_runner_flushes_the_sink_when_a_group_is_whole(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"instance_id": i, "prompt": "2+2", "label": "4"}) + "\n" for i in "abc"]
    rows.write_text("".join(lines))

    async def rollout(llm: Any, sample: Any, **sampling: Any) -> Episode:
        await asyncio.sleep(0.01 if sample.repeat else 0.0)
        return Episode([*sample.messages, {"role": "assistant", "content": "4"}], "stop")

    sink = Flushed()
    data = {"task_type": "math", "input_file": str(rows), "remote_engine_url": "http://engine.test"}
    data |= {"num_repeat_per_sample": 3, "num_process": 2, "shuffle": False}
    await run_rollouts(data, reward=lambda s, e: 1.0, rollout=rollout, sink=sink, llm=FakeLLM())
    assert len(sink.written) == 9
    assert sorted(sink.flushes) == [("a", 3), ("b", 3), ("c", 3)]  # once a group, when whole
