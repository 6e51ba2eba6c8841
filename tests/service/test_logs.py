from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from buffer.logs import OWN_LOGGERS, RequestIdMiddleware, configure_logging, request_id
from buffer.service.app import create_app
from buffer.service.settings import Settings
from tests.support.calls import wait_for

logger = logging.getLogger("buffer.test_logs")


#: Loggers the tests log through or configure: put back as they were after each test.
TOUCHED = (*OWN_LOGGERS, "httpx", "httpcore", "openai", "aiohttp", "httpx2", "httpx2.client", "sympy")


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """Logging configured to a StringIO; the loggers it touches are put back afterwards."""
    root = logging.getLogger()
    saved = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in TOUCHED}
    saved_handlers = {name: logging.getLogger(name).handlers[:] for name in TOUCHED}
    root_level, root_handlers = root.level, root.handlers[:]
    stream = io.StringIO()
    yield stream
    root.handlers[:] = root_handlers
    root.setLevel(root_level)
    for name, (level, propagate) in saved.items():
        named = logging.getLogger(name)
        named.setLevel(level)
        named.propagate = propagate
        named.handlers[:] = saved_handlers[name]


def app_with_logging_routes(make_client: Callable[..., TestClient]) -> TestClient:
    client = make_client()
    app = client.app
    assert isinstance(app, FastAPI)

    @app.get("/test/log")
    async def log_something() -> dict[str, str]:
        logger.info("handling %s", "it")
        return {}

    @app.get("/test/boom")
    async def boom() -> dict[str, str]:
        raise RuntimeError("boom")

    return client


def test_echoes_a_given_request_id(make_client: Callable[..., TestClient]) -> None:
    response = make_client().get("/", headers={"X-Request-ID": "trainer-7/step-12"})
    assert response.headers["x-request-id"] == "trainer-7/step-12"


