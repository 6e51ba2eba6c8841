"""Admission over-samples by what the filters drop, as measured, and keeps the engines busy.

Issue 24: what may be in flight is the trainer's need over the filters' keep-rate (groups kept
over groups made in full, a recent window, with a floor), one ask admits as many groups as
the generator has slots free for, a group the filter drops wakes a waiting admission at once,
and the benchmark says where a generator's slots spend the time generation is not paused.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import respx
from fastapi.testclient import TestClient

from buffer.core.hooks import Hooks
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.policy import Admission, Gate
from buffer.policy.admission import KEEP_FLOOR, KEEP_MARGIN_SD, KEEP_WINDOW, KeepRate, in_flight_at_most
from buffer.policy.slots import SlotTime
from buffer.toolkit.remote_policy import RemoteAdmission
from tests.policy.test_policy import versioned

pytestmark = pytest.mark.anyio


class Made:
    """A task's groups made in full, as the buffer counts them (``group_outcomes``)."""

    def __init__(self) -> None:
        self.ready = self.kept = self.dropped = self.consumed = 0

    def outcomes(self) -> tuple[int, int, int]:
        return self.ready, self.kept, self.dropped


class Admitted(Admission):
    def __init__(self, made: Made, max_staleness: int, batch_groups: int) -> None:
        super().__init__(max_staleness, batch_groups, lambda: made.consumed, outcomes=made.outcomes)
        self.made = made

    def finish(self, kept: int, dropped: int) -> None:
        """Groups admitted earlier, made in full and gone: the kept ones read, the rest dropped."""
        self.admitted += kept + dropped
        self.made.kept += kept
        self.made.dropped += dropped
        self.made.consumed += kept + dropped


def admission(made: Made, max_staleness: int = 1, batch_groups: int = 4) -> Admitted:
    return Admitted(made, max_staleness, batch_groups)


def admitted_now(admission: Admission) -> int:
    return admission.try_admit(10_000)


def test_a_filter_that_keeps_every_group_leaves_demand_at_the_need() -> None:
    made = Made()
    gate = admission(made)
    gate.finish(kept=40, dropped=0)
    assert admitted_now(gate) == 8  # (S + 1) x batch: what the trainer reads in time, no more
    assert gate.snapshot()["keep_rate"] == 1.0


def test_a_filter_that_drops_half_the_groups_about_doubles_what_is_in_flight() -> None:
    made = Made()
    gate = admission(made)
    gate.finish(kept=20, dropped=20)
    assert gate.snapshot()["keep_rate"] == 0.5
    # 8 groups served at most: 16 in flight keep 8 on average; a margin of 1.5 standard
    # deviations is left free, for more kept than the rate says would go stale: 11 (11 x 0.5 +
    # 1.5 x sqrt(11 x 0.25) = 7.99). Before: 8, half of them dropped.
    assert KEEP_MARGIN_SD == 1.5
    assert admitted_now(gate) == 11
    assert gate.snapshot()["keep_rate"] == 0.5
    # A large batch: the margin is small beside it, and demand is nearly twice the need.
    assert 2 * 1536 * 0.95 < in_flight_at_most(1536, 0.5) < 2 * 1536


def test_demand_is_bounded_when_the_filter_drops_almost_everything() -> None:
    made = Made()
    gate = admission(made)
    gate.finish(kept=1, dropped=63)
    assert gate.snapshot()["keep_rate"] == KEEP_FLOOR  # 1 in 64 measured: the floor
    assert admitted_now(gate) <= 8 / KEEP_FLOOR


def test_a_ready_group_counts_in_full_one_in_flight_as_the_keep_rate() -> None:
    made = Made()
    gate = admission(made)
    gate.finish(kept=0, dropped=64)  # the floor: 1 in 4 kept
    assert gate.try_admit(4) == 4
    made.ready, made.kept = 2, 2  # two of them made, kept, not read yet: the trainer will read them
    assert gate.keep.rate == KEEP_FLOOR
    assert admitted_now(gate) == in_flight_at_most(8 - 2, KEEP_FLOOR) - 2
    assert in_flight_at_most(8 - 2, KEEP_FLOOR) - 2 < in_flight_at_most(8, KEEP_FLOOR) - 4


