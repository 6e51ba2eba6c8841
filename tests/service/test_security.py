"""What the service lets in and out: the API key, the request size limit, no tracebacks."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import respx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from buffer.service.app import create_app
from buffer.service.security import ApiKeyMiddleware, ServiceGuard
from buffer.service.settings import Settings
from buffer.toolkit.sink import HttpSink
from buffer.trainer.client import AsyncRolloutBufferClient, BufferRequestError, RolloutBufferClient
from tests.support.calls import job_status, read, wait_for, write_all
from tests.support.factories import group, trajectory, write_generator

KEY = "s3cret-key"
LIMIT = 64 * 1024  # --max-request-bytes for the size tests
TOO_LARGE = f"request body is larger than max_request_bytes ({LIMIT} bytes)"


def basic(password: str, user: str = "anyone") -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


BEARER = {"authorization": f"Bearer {KEY}"}


def stats(client: TestClient | httpx.Client, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = client.get("/buffer/stats", headers=headers)
    assert response.status_code == 200, response.text
    counters: dict[str, Any] = response.json()["data"]["data"][0]
    return counters


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's settings and the clients both read it: each test sets what it needs."""
    monkeypatch.delenv("ROLLOUT_BUFFER_API_KEY", raising=False)


@pytest.fixture
def keyed(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(api_key=KEY, group_size=2)


# -- the API key ------------------------------------------------------------------------

PROTECTED = [
    pytest.param("POST", "/buffer/write", trajectory(), id="write"),
    pytest.param("POST", "/get_rollout_data", {}, id="read"),
    pytest.param("GET", "/buffer/stats", None, id="stats"),
    pytest.param("GET", "/metrics", None, id="metrics"),
    pytest.param("POST", "/health", None, id="health-not-get"),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_without_the_key_every_endpoint_answers_401(
    keyed: TestClient, method: str, path: str, body: Any
) -> None:
    response = keyed.request(method, path, json=body)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {
        "success": False,
        "message": "missing API key: send 'Authorization: Bearer <key>'",
        "data": None,
    }
    assert stats(keyed, BEARER)["total_written"] == 0


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"authorization": "Bearer guess-123"}, id="bearer"),
        pytest.param(basic("guess-123"), id="basic"),
        pytest.param({"authorization": f"Bearer {KEY}x"}, id="longer"),
    ],
)
def test_a_wrong_key_gets_401_without_echoing_it(
    keyed: TestClient, method: str, path: str, body: Any, headers: dict[str, str]
) -> None:
    response = keyed.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["message"] == "wrong API key"
    assert "guess-123" not in response.text
    assert KEY not in response.text


def test_a_malformed_authorization_header_says_what_is_wrong(keyed: TestClient) -> None:
    digest = keyed.get("/buffer/stats", headers={"authorization": f"Digest {KEY}"})
    assert digest.status_code == 401
    assert digest.json()["message"] == "unsupported Authorization scheme: send 'Authorization: Bearer <key>'"
    garbled = keyed.get("/buffer/stats", headers={"authorization": "Basic not base64!"})
    assert garbled.status_code == 401
    assert garbled.json()["message"] == "malformed Basic credentials: expected base64 of 'user:key'"


def test_the_key_as_bearer_or_basic_password_opens_every_endpoint(keyed: TestClient) -> None:
    items = group("q", [0.0, 1.0])
    for item, headers in zip(items, [BEARER, basic(KEY, user="trainer")], strict=True):
        assert keyed.post("/buffer/write", json=item, headers=headers).status_code == 200
    assert stats(keyed, basic(KEY))["total_written"] == 2
    assert keyed.get("/metrics", headers=BEARER).status_code == 200
    batch = keyed.post("/get_rollout_data", json={}, headers=BEARER)
    assert [item["uid"] for item in batch.json()["data"]["data"]] == [item["uid"] for item in items]


def test_the_dashboard_asks_a_browser_to_log_in_and_then_opens(keyed: TestClient) -> None:
    for path in ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
        refused = keyed.get(path)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"] == 'Basic realm="rollout-buffer"'
        assert refused.json()["message"] == (
            "missing API key: log in with any user name and the API key as password"
        )
        assert keyed.get(path, headers=basic(KEY)).status_code == 200, path
    assert keyed.get("/dashboard", headers=BEARER).status_code == 200


