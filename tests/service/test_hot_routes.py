"""The hot routes (``/buffer/write``, ``/buffer/write_batch``, ``/get_rollout_data``): answered ahead
of FastAPI's layers and routing, behind the one guard that makes every check (``ServiceGuard``),
answering as FastAPI's routes answer."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from starlette.types import Message, Scope

from buffer.logs import OWN_LOGGERS, configure_logging
from buffer.service.app import HOT_ROUTES, ServiceApp
from buffer.service.security import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    HostGuardMiddleware,
    HostRule,
    ServiceGuard,
)
from tests.support.calls import write_all
from tests.support.factories import group, trajectory

KEY = "s3cret-key"
BEARER = {"authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}

#: What a hot route's request passes from the app's entry to its endpoint, outermost first: the
#: app's dispatch, the guard (its body-size step), the endpoints' caller. A middleware added in
#: front of the hot routes, or the request sent FastAPI's way, shows up here.
HOT_CHAIN = ["ServiceApp.__call__", "ServiceGuard.__call__", "_BodyLimit.run", "HotRoutes.__call__"]


#: A stack as the spy saw it, innermost first: each frame's function and module, up to the app's entry.
Stack = list[tuple[str, str]]


def stack_of(frame: FrameType | None) -> Stack:
    """Read while the request runs: a coroutine's frame loses its caller once it returns."""
    found: Stack = []
    while frame is not None:
        found.append((frame.f_code.co_qualname, frame.f_globals.get("__name__", "?")))
        if frame.f_code.co_qualname == "ServiceApp.__call__":
            break
        frame = frame.f_back
    return found


def chain(stack: Stack, endpoint: str) -> list[str]:
    """The functions from the app's entry down to ``endpoint`` (excluded), outermost first."""
    names = [name for name, _ in stack]
    assert endpoint in names, f"{endpoint} is not on the stack: {names}"
    assert names[-1] == "ServiceApp.__call__", f"ServiceApp.__call__ is not on the stack: {names}"
    return names[names.index(endpoint) + 1 :][::-1]


def modules(stack: Stack) -> set[str]:
    return {module for _, module in stack}