def test_the_keep_rate_is_measured_over_a_recent_window() -> None:
    keep = KeepRate()
    assert keep.rate == 1.0  # nothing measured: no over-sampling
    keep.observe(100, 100)  # the totals when it starts: history before is not counted
    assert keep.measured == 0
    keep.observe(100, 100 + KEEP_WINDOW)  # a window of drops...
    keep.observe(100 + KEEP_WINDOW // 2, 100 + KEEP_WINDOW)  # ... half of it now forgotten
    assert keep.rate == 0.5
    assert keep.measured == KEEP_WINDOW


def test_the_buffer_counts_outcomes_and_a_dropped_group_wakes_a_waiting_admission() -> None:
    buffer = RolloutBuffer()
    buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    gate = buffer.policy.start_admission("math", 1, 2, lambda: buffer.consumed_groups("math"))
    woken: list[int] = []
    gate.notify = lambda: woken.append(1)  # type: ignore[method-assign]
    for item in versioned("zero-variance", [1.0, 1.0], 0):
        buffer.write({**item, "task_type": "math"})
    assert woken, "a group the filter dropped left admission asleep until its next poll"
    for item in versioned("kept", [0.0, 1.0], 0):
        buffer.write({**item, "task_type": "math"})
    assert buffer.group_outcomes("math") == (1, 1, 1)  # ready, kept, dropped
    assert gate.snapshot()["keep_rate"] == 0.5


def test_one_ask_admits_as_many_groups_as_there_is_room_for(client: TestClient) -> None:
    policy = client.app.state.services.buffer.policy  # type: ignore[attr-defined]
    policy.start_admission("math", 1, 2, lambda: 0)
    first = client.post("/policy/admit", json={"task_type": "math", "groups": 3, "wait_s": 0}).json()
    assert (first["data"]["admitted"], first["data"]["groups"]) == (True, 3)
    rest = client.post("/policy/admit", json={"task_type": "math", "groups": 3, "wait_s": 0}).json()
    assert (rest["data"]["admitted"], rest["data"]["groups"]) == (True, 1)  # 4 = (S + 1) x 2
    bad = client.post("/policy/admit", json={"task_type": "math", "groups": 0})
    assert bad.status_code == 422
    assert "groups" in bad.text


@respx.mock
async def test_a_generator_elsewhere_takes_what_one_ask_granted_without_asking_again() -> None:
    asks: list[dict[str, Any]] = []

    def admit(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asks.append(body)
        groups = body.get("groups", 1)
        return httpx.Response(200, json={"data": {"admitted": True, "bounded": True, "groups": groups}})

    respx.post("http://buffer.test/policy/admit").mock(side_effect=admit)
    async with httpx.AsyncClient(base_url="http://buffer.test") as http:
        remote = RemoteAdmission(http, "math")
        try:
            for _ in range(4):
                await asyncio.wait_for(remote.admit(4), 10)
        finally:
            await remote.aclose()
    # One ask for the four groups the free slots could take (and one asked ahead after them).
    assert [ask["groups"] for ask in asks][:1] == [4]
    assert len(asks) <= 2, asks


def test_the_slots_time_is_split_by_what_they_did_while_open() -> None:
    now = [0.0]
    gate = Gate(lambda: now[0])
    slots = SlotTime(gate, 4, clock=lambda: now[0])
    slots.took()
    slots.took()  # 2 held, 2 free (nothing waited on: "other")
    now[0] = 1.0
    slots.admitting()  # 2 free while admission is asked
    now[0] = 2.0
    gate.pause()  # paused: no slot's time
    now[0] = 5.0
    gate.resume(1)
    now[0] = 6.0
    slots.admitted(bound_s=1.0)  # waited 5 s, 2 of them open; the service had no room for 1 s
    slots.freed()
    now[0] = 7.0
    seconds = slots.snapshot()
    assert seconds["held"] == 2 * 3 + 1  # 3 open seconds with 2, then 1 with 1
    assert seconds["other"] == 2 * 1 + 3 * 1
    # The wait's 4 free slot-seconds, 1 s of 5 s without room: a fifth is the bound's.
    assert seconds["bound"] == pytest.approx(4 / 5)
    assert seconds["admission"] == pytest.approx(4 * 4 / 5)
    assert seconds["open"] == 4 * 4  # 4 slots x 4 open seconds (0-2, 5-7)


@respx.mock
async def test_a_service_that_admits_one_group_an_ask_is_still_followed() -> None:
    """An older service refuses the ``groups`` field (422): the generator asks for one at a time."""
    asks: list[dict[str, Any]] = []

    def admit(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asks.append(body)
        if "groups" in body:
            return httpx.Response(422, json={"detail": [{"loc": ["body", "groups"], "msg": "extra"}]})
        return httpx.Response(200, json={"data": {"admitted": True, "bounded": True}})

    respx.post("http://buffer.test/policy/admit").mock(side_effect=admit)
    async with httpx.AsyncClient(base_url="http://buffer.test") as http:
        remote = RemoteAdmission(http, "math")
        try:
            for _ in range(3):
                await asyncio.wait_for(remote.admit(4), 10)
        finally:
            await remote.aclose()
    assert "groups" in asks[0]
    assert all("groups" not in ask for ask in asks[1:])
    assert len(asks) >= 4  # one refused, then one a group