def test_root_and_health_stay_open_for_probes(keyed: TestClient) -> None:
    assert keyed.get("/").json()["message"] == "Rollout Buffer Server is running"
    assert keyed.get("/health").json()["status"] == "ok"
    assert keyed.head("/health").status_code == 405  # the route's answer: the key is not asked


@pytest.mark.parametrize("api_key", [None, ""])
def test_without_a_key_everything_is_open_and_no_middleware_runs(
    make_client: Callable[..., TestClient], api_key: str | None
) -> None:
    client = make_client(api_key=api_key, group_size=2)
    app = client.app
    assert isinstance(app, FastAPI)
    assert ApiKeyMiddleware not in [middleware.cls for middleware in app.user_middleware]
    guards = [middleware for middleware in app.user_middleware if middleware.cls is ServiceGuard]
    assert [guard.kwargs["api_key"] for guard in guards] == [None]  # the one layer asks for no key
    write_all(client, group("q", [0.0, 1.0]))
    assert len(read(client)["data"]["data"]) == 2
    ignored = {"authorization": "Bearer whatever"}
    assert client.get("/buffer/stats", headers=ignored).status_code == 200
    assert client.get("/dashboard").status_code == 200


# -- the start-up warning ---------------------------------------------------------------

EXPOSED = "anyone who can reach this port can read and write the buffer"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "buffer.service.security" and r.levelno >= logging.WARNING
    ]


def test_listening_beyond_loopback_without_a_key_warns_at_start_up(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    make_client(host="0.0.0.0")
    (warning,) = warnings_of(caplog)
    assert warning.startswith(f"listening on 0.0.0.0:8889 without an API key: {EXPOSED}")
    assert "--api-key or ROLLOUT_BUFFER_API_KEY" in warning


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"host": "0.0.0.0", "api_key": KEY}, id="with-a-key"),
        pytest.param({"host": "127.0.0.1"}, id="127.0.0.1"),
        pytest.param({"host": "127.0.0.2"}, id="127.0.0.2"),
        pytest.param({"host": "::1"}, id="::1"),
        pytest.param({"host": "localhost"}, id="localhost"),
    ],
)
def test_a_keyed_or_local_service_starts_without_the_warning(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture, overrides: dict[str, Any]
) -> None:
    make_client(**overrides)
    assert warnings_of(caplog) == []


# -- the request size -------------------------------------------------------------------


def batch_of(count: int, content_bytes: int = 1000) -> list[dict[str, Any]]:
    """``count`` valid trajectories with a ``content_bytes`` answer each, in groups of two."""
    items = []
    for index in range(count):
        item = trajectory(f"big-{index // 2}")
        item["messages"][1]["content"] = "x" * content_bytes
        items.append(item)
    return items


