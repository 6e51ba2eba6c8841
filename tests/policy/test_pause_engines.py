"""The engines a pause names: bounded, checked, told a few at a time, and only at their resume."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import respx
from fastapi.testclient import TestClient

from buffer.service.engine_pause import tell_engines
from tests.support.calls import until


def test_a_pause_naming_too_many_or_too_long_engine_urls_is_refused_naming_the_field(
    client: TestClient,
) -> None:
    many = [f"http://engine{i}.test:30000" for i in range(65)]
    refused = client.post("/policy/pause", json={"mode": "abort", "engine_urls": many, "timeout_s": 1})
    assert refused.status_code == 422, refused.text
    assert "engine_urls" in refused.text
    long = "http://engine.test/" + "a" * 2048
    refused = client.post("/policy/pause", json={"mode": "abort", "engine_urls": [long], "timeout_s": 1})
    assert refused.status_code == 422, refused.text
    assert "engine_urls" in refused.text
    assert client.get("/policy").json()["data"]["paused"] is False  # nothing was paused


def test_every_engine_url_of_a_pause_is_checked_against_the_allowed_hosts(
    make_client: Any,
) -> None:
    client = make_client(allowed_engine_hosts=["engine.test"])
    urls = ["http://engine.test:30000", "http://engine.test:30001", "http://elsewhere.test:30000"]
    refused = client.post("/policy/pause", json={"mode": "abort", "engine_urls": urls, "timeout_s": 1})
    assert refused.status_code == 422, refused.text
    assert "engine_urls.2" in refused.text
    assert "elsewhere.test" in refused.text
    assert client.get("/policy").json()["data"]["paused"] is False


@respx.mock
def test_a_resume_tells_only_the_engines_its_pause_named_and_forgets_them(client: TestClient) -> None:
    pauses = respx.post(url__regex=r"http://engine\d\.test/pause_generation").mock(
        return_value=httpx.Response(200, json={})
    )
    resumes = respx.post(url__regex=r"http://engine\d\.test/continue_generation").mock(
        return_value=httpx.Response(200, json={})
    )
    first = {"mode": "abort", "engine_urls": ["http://engine1.test"], "engine": "sglang", "timeout_s": 1}
    assert client.post("/policy/pause", json=first).status_code == 200
    assert client.post("/policy/resume").status_code == 200
    assert [str(call.request.url) for call in resumes.calls] == ["http://engine1.test/continue_generation"]
    assert client.get("/policy").json()["data"]["engine_urls"] == []  # forgotten after the resume

    # A pause naming no engine tells none, at its pause or at its resume.
    assert client.post("/policy/pause", json={"mode": "abort", "timeout_s": 1}).status_code == 200
    assert client.post("/policy/resume").status_code == 200
    assert pauses.call_count == 1
    assert resumes.call_count == 1

    # A later pause replaces what an earlier one named.
    client.post("/policy/pause", json=first)
    second = {**first, "engine_urls": ["http://engine2.test"]}
    assert client.post("/policy/pause", json=second).status_code == 200
    assert client.post("/policy/resume").status_code == 200
    assert str(resumes.calls.last.request.url) == "http://engine2.test/continue_generation"
    assert resumes.call_count == 2


@pytest.mark.anyio
@respx.mock
async def test_engines_are_told_a_few_at_a_time_and_a_silent_one_within_its_timeout() -> None:
    asking = 0
    most = 0
    release = asyncio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        nonlocal asking, most
        asking += 1
        most = max(most, asking)
        try:
            if request.url.host == "silent.test":
                await asyncio.Event().wait()  # never answers
            await asyncio.wait_for(release.wait(), 30)
            return httpx.Response(200, json={})
        finally:
            asking -= 1

    respx.post(url__regex=r"http://\w+\.test/pause_generation").mock(side_effect=answer)
    urls = [f"http://engine{i}.test" for i in range(10)] + ["http://silent.test"]
    # Each engine's timeout starts when it is asked: the three held must be released well
    # within it on a loaded machine, and the silent one takes all of it.
    told = asyncio.ensure_future(tell_engines(urls, "pause", "sglang", {}, timeout_s=3.0, concurrency=3))
    await until(lambda: asking == 3, what="the first three engines asked")
    await asyncio.sleep(0.05)
    assert most == 3  # the first three are being asked, no more
    release.set()
    answers = await asyncio.wait_for(told, 30)
    assert most == 3
    assert [answer.url for answer in answers] == urls
    assert all(answer.ok for answer in answers[:-1])
    assert not answers[-1].ok
    assert "no answer in 3 s" in answers[-1].detail
