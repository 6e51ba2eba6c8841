"""A gateway process's end: the session's chains written to the main buffer in one batch, retried
while it is down or busy, and answered as the buffer answered (a replayed end: a duplicate).

In-process: the loopback engine and a stand-in for the main buffer's ``/buffer/write_batch``."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.service.gateway import remote
from buffer.service.gateway.images import ImagePolicy
from buffer.service.gateway.proxy import EngineProxy
from buffer.service.gateway.remote import MainBufferRefused, RemoteGateway
from buffer.service.gateway.service import SessionUnusable
from buffer.service.job_policy import JobPolicy
from buffer.service.settings import Settings
from buffer.toolkit.transport import HttpxTransport
from tests.support.loopback_engine import create_engine_app

pytestmark = pytest.mark.anyio
BUFFER = "http://buffer.test"
QUESTION = {"role": "user", "content": "Compute 6 * 7."}


class MainBuffer:
    """``/buffer/write_batch`` as the buffer answers it: each uid counted once; ``failures``
    (statuses) answered first, one a request."""

    def __init__(self, *failures: int) -> None:
        self.failures = list(failures)
        self.batches: list[list[dict[str, Any]]] = []
        self.uids: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/buffer/write_batch"
        if self.failures:
            return httpx.Response(self.failures.pop(0), headers={"retry-after": "0"}, json={"success": False})
        batch = orjson.loads(request.content)
        self.batches.append(batch)
        uids = [item["uid"] for item in batch]
        duplicates = sum(uid in self.uids for uid in uids)
        self.uids.update(uids)
        data = {"uids": uids, "written": len(uids) - duplicates, "duplicates": duplicates}
        return httpx.Response(200, json={"success": True, "message": "ok", "data": data})


def gateway_for(main: MainBuffer) -> RemoteGateway:
    settings = Settings()
    return RemoteGateway(
        RolloutBuffer(),
        EngineProxy(engine="vllm", transport=httpx.ASGITransport(create_engine_app())),
        ImagePolicy(None, "http://gateway.test/images/"),
        JobPolicy.from_settings(settings),
        "http://gateway.test",
        buffer_url=BUFFER,
        transport=HttpxTransport(httpx.MockTransport(main)),
    )


async def session_with_a_call(gateway: RemoteGateway, instance_id: str = "q1") -> Any:
    opened = await gateway.open("agent", instance_id, "http://engine.test", {})
    session = gateway.session(opened.session_id)  # the state's own, as the routes find it
    await gateway.complete(session, {"model": "policy", "messages": [QUESTION]})
    return session


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "RETRY_S", 0.01)


async def test_a_replayed_end_answers_the_duplicate_the_main_buffer_counted() -> None:
    """A gateway that died after the buffer took the write replays the end (its session still
    open in its data folder): the buffer counts it once, and the end says so."""
    main = MainBuffer()
    first, replay = gateway_for(main), gateway_for(main)
    session = await session_with_a_call(first)
    written = await first.end(session, reward=1.0)
    assert written is not None
    assert (written.uid, written.duplicate) == (f"session-{session.session_id}", False)

    replay.store.sessions[session.session_id] = session  # what its journal gave back after the crash
    again = await replay.end(session, reward=1.0)
    assert again is not None
    assert (again.uid, again.duplicate) == (written.uid, True)
    assert [len(batch) for batch in main.batches] == [1, 1]


async def test_an_end_waits_out_a_busy_or_unreachable_main_buffer() -> None:
    main = MainBuffer(503, 429, 502)
    gateway = gateway_for(main)
    session = await session_with_a_call(gateway)
    written = await gateway.end(session, reward=1.0)
    assert written is not None
    assert not written.duplicate
    assert len(main.batches) == 1
    assert gateway.store.get(session.session_id) is None  # closed once written


@pytest.mark.parametrize(
    ("status", "error"), [(422, SessionUnusable), (413, SessionUnusable), (401, MainBufferRefused)]
)
async def test_an_end_the_main_buffer_refuses_ends_nothing(status: int, error: type[Exception]) -> None:
    gateway = gateway_for(MainBuffer(status))
    session = await session_with_a_call(gateway)
    with pytest.raises(error, match=f"HTTP {status}"):
        await gateway.end(session, reward=1.0)
    assert gateway.store.get(session.session_id) is session  # still open: an end can be tried again
