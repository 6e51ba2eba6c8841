"""A gateway process's app: the agents' calls routed straight to their endpoints inside the
guards, everything else to FastAPI; errors answered as the app's handlers answer them; each
answer's head and body written at once.

In-process: ``create_gateway_app`` with the loopback engine as its engine (its buffer unreachable:
nothing here ends a session)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from buffer.service.gateway.proxy import EngineProxy
from buffer.service.gateway_process import _OneWrite, create_gateway_app
from buffer.service.settings import Settings
from tests.support.loopback_engine import create_engine_app

ROOT = "http://127.0.0.1:9000"
QUESTION = {"role": "user", "content": "Compute 6 * 7."}


@pytest.fixture
def gateway() -> Iterator[TestClient]:
    app = create_gateway_app(Settings(host="127.0.0.1", port=9000), "http://127.0.0.1:9")
    with TestClient(app, base_url=ROOT) as client:
        app.state.gateway.proxy = EngineProxy(
            engine="vllm", transport=httpx.ASGITransport(create_engine_app())
        )
        yield client


def opened(client: TestClient) -> tuple[str, dict[str, str]]:
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": "http://engine.test"}
    session = client.post("/sessions", json=body).json()["data"]
    return session["base_url"].removeprefix(ROOT), {"authorization": f"Bearer {session['api_key']}"}


def test_calls_reach_their_endpoints_in_every_dialect(gateway: TestClient) -> None:
    root, key = opened(gateway)
    chat = gateway.post(
        f"{root}/chat/completions", json={"model": "policy", "messages": [QUESTION]}, headers=key
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "Hello."
    assert "prompt_token_ids" not in chat.json()  # what only the capture asked for

    streamed = gateway.post(
        f"{root}/chat/completions",
        json={"model": "policy", "messages": [QUESTION], "stream": True},
        headers=key,
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["cache-control"] == "no-cache"
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert '"content":"Hello."' in streamed.text

    message = {"model": "policy", "max_tokens": 64, "messages": [QUESTION]}
    anthropic = gateway.post(
        f"{root}/messages", json=message, headers={"x-api-key": key["authorization"][7:]}
    )
    assert anthropic.json()["content"][0]["text"] == "Hello."
    events = gateway.post(f"{root}/messages", json={**message, "stream": True}, headers=key)
    assert "event: message_stop" in events.text

    session_id = root.split("/")[2]
    assert gateway.get(f"/sessions/{session_id}").json()["data"]["calls"] == 4  # FastAPI's route


def test_a_call_s_errors_are_answered_as_the_app_answers_them(gateway: TestClient) -> None:
    root, key = opened(gateway)
    body = {"model": "policy", "messages": [QUESTION]}
    unknown = gateway.post("/sessions/nope/v1/chat/completions", json=body, headers=key)
    assert unknown.status_code == 404
    assert unknown.json()["success"] is False
    assert "no open session 'nope'" in unknown.json()["message"]

    not_json = gateway.post(
        f"{root}/chat/completions", content=b"{", headers={**key, "content-type": "application/json"}
    )
    assert (not_json.status_code, not_json.json()["errors"][0]["field"]) == (422, "body")
    text = gateway.post(
        f"{root}/chat/completions", content=b"{}", headers={**key, "content-type": "text/plain"}
    )
    assert text.status_code == 415  # the guards stand before the calls' routes
    deep: Any = "x"
    for _ in range(70):
        deep = [deep]
    nested = gateway.post(f"{root}/chat/completions", json={**body, "metadata": {"deep": deep}}, headers=key)
    assert nested.status_code == 422
    assert "nested deeper" in nested.json()["errors"][0]["reason"]
    huge = gateway.post(f"{root}/chat/completions", json={**body, "seed": 2**63}, headers=key)
    assert (huge.status_code, huge.json()["errors"][0]["field"]) == (422, "seed")
    assert gateway.post("/sessions/a/b/v1/chat/completions", json=body, headers=key).status_code == 404


def test_an_unexpected_error_in_a_call_is_a_500_and_logged(
    gateway: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    root, key = opened(gateway)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    gateway.app.state.gateway.complete = broken  # type: ignore[attr-defined]
    answer = gateway.post(
        f"{root}/chat/completions", json={"model": "policy", "messages": [QUESTION]}, headers=key
    )
    assert answer.status_code == 500
    assert answer.json()["success"] is False
    assert "a bug" not in answer.text  # no traceback reaches a client
    assert "a bug" in caplog.text


class Written:
    """A transport's writes, and a request cycle's ``response_started``."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.response_started = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@pytest.mark.anyio
async def test_an_answer_s_head_and_body_leave_in_one_write() -> None:
    seen = Written()
    transport = _OneWrite(seen, seen)  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response: at once
    seen.response_started = True
    transport.write(b"head")
    assert seen.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    transport.write(b"body")
    transport.write(b"more")  # a stream's next chunk
    assert seen.writes[1:] == [b"headbody", b"more"]

    alone = Written()
    transport = _OneWrite(alone, alone)  # type: ignore[arg-type]
    alone.response_started = True
    transport.write(b"head")  # a stream that waits for its first chunk: the head goes on its own
    await asyncio.sleep(0)
    assert alone.writes == [b"head"]

    closing = Written()
    transport = _OneWrite(closing, closing)  # type: ignore[arg-type]
    closing.response_started = True
    transport.write(b"head")
    transport.close()
    assert (closing.writes, closing.closed, transport.is_closing()) == ([b"head"], True, True)


def test_the_session_routes_validate_their_bodies_as_the_service_does(gateway: TestClient) -> None:
    """Plain Starlette routes in a gateway process: the same models, the same 422s."""
    empty = gateway.post("/sessions", json={"task_type": "", "instance_id": "q1"})
    assert (empty.status_code, empty.json()["errors"][0]["field"]) == (422, "task_type")
    extra = gateway.post("/sessions", json={"task_type": "agent", "instance_id": "q1", "colour": "red"})
    assert (extra.status_code, extra.json()["errors"][0]["field"]) == (422, "colour")
    assert gateway.post("/sessions", content=b"").status_code == 422

    root, _ = opened(gateway)
    session = root.split("/")[2]
    wrong = gateway.post(f"/sessions/{session}/reward", json={"reward": "high"})
    assert (wrong.status_code, wrong.json()["errors"][0]["field"]) == (422, "reward")
    unscored = gateway.post(f"/sessions/{session}/end")  # no body: an end as it is; no reward yet
    assert unscored.status_code == 409
    assert "no reward" in unscored.json()["message"]
    discarded = gateway.post(f"/sessions/{session}/end", json={"discard": True})
    assert discarded.json()["data"] == {"written": False}
    assert gateway.get("/health").json()["data"]["role"] == "gateway"
    assert gateway.get("/gateway/sessions").json()["data"]["closed"] == {"written": 0, "discarded": 1}
