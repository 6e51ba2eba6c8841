"""Where trajectories go: straight into the buffer in the service, batched HTTP elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from fastapi.testclient import TestClient

from buffer.toolkit.sink import HttpSink, RejectedTrajectory, same_service
from tests.support.calls import job_status, wait_for
from tests.support.factories import trajectory, write_generator

BUFFER = "http://buffer.test:8889"
WRITE_BATCH = f"{BUFFER}/buffer/write_batch"


def accepted(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"success": True, "data": {"written": len(json.loads(request.content))}})


def sink(**kwargs: Any) -> HttpSink:
    """Through an httpx client, which respx intercepts."""
    return HttpSink(BUFFER, backoff_s=0.001, max_backoff_s=0.01, client=httpx.AsyncClient(), **kwargs)


def sent_uids(route: respx.Route) -> list[str]:
    return [item["uid"] for call in route.calls for item in json.loads(call.request.content)]


@pytest.mark.anyio
@respx.mock
async def test_http_writes_are_batched_in_order() -> None:
    route = respx.post(WRITE_BATCH).mock(side_effect=accepted)
    items = [trajectory(f"q{i}") for i in range(10)]
    out = sink(batch_size=4, flush_interval_s=1.0)
    for item in items:
        await out.write(item)
    await out.aclose()
    assert sent_uids(route) == [item["uid"] for item in items]
    assert [len(json.loads(call.request.content)) for call in route.calls] == [4, 4, 2]
    assert out.written == 10


@pytest.mark.anyio
@respx.mock
async def test_http_writes_wait_out_outages_and_429s_and_lose_nothing() -> None:
    route = respx.post(WRITE_BATCH).mock(
        side_effect=[
            httpx.ConnectError("buffer restarting"),
            httpx.Response(503),
            httpx.Response(429, headers={"retry-after": "0.05"}),
            accepted,
        ]
    )
    out = sink()
    items = [trajectory(f"q{i}") for i in range(3)]
    for item in items:
        await out.write(item)
    await out.aclose()
    assert route.call_count == 4
    assert sent_uids(route)[-3:] == [item["uid"] for item in items]  # the same uids each time: idempotent
    assert out.written == 3


@pytest.mark.anyio
@respx.mock
async def test_a_refused_trajectory_does_not_hold_back_the_rest() -> None:
    bad = {**trajectory("bad"), "reward": "oops"}

    def check(request: httpx.Request) -> httpx.Response:
        batch = json.loads(request.content)
        if any(item["reward"] == "oops" for item in batch):
            return httpx.Response(
                422, json={"success": False, "message": "0.reward: Input should be a valid number"}
            )
        return accepted(request)

    route = respx.post(WRITE_BATCH).mock(side_effect=check)
    out = sink(batch_size=10, flush_interval_s=1.0)
    good = [trajectory(f"q{i}") for i in range(3)]
    for item in [good[0], bad, *good[1:]]:
        await out.write(item)
    with pytest.raises(RejectedTrajectory, match="refused 1 of 4"):
        await out.aclose()
    assert (out.written, out.rejected) == (3, 1)
    delivered = [json.loads(call.request.content) for call in route.calls if call.response.status_code == 200]
    assert sorted(item["uid"] for batch in delivered for item in batch) == sorted(
        item["uid"] for item in good
    )


@pytest.mark.anyio
@respx.mock
async def test_a_batch_past_the_size_limit_is_sent_in_halves_and_only_a_lone_giant_refused() -> None:
    """The buffer answers 413 past --max-request-bytes: smaller batches get through."""
    giant = trajectory("giant", messages=[{"role": "user", "content": "x" * 5000}])

    def limit(request: httpx.Request) -> httpx.Response:
        if len(request.content) > 4000:
            return httpx.Response(413, json={"success": False, "message": "larger than max_request_bytes"})
        return accepted(request)

    route = respx.post(WRITE_BATCH).mock(side_effect=limit)
    out = sink(batch_size=16, flush_interval_s=1.0)
    items = [trajectory(f"q{i}") for i in range(12)]  # ~300 bytes each: ~3.6 KB a batch of 12
    for item in [*items[:6], giant, *items[6:]]:
        await out.write(item)
    with pytest.raises(RejectedTrajectory, match="refused 1 of 13"):
        await out.aclose()
    assert (out.written, out.rejected) == (12, 1)
    delivered = [json.loads(call.request.content) for call in route.calls if call.response.status_code == 200]
    assert sorted(item["uid"] for batch in delivered for item in batch) == sorted(
        item["uid"] for item in items
    )


def test_the_same_service_is_recognised_by_port_and_local_address() -> None:
    local = "http://127.0.0.1:8889"
    assert same_service("http://localhost:8889", local)
    assert same_service("http://127.0.0.1:8889/", local)
    assert not same_service("http://127.0.0.1:9000", local)
    assert not same_service("http://192.0.2.1:8889", local)  # TEST-NET-1: never this machine
    assert not same_service("http://no-such-host.invalid:8889", local)
    assert not same_service("http://127.0.0.1:8889", None)


LOCAL_GENERATOR = """
from buffer.service.local_sink import LocalSink
from buffer.toolkit import open_sink, run_rollouts

