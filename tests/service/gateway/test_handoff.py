"""The buffer's ``/sessions`` with ``--gateway-url``: what it hands to a gateway process, and the
sessions it keeps serving itself.

In-process: the buffer's app, with its hand-off's HTTP client on a stand-in for the gateway
processes (what it is sent, what it answers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from buffer.processes import free_port
from buffer.service.app import create_app
from buffer.service.settings import Settings
from buffer.toolkit.transport import HttpxTransport
from tests.support.gateway import TOOLS, open_session, sdk, session_trajectories

GATEWAY = "http://gateway.test"


class GatewayProcess:
    """A stand-in for a gateway process: every body it was sent, and a session opened for each."""

    def __init__(self) -> None:
        self.opened: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/sessions")
        self.opened.append(json.loads(request.content))
        session_id = f"s{len(self.opened)}"
        data = {"session_id": session_id, "base_url": f"{GATEWAY}/sessions/{session_id}/v1", "api_key": "k"}
        return httpx.Response(200, json={"success": True, "message": "session opened", "data": data})


def handing_off(client: TestClient) -> GatewayProcess:
    process = GatewayProcess()
    client.app.state.handoff._transport = HttpxTransport(httpx.MockTransport(process))
    return process


def test_the_task_s_session_settings_fill_the_open_handed_to_a_gateway_process(make_client: Any) -> None:
    """The gateway processes know no jobs: the buffer fills in what ``/start_rollout`` said for
    the task's sessions (slime's strings as the types ``POST /sessions`` takes), where the body
    says nothing."""
    client = make_client(gateway_url=[GATEWAY])
    process = handing_off(client)
    task = {
        "remote_engine_url": "http://engine.test",
        "session_timeout_s": "90",
        "session_on_timeout": "write",
        "session_token_mode": "True",
        "tokenizer_path": "/models/policy",
        "session_sampling": '{"temperature": 1.0, "top_p": 1.0}',
    }
    client.app.state.services.buffer.job_started("agent", "agent_generator", task)  # as /start_rollout does
    opened = client.post("/sessions", json={"task_type": "agent", "instance_id": "q1"})
    assert opened.status_code == 200, opened.text
    assert opened.json()["data"]["base_url"] == f"{GATEWAY}/sessions/s1/v1"
    assert process.opened[-1] == {
        "task_type": "agent",
        "instance_id": "q1",
        "remote_engine_url": "http://engine.test",
        "timeout_s": 90.0,
        "on_timeout": "write",
        "token_mode": True,
        "tokenizer_path": "/models/policy",
        "sampling": {"temperature": 1.0, "top_p": 1.0},
    }

    own = {"remote_engine_url": "http://other.test", "timeout_s": 5, "token_mode": False, "sampling": {}}
    client.post("/sessions", json={"task_type": "agent", "instance_id": "q2", **own})
    sent = process.opened[-1]
    assert {key: sent[key] for key in own} == own  # the body's own say wins
    assert "tokenizer_path" not in sent  # not in token mode

    client.post("/sessions", json={"task_type": "other", "instance_id": "q3"})
    assert process.opened[-1] == {"task_type": "other", "instance_id": "q3"}  # no job: as sent


def test_a_session_opened_before_the_hand_off_is_still_ended_at_the_buffer(
    tmp_path: Path,
    generator_dir: Path,
    loopback: str,
) -> None:
    """A session the buffer's own gateway holds (opened before ``--gateway-url``, restored from
    the data folder) is served by it: its state, reward and end; one it ended answers a retried
    end itself. Any other session's end goes to the gateway processes (here: none answers)."""
    settings = Settings(generator_dir=generator_dir, port=8889, group_size=2, data_dir=tmp_path / "data")
    with TestClient(create_app(settings)) as client:
        session = open_session(client, loopback)
        sdk(client, session).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Compute 2 + 3."}], tools=TOOLS
        )
        ended_here = open_session(client, loopback, "q2")
        sdk(client, ended_here).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        assert (
            client.post(f"/sessions/{ended_here['session_id']}/end", json={"reward": 1.0}).status_code == 200
        )

    handed_off = settings.model_copy(update={"gateway_url": [f"http://127.0.0.1:{free_port()}"]})
    with TestClient(create_app(handed_off)) as client:
        path = f"/sessions/{session['session_id']}"
        assert client.get(path).json()["data"]["calls"] == 1
        assert client.post(f"{path}/reward", json={"reward": 0.5}).status_code == 200
        ended = client.post(f"{path}/end").json()
        assert (ended["data"]["written"], ended["data"]["duplicate"]) == (True, False), ended
        again = client.post(f"{path}/end").json()
        assert (again["data"]["written"], again["data"]["duplicate"]) == (True, True), again
        before = client.post(f"/sessions/{ended_here['session_id']}/end").json()
        assert before["data"]["duplicate"], before

        elsewhere = client.post("/sessions/not-here/end", json={})
        assert elsewhere.status_code == 503  # forwarded: no gateway process answers
        assert "cannot be reached" in elsewhere.json()["message"]

        trajectories = {t["instance_id"]: t for t in session_trajectories(client, "q1", "q2")}
        assert trajectories["q1"]["raw_reward"] == 0.5
        assert set(trajectories) == {"q1", "q2"}