def test_makes_a_request_id_when_absent(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    first = client.get("/").headers["x-request-id"]
    second = client.get("/").headers["x-request-id"]
    assert len(first) == 16
    assert int(first, 16) >= 0
    assert first != second


@pytest.mark.parametrize("given", ["x" * 129, "bad\x01id", "   "])
def test_replaces_an_unusable_request_id(make_client: Callable[..., TestClient], given: str) -> None:
    response = make_client().get("/", headers={"X-Request-ID": given})
    assert len(response.headers["x-request-id"]) == 16
    assert response.headers["x-request-id"] != given


def test_text_line_carries_the_request_id(
    make_client: Callable[..., TestClient], log_stream: io.StringIO
) -> None:
    configure_logging("info", "text", stream=log_stream)
    client = app_with_logging_routes(make_client)
    client.get("/test/log", headers={"X-Request-ID": "abc123"})
    lines = [line for line in log_stream.getvalue().splitlines() if "handling it" in line]
    assert len(lines) == 1
    assert lines[0].endswith(" INFO    buffer.test_logs [req abc123]: handling it")
    logger.info("outside")
    assert log_stream.getvalue().splitlines()[-1].endswith(" INFO    buffer.test_logs: outside")


def test_a_failing_request_logs_its_id(
    make_client: Callable[..., TestClient], log_stream: io.StringIO
) -> None:
    configure_logging("info", "json", stream=log_stream)
    client = app_with_logging_routes(make_client)
    client_500 = TestClient(client.app, raise_server_exceptions=False)
    assert client_500.get("/test/boom", headers={"X-Request-ID": "fail-1"}).status_code == 500
    entries = [orjson.loads(line) for line in log_stream.getvalue().splitlines()]
    failed = [entry for entry in entries if entry["message"] == "GET /test/boom failed"]
    assert len(failed) == 1
    assert failed[0]["request_id"] == "fail-1"
    assert "RuntimeError: boom" in failed[0]["traceback"]


def test_json_lines(log_stream: io.StringIO) -> None:
    configure_logging("debug", "json", stream=log_stream)
    logger.info("plain %d", 1)
    logger.warning("with extras", extra={"task_type": "math", "count": 3, "odd": object()})
    token = request_id.set("r-1")
    try:
        raise ValueError("bad value")
    except ValueError:
        logger.exception("it failed")
    finally:
        request_id.reset(token)
    plain, extras, failed = (orjson.loads(line) for line in log_stream.getvalue().splitlines())

    assert set(plain) == {"time", "level", "logger", "message"}
    assert plain["level"] == "INFO"
    assert plain["logger"] == "buffer.test_logs"
    assert plain["message"] == "plain 1"
    assert plain["time"].endswith("+00:00")
    assert abs(time.time() - time_of(plain["time"])) < 60

    assert extras["task_type"] == "math"
    assert extras["count"] == 3
    assert extras["odd"].startswith("<object object")
    assert "request_id" not in extras

    assert failed["request_id"] == "r-1"
    assert failed["level"] == "ERROR"
    assert failed["traceback"].startswith("Traceback (most recent call last):")
    assert failed["traceback"].endswith("ValueError: bad value")


def time_of(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_uvicorn_and_httpx_loggers(log_stream: io.StringIO) -> None:
    logging.getLogger("uvicorn.access").addHandler(logging.NullHandler())
    logging.getLogger("uvicorn.error").propagate = False
    configure_logging("info", "text", stream=log_stream)
    logging.getLogger("uvicorn.error").info("Started server process")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/", "1.1", 200)
    logging.getLogger("httpx").info("HTTP Request: POST http://llm/v1/chat/completions")
    lines = log_stream.getvalue().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "INFO    uvicorn.error: Started server process",
        'INFO    uvicorn.access: 127.0.0.1:1 - "GET / HTTP/1.1" 200',
    ]
    assert logging.getLogger("uvicorn.access").handlers == []


@pytest.mark.parametrize("name", ["openai", "aiohttp", "httpcore", "httpx2.client", "sympy"])
def test_every_library_says_only_its_warnings_by_default(log_stream: io.StringIO, name: str) -> None:
    """The OpenAI SDK and aiohttp log a line per engine request: a flood at a generator's rate.
    No list of them: a library nobody named (``httpx2``) is quiet too."""
    configure_logging("info", "text", stream=log_stream)
    logging.getLogger(name).info("HTTP Request: POST http://llm/v1/chat/completions")
    logging.getLogger(name).warning("Retrying request")
    lines = log_stream.getvalue().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [f"WARNING {name}: Retrying request"]


@pytest.mark.parametrize("name", ["buffer.service.jobs", "generator.math", "default_func", "uvicorn.error"])
def test_the_service_s_own_loggers_log_at_the_level_asked(log_stream: io.StringIO, name: str) -> None:
    configure_logging("debug", "text", stream=log_stream)
    logging.getLogger(name).debug("in detail")
    logging.getLogger("httpx").debug("not this")
    logging.getLogger("httpx").info("nor this")
    assert [line.split(" ", 2)[2] for line in log_stream.getvalue().splitlines()] == [
        f"DEBUG   {name}: in detail"
    ]


def test_a_named_logger_gets_its_own_level(log_stream: io.StringIO) -> None:
    configure_logging("info", "text", stream=log_stream, levels={"httpx2": "info", "buffer.core": "warning"})
    logging.getLogger("httpx2.client").info("asked for")
    logging.getLogger("httpx").info("not asked for")
    logging.getLogger("buffer.core.task").info("quietened")
    logging.getLogger("buffer.service").info("the rest of the service")
    assert [line.split(" ", 2)[2] for line in log_stream.getvalue().splitlines()] == [
        "INFO    httpx2.client: asked for",
        "INFO    buffer.service: the rest of the service",
    ]


def test_a_stricter_level_than_warning_holds_for_libraries_too(log_stream: io.StringIO) -> None:
    configure_logging("error", "text", stream=log_stream)
    logging.getLogger("openai").warning("a library's warning")
    logging.getLogger("buffer.service").warning("the service's warning")
    logging.getLogger("openai").error("a library's error")
    assert [line.split(" ", 2)[2] for line in log_stream.getvalue().splitlines()] == [
        "ERROR   openai: a library's error"
    ]


def test_configuring_again_does_not_duplicate_lines(log_stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=log_stream)
    configure_logging("info", "text", stream=log_stream)
    configure_logging("info", "text", stream=log_stream)
    logger.info("once")
    assert log_stream.getvalue().count("once") == 1
    assert len(logging.getLogger().handlers) == 1


async def trivial_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def drive(app: Any, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_non_http_scopes_pass_through_untouched() -> None:
    seen: list[tuple[Scope, str | None]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope, request_id.get()))
        await send({"type": "websocket.accept", "headers": []})

    scope: Scope = {"type": "websocket", "headers": [(b"x-request-id", b"ws")]}
    sent = asyncio.run(drive(RequestIdMiddleware(app), scope))
    assert seen == [(scope, None)]
    assert sent == [{"type": "websocket.accept", "headers": []}]


def test_a_library_s_private_record_attributes_stay_out_of_json_lines(log_stream: io.StringIO) -> None:
    """Ray, once imported, makes every record carry ``_ray_timestamp_ns``: not a field of ours."""
    make_record = logging.getLogRecordFactory()

    def private_attribute(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        record._library_timestamp_ns = 1  # type: ignore[attr-defined]
        return record

    logging.setLogRecordFactory(private_attribute)
    try:
        configure_logging("debug", "json", stream=log_stream)
        logger.info("plain", extra={"task_type": "math"})
    finally:
        logging.setLogRecordFactory(make_record)
    (line,) = (orjson.loads(line) for line in log_stream.getvalue().splitlines())
    assert set(line) == {"time", "level", "logger", "message", "task_type"}


JOB_CONTEXT = """
import asyncio, json
from buffer.logs import request_id

TASK_TYPE = "context"
START_ROLLOUT_FIELDS = ("out",)

async def run_rollout(data):
    with open(data["out"], "w") as out:
        json.dump({"request_id": request_id.get()}, out)
    await asyncio.Event().wait()
"""


def test_a_jobs_lines_do_not_carry_the_id_of_the_request_that_started_it(tmp_path: Path) -> None:
    generators = tmp_path / "generator"
    generators.mkdir()
    (generators / "context_generator.py").write_text(JOB_CONTEXT)
    out = tmp_path / "out.json"
    settings = Settings(generator_dir=generators, job_isolation="inline", group_size=2)
    with TestClient(create_app(settings)) as client:
        answer = client.post(
            "/start_rollout",
            json={"task_type": "context", "out": str(out)},
            headers={"X-Request-ID": "start-1"},
        )
        assert answer.status_code == 200, answer.text
        wait_for(out.exists, 30, "the generator running")
    assert orjson.loads(out.read_bytes()) == {"request_id": None}