TASK_TYPE = "local"

async def run_rollout(data):
    sink = await open_sink(data["remote_buffer_url"])
    assert isinstance(sink, LocalSink), type(sink)
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat), sink=sink)
"""


def test_a_generator_in_the_service_writes_straight_into_the_buffer(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path, simulator: str
) -> None:
    write_generator(generator_dir, "local_generator.py", LOCAL_GENERATOR)
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "label": "2"}\n{"prompt": "What is 2 + 2?", "label": "4"}\n'
    )
    client = make_client(input_roots=[tmp_path])
    job = client.post(
        "/start_rollout",
        json={
            "task_type": "local",
            "input_file": str(data),
            "remote_engine_url": simulator,
            "remote_buffer_url": "http://localhost:8889",  # the trainer's own view of the service
            "num_repeat_per_sample": "2",
        },
    ).json()
    wait_for(lambda: job_status(client, job["job_id"]) != "running")
    assert job_status(client, job["job_id"]) == "succeeded", client.get(f"/jobs/{job['job_id']}").json()
    # Nothing listens on port 8889 here: the trajectories can only have come in directly.
    data_out = client.post("/get_rollout_data", json={}).json()["data"]["data"]
    assert len(data_out) == 4
    progress = client.get(f"/jobs/{job['job_id']}").json()["data"]["progress"]
    assert (progress["completed"], progress["failed"]) == (4, 0)


@pytest.mark.anyio
async def test_the_default_transport_batches_waits_out_429s_and_splits_refusals() -> None:
    """Without a client the sink posts over the toolkit's HTTP/1.1 transport, to a real socket."""
    from aiohttp import web

    answers = iter([web.Response(status=429, headers={"Retry-After": "0"}), web.Response(status=503)])
    received: list[list[str]] = []

    async def write_batch(request: web.Request) -> web.StreamResponse:
        assert request.headers["authorization"] == "Bearer secret"
        batch = json.loads(await request.read())
        uids = [item["uid"] for item in batch]
        if "bad" in uids:
            return web.json_response({"detail": "invalid"}, status=422)
        refusal = next(answers, None)
        if refusal is not None:
            return refusal
        received.append(uids)
        return web.json_response({"success": True, "data": {"written": len(uids)}})

    app = web.Application()
    app.router.add_post("/buffer/write_batch", write_batch)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        writer = HttpSink(url, api_key="secret", batch_size=4, backoff_s=0.001, max_backoff_s=0.01)
        uids = ["a", "b", "bad", "c", "d", "e"]
        for uid in uids:
            await writer.write({**trajectory(), "uid": uid})
        with pytest.raises(RejectedTrajectory, match="refused 1 of 6"):
            await writer.aclose()
    finally:
        await runner.cleanup()
    assert sorted(uid for batch in received for uid in batch) == ["a", "b", "c", "d", "e"]
    assert (writer.written, writer.rejected) == (5, 1)