@pytest.fixture
def spied(make_client: Callable[..., TestClient]) -> Iterator[tuple[TestClient, list[Stack]]]:
    """A client whose buffer records the stack of each write and read it is asked for."""
    client = make_client(group_size=2)
    buffer = client.app.state.services.buffer  # type: ignore[attr-defined]
    frames: list[Stack] = []

    def spy(method: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            frames.append(stack_of(sys._getframe(1)))
            return method(*args, **kwargs)

        return recorded

    for name in ("write", "write_many", "read"):
        setattr(buffer, name, spy(getattr(buffer, name)))
    yield client, frames
    frames.clear()


@pytest.mark.parametrize(
    ("path", "endpoint", "body"),
    [
        ("/buffer/write", "write", trajectory()),
        ("/buffer/write_batch", "write_batch", group("b", [0.0, 1.0])),
        ("/get_rollout_data", "get_rollout_data_hot", {"batch_size": -1}),
    ],
)
def test_a_hot_route_passes_the_guard_alone_and_nothing_of_fastapi(
    spied: tuple[TestClient, list[Stack]], path: str, endpoint: str, body: Any
) -> None:
    client, frames = spied
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert frames  # the first: the endpoint's call (a write calls write_many in turn)
    assert chain(frames[0], endpoint) == HOT_CHAIN, "a layer was added in front of the hot routes"
    assert not {name for name in modules(frames[0]) if name.split(".")[0] in ("fastapi", "starlette")}


def test_fastapis_routes_pass_one_layer_of_ours(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client()
    app = client.app
    assert isinstance(app, ServiceApp)
    ours: list[Any] = [middleware.cls for middleware in app.user_middleware]
    assert ours == [ServiceGuard]
    separate = {ApiKeyMiddleware, BodySizeLimitMiddleware, BrowserGuardMiddleware, HostGuardMiddleware}
    assert not set(ours) & separate
    assert client.get("/buffer/stats").status_code == 200


def test_the_hot_routes_are_the_routers_too_and_in_the_schema(make_client: Callable[..., TestClient]) -> None:
    """Each hot path has a route in the router (a GET gets its 405 there) and in the OpenAPI schema."""
    client = make_client()
    paths = client.get("/openapi.json").json()["paths"]
    for path in HOT_ROUTES:
        assert "post" in paths[path], path
        assert client.get(path).status_code == 405, path


def test_with_fastapis_telemetry_on_the_hot_routes_go_fastapis_way(
    spied: tuple[TestClient, list[Stack]], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, frames = spied
    app = client.app
    assert isinstance(app, ServiceApp)
    telemetry = getattr(app, "_native_telemetry", None)
    if telemetry is None:
        pytest.skip("this FastAPI has no native telemetry")
    with monkeypatch.context() as patch:
        patch.setattr(telemetry, "enabled", lambda: True)
        patch.setattr(app, "_hot_on", None)
        assert app._decide_hot() is False
    # As decided, without FastAPI's telemetry itself running (no OpenTelemetry is configured here).
    monkeypatch.setattr(app, "_hot_on", False)
    assert client.post("/buffer/write", json=trajectory()).status_code == 200
    names = [name for name, _ in frames[0]]
    assert "ServiceGuard.__call__" in names
    assert "HotRoutes.__call__" not in names
    assert {"fastapi.applications", "starlette.routing"} <= modules(frames[0])


# -- every check, on each hot route -------------------------------------------------------------

HOT = [
    pytest.param("/buffer/write", trajectory(), id="write"),
    pytest.param("/buffer/write_batch", [trajectory()], id="write_batch"),
    pytest.param("/get_rollout_data", {}, id="read"),
]


@pytest.fixture
def guarded(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(api_key=KEY, allowed_hosts=["testserver"], max_request_bytes=4096, group_size=2)


def written(client: TestClient) -> int:
    stats = client.get("/buffer/stats", headers=BEARER).json()["data"]["data"]
    return sum(task["total_written"] for task in stats)


@pytest.mark.parametrize(("path", "body"), HOT)
@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        pytest.param({}, 401, "missing API key", id="no-key"),
        pytest.param({**BEARER, "host": "evil.example"}, 421, "does not answer to the host", id="host"),
        pytest.param({**BEARER, "origin": "http://evil.example"}, 403, "is refused", id="origin"),
        pytest.param({**BEARER, "content-type": "text/plain"}, 415, "must be JSON", id="not-json"),
    ],
)
def test_every_check_holds_on_each_hot_route(
    guarded: TestClient, path: str, body: Any, headers: dict[str, str], status: int, reason: str
) -> None:
    before = written(guarded)
    response = guarded.post(path, content=orjson.dumps(body), headers={**JSON, **headers})
    assert response.status_code == status, response.text
    assert reason in response.json()["message"]
    assert len(response.headers.get_list("x-request-id")) == 1
    assert written(guarded) == before


@pytest.mark.parametrize(("path", "body"), HOT)
def test_a_body_over_the_limit_gets_413_on_each_hot_route(guarded: TestClient, path: str, body: Any) -> None:
    big = orjson.dumps({"padding": "x" * 5000})
    response = guarded.post(path, content=big, headers={**JSON, **BEARER})
    assert response.status_code == 413
    assert response.headers["connection"] == "close"
    assert len(response.headers.get_list("x-request-id")) == 1


@pytest.mark.parametrize(("path", "body"), HOT)
def test_a_hot_route_echoes_the_request_id(guarded: TestClient, path: str, body: Any) -> None:
    response = guarded.post(path, json=body, headers={**BEARER, "x-request-id": "trainer-7/step-3"})
    assert response.status_code == 200, response.text
    assert response.headers.get_list("x-request-id") == ["trainer-7/step-3"]
    fresh = guarded.post(path, json=body, headers=BEARER).headers.get_list("x-request-id")
    assert len(fresh) == 1
    assert len(fresh[0]) == 16


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """Logging configured to a StringIO (JSON lines); the service's loggers put back afterwards."""
    root = logging.getLogger()
    saved = {
        name: (logging.getLogger(name).level, logging.getLogger(name).handlers[:]) for name in OWN_LOGGERS
    }
    root_level, root_handlers = root.level, root.handlers[:]
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    yield stream
    root.handlers[:] = root_handlers
    root.setLevel(root_level)
    for name, (level, handlers) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).propagate = True


def test_an_unexpected_error_in_a_hot_route_is_a_bare_500_logged_with_its_id(
    make_client: Callable[..., TestClient], log_stream: io.StringIO
) -> None:
    client = make_client()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("internal detail /srv/secret/path")

    client.app.state.services.buffer.write = broken  # type: ignore[attr-defined]
    quiet = TestClient(client.app, raise_server_exceptions=False)
    response = quiet.post("/buffer/write", json=trajectory(), headers={"x-request-id": "fail-7"})
    assert response.status_code == 500
    assert response.json() == {
        "success": False,
        "message": "internal error; the service log has the details",
        "data": None,
    }
    entries = [orjson.loads(line) for line in log_stream.getvalue().splitlines()]
    failed = [entry for entry in entries if entry["message"] == "POST /buffer/write failed"]
    assert len(failed) == 1
    assert failed[0]["request_id"] == "fail-7"
    assert "internal detail /srv/secret/path" in failed[0]["traceback"]
    with pytest.raises(RuntimeError):  # and on to the server, as Starlette's outermost layer does
        client.post("/buffer/write", json=trajectory())


# -- a read answers as FastAPI's route answers ------------------------------------------------------

READ_BODIES = [
    b"",
    b"{}",
    b"null",
    b"[]",
    b"  ",
    b"{bad",
    b'{"batch_size": 0}',
    b'{"batch_size": "2"}',
    b'{"batch_size": 2.0}',
    b'{"batch_size": true}',
    b'{"batch_size": 100000000000000000000000}',
    b'{"wait_s": NaN}',
    b'{"wait_s": Infinity}',
    b'{"wait_s": -1}',
    b'{"unknown": 1}',
    b'{"task_type": "nope"}',
    b'{"task_type": 5}',
    b'{"task_type": "\\ud800"}',
    b'{"mix": {"default": 1}}',
    b'{"mix": {}}',
    b'{"replay_ratio": 0.5}',
    b'{"batch_size": 2, "batch_size": -1}',
    b"[" * 5000,
    b'{"batch_size": 2}',
    b'{"batch_size": -1, "task_type": "default"}',
]


def answer(client: TestClient, body: bytes) -> tuple[int, Any]:
    response = client.post("/get_rollout_data", content=body, headers=JSON)
    assert len(response.headers.get_list("x-request-id")) == 1
    payload = response.json()
    if isinstance(payload.get("data"), dict) and "data" in payload["data"]:
        payload["data"] = [item["uid"] for item in payload["data"]["data"]]  # meta_info holds ages
    return response.status_code, payload


def test_a_read_answers_what_fastapis_route_answers(make_client: Callable[..., TestClient]) -> None:
    hot, routed = make_client(group_size=2), make_client(group_size=2)
    routed.app._hot_on = False  # type: ignore[attr-defined]  # every request FastAPI's way
    for client in (hot, routed):
        for n in range(4):
            items = group(f"r{n}", [0.0, 1.0])
            for m, item in enumerate(items):
                item["uid"] = f"r{n}-{m}"
            write_all(client, items)
    for body in READ_BODIES:
        assert answer(hot, body) == answer(routed, body), body[:60]


def test_a_read_of_a_gone_client_takes_nothing(make_client: Callable[..., TestClient]) -> None:
    """A long poll whose client has gone reads nothing (a 499 no one sees): as FastAPI's route."""
    client = make_client(group_size=2)
    app = client.app
    sent: list[Message] = []

    async def receive_then_gone() -> Message:
        if not sent:
            sent.append({"type": "http.request"})
            return {"type": "http.request", "body": b'{"wait_s": 5}', "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/get_rollout_data",
        "raw_path": b"/get_rollout_data",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
        "state": {},
    }
    client.portal.call(app, scope, receive_then_gone, send)  # type: ignore[union-attr]
    starts = [message for message in sent if message.get("type") == "http.response.start"]
    assert [start["status"] for start in starts] == [499]


# -- the guard on its own ----------------------------------------------------------------------------


def test_the_guard_closes_a_websocket_without_the_key_or_from_a_foreign_host() -> None:
    passed: list[Scope] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        passed.append(scope)

    guard = ServiceGuard(app, max_bytes=100, api_key=KEY, hosts=HostRule(frozenset({"localhost"})))
    closed: list[Message] = []

    async def send(message: Message) -> None:
        closed.append(message)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    def websocket(*headers: tuple[bytes, bytes]) -> Scope:
        return {"type": "websocket", "path": "/ws", "headers": list(headers)}

    asyncio.run(guard(websocket((b"host", b"localhost")), receive, send))
    assert closed[-1] == {
        "type": "websocket.close",
        "code": 1008,
        "reason": "missing API key: send 'Authorization: Bearer <key>'",
    }
    asyncio.run(
        guard(
            websocket((b"host", b"evil.example"), (b"authorization", b"Bearer " + KEY.encode())),
            receive,
            send,
        )
    )
    assert closed[-1]["code"] == 1008
    assert "evil.example" in closed[-1]["reason"]
    assert not passed
    asyncio.run(
        guard(
            websocket((b"host", b"localhost"), (b"authorization", b"Bearer " + KEY.encode())), receive, send
        )
    )
    assert len(passed) == 1
    assert len(closed) == 2
    asyncio.run(guard({"type": "lifespan"}, receive, send))
    assert len(passed) == 2