def test_a_body_declared_too_large_gets_413_and_the_buffer_is_untouched(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(max_request_bytes=LIMIT, group_size=2)
    write_all(client, group("kept", [0.0, 1.0]))
    before = stats(client)
    body = orjson.dumps(batch_of(100))  # valid, and some 100 KB
    assert len(body) > LIMIT
    response = client.post("/buffer/write_batch", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"success": False, "message": TOO_LARGE, "data": None}
    assert response.headers["connection"] == "close"
    assert stats(client) == before
    assert [item["instance_id"] for item in read(client)["data"]["data"]] == ["kept", "kept"]


def test_a_body_at_the_limit_passes(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_request_bytes=LIMIT, group_size=2)
    item = trajectory()
    item["messages"][1]["content"] = ""
    item["messages"][1]["content"] = "x" * (LIMIT - len(orjson.dumps(item)))
    body = orjson.dumps(item)
    assert len(body) == LIMIT
    response = client.post("/buffer/write", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.fixture
async def small_limit_app(generator_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app, lifespan running, behind httpx's ASGI transport: it streams a body in chunks."""
    app = create_app(Settings(generator_dir=generator_dir, max_request_bytes=LIMIT, group_size=2))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://buffer") as client:
            yield client


async def async_stats(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/buffer/stats")
    counters: dict[str, Any] = response.json()["data"]["data"][0]
    return counters


@pytest.mark.anyio
async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(
    small_limit_app: httpx.AsyncClient,
) -> None:
    client = small_limit_app
    for item in group("kept", [0.0, 1.0]):
        assert (await client.post("/buffer/write", json=item)).status_code == 200
    before = await async_stats(client)
    body = orjson.dumps(batch_of(100))  # valid JSON: written in full if it were let through
    chunk_bytes = 4096
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), chunk_bytes):
            sent.append(start)
            yield body[start : start + chunk_bytes]

    response = await client.post("/buffer/write_batch", content=chunks())
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.status_code == 413
    assert response.json()["message"] == TOO_LARGE
    assert len(sent) == LIMIT // chunk_bytes + 1  # not one chunk read past the limit
    assert await async_stats(client) == before
    batch = (await client.post("/get_rollout_data", json={})).json()
    assert [item["instance_id"] for item in batch["data"]["data"]] == ["kept", "kept"]


@pytest.mark.anyio
async def test_an_endless_chunked_body_gets_its_413(small_limit_app: httpx.AsyncClient) -> None:
    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"[" * 1000

    for path in ("/buffer/write", "/get_rollout_data", "/start_rollout"):  # raw and FastAPI routes
        response = await small_limit_app.post(path, content=endless())
        assert response.status_code == 413, path
        assert response.json()["message"] == TOO_LARGE


@pytest.mark.anyio
async def test_a_chunked_body_within_the_limit_passes(small_limit_app: httpx.AsyncClient) -> None:
    body = orjson.dumps(batch_of(4))

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 100):
            yield body[start : start + 100]

    response = await small_limit_app.post("/buffer/write_batch", content=chunks())
    assert response.status_code == 200, response.text
    assert (await async_stats(small_limit_app))["total_written"] == 4


def test_a_10_mb_trajectory_is_accepted_by_default(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=2)
    big, small = group("long", [1.0, 0.0])
    big["messages"][1]["content"] = "x" * 10_000_000
    for item in (big, small):
        response = client.post("/buffer/write", json=item)
        assert response.status_code == 200, response.text[:200]
    returned = {item["uid"]: item for item in read(client)["data"]["data"]}
    assert returned[big["uid"]]["messages"][1]["content"] == big["messages"][1]["content"]


# -- no traceback reaches a client ------------------------------------------------------


def test_an_unexpected_error_in_a_route_is_a_bare_500_and_logged_in_full(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client()

    def broken() -> list[Any]:
        raise RuntimeError("internal detail /srv/secret/path")

    client.app.state.services.jobs.list = broken  # type: ignore[attr-defined]
    quiet = TestClient(client.app, raise_server_exceptions=False)
    response = quiet.get("/jobs")
    assert response.status_code == 500
    assert response.json() == {
        "success": False,
        "message": "internal error; the service log has the details",
        "data": None,
    }
    assert "Traceback" in caplog.text
    assert "internal detail /srv/secret/path" in caplog.text


def test_a_failed_job_says_where_in_the_generator_not_deep_in_a_library(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "parse_generator.py",
        'import json\nTASK_TYPE = "parse"\ndef run_rollout(data):\n    json.loads("not json")\n',
    )
    client = make_client()
    job_id = client.post("/start_rollout", json={"task_type": "parse"}).json()["job_id"]
    wait_for(lambda: job_status(client, job_id) == "failed")
    response = client.get(f"/jobs/{job_id}")
    assert response.json()["data"]["where"] == "generator/parse_generator.py:4 in run_rollout"
    assert "Traceback" not in response.text
    assert "json/decoder.py" not in response.text


# -- the key on the client side ---------------------------------------------------------


@respx.mock
def test_the_client_sends_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    route = respx.get("http://buffer.test:8889/health").mock(return_value=httpx.Response(200, json={}))
    monkeypatch.setenv("ROLLOUT_BUFFER_API_KEY", KEY)
    with RolloutBufferClient("http://buffer.test:8889") as client:
        client.health()
    with RolloutBufferClient("http://buffer.test:8889", api_key="passed") as client:
        client.health()
    assert [call.request.headers["authorization"] for call in route.calls] == [
        f"Bearer {KEY}",
        "Bearer passed",
    ]


@pytest.fixture
async def keyed_app(generator_dir: Path) -> AsyncIterator[httpx.ASGITransport]:
    app = create_app(Settings(generator_dir=generator_dir, api_key=KEY, group_size=2))
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app)


@pytest.mark.anyio
async def test_a_trainer_and_a_generator_work_against_a_keyed_service_with_one_variable(
    keyed_app: httpx.ASGITransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "http://buffer.test:8889"
    async with AsyncRolloutBufferClient(url, transport=keyed_app, max_attempts=1) as trainer:
        with pytest.raises(BufferRequestError) as refused:
            await trainer.stats()
        assert refused.value.status_code == 401

    monkeypatch.setenv("ROLLOUT_BUFFER_API_KEY", KEY)
    async with httpx.AsyncClient(transport=keyed_app) as http:
        sink = HttpSink(url, client=http, flush_interval_s=0.01)
        for item in group("q", [0.0, 1.0]):
            await sink.write(item)
        await sink.aclose()
    assert sink.written == 2
    async with AsyncRolloutBufferClient(url, transport=keyed_app, max_attempts=1) as trainer:
        batch = await trainer.get_rollout_data()
    assert [item["instance_id"] for item in batch.items] == ["q", "q"]


# -- browsers on other origins ----------------------------------------------------------


def written(client: TestClient) -> int:
    return int(stats(client)["total_written"])


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_a_body_not_sent_as_json_gets_415_and_writes_nothing(
    make_client: Callable[..., TestClient], content_type: str
) -> None:
    # What a page can POST anywhere without asking first: a "simple" request, no CORS preflight.
    client = make_client(group_size=2)
    body = orjson.dumps(trajectory("q1"))
    response = client.post("/buffer/write", content=body, headers={"content-type": content_type})
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["message"]
    drain = client.post("/get_rollout_data", content=b"{}", headers={"content-type": content_type})
    assert drain.status_code == 415
    assert written(client) == 0


def test_json_in_any_of_its_spellings_and_bodyless_posts_pass(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=2)
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        body = orjson.dumps(trajectory("q1"))
        response = client.post("/buffer/write", content=body, headers={"content-type": content_type})
        assert response.status_code == 200, response.text
    # No content type at all is taken as JSON, as slime's FastAPI buffer takes it.
    assert client.post("/buffer/write", content=orjson.dumps(trajectory("q2"))).status_code == 200
    assert client.post("/get_rollout_data").status_code == 200
    assert written(client) == 4


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "null"},  # a sandboxed frame or a file:// page
        {"origin": "http://testserver:8080"},  # another port of the same host: another origin
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
    ],
)
def test_a_browser_request_from_another_origin_gets_403_and_changes_nothing(
    make_client: Callable[..., TestClient], headers: dict[str, str]
) -> None:
    client = make_client(group_size=2)
    write_all(client, group("q1", [0.0, 1.0]))
    response = client.post("/buffer/write", json=trajectory("q2"), headers=headers)
    assert response.status_code == 403, response.text
    assert "--allowed-origins" in response.json()["message"]
    assert client.post("/get_rollout_data", json={}, headers=headers).status_code == 403
    assert client.post("/start_rollout", json={"task_type": "x"}, headers=headers).status_code == 403
    assert written(client) == 2
    assert stats(client)["current_size"] == 2  # the ready group was not drained
    assert client.get("/buffer/stats", headers=headers).status_code == 200  # reading is harmless


def test_the_services_own_pages_and_allowed_origins_pass(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=2, allowed_origins=["https://lab.example:8443/"])
    same = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    assert client.post("/buffer/write", json=trajectory("q1"), headers=same).status_code == 200
    allowed = {"origin": "https://lab.example:8443", "sec-fetch-site": "cross-site"}
    assert client.post("/buffer/write", json=trajectory("q1"), headers=allowed).status_code == 200
    other = {"origin": "https://lab.example"}
    assert client.post("/buffer/write", json=trajectory("q2"), headers=other).status_code == 403
    anyone = make_client(group_size=2, allowed_origins=["*"])
    assert anyone.post("/buffer/write", json=trajectory("q3"), headers=other).status_code == 200
