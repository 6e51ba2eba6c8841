"""What a client may make a job read and call: input roots, engine hosts, the service's key."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from buffer.core.registry import GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.service.job_policy import JobPolicy
from buffer.service.jobs import JobManager, JobStatus
from buffer.service.settings import Settings

# Writes the data it was started with to data["out"].
RECORDER = """
import json, os

TASK_TYPE = "recorder"
START_ROLLOUT_FIELDS = ("out", "reward_model_url", "reward_model_urls")

def run_rollout(data):
    with open(data["out"] + ".tmp", "w") as out:
        json.dump(data, out)
    os.replace(data["out"] + ".tmp", data["out"])
"""


@pytest.fixture
def start(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path
) -> Callable[..., tuple[int, dict[str, object]]]:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    clients: dict[str, TestClient] = {}

    def post(payload: dict[str, object], **settings: object) -> tuple[int, dict[str, object]]:
        key = repr(sorted(settings.items()))
        if key not in clients:
            clients[key] = make_client(**{"check_engines": False, **settings})  # no engine runs
        body = {"task_type": "recorder", "restart": True, "out": str(tmp_path / "out.json"), **payload}
        response = clients[key].post("/start_rollout", json=body)
        return response.status_code, response.json()

    return post


def refused(answer: dict[str, object]) -> list[str]:
    errors = answer.get("errors")
    assert isinstance(errors, list)
    return [str(error["field"]) for error in errors]


def test_an_input_file_outside_the_roots_is_refused_naming_the_field(
    start: Callable[..., tuple[int, dict[str, object]]], tmp_path: Path
) -> None:
    roots = tmp_path / "data"
    roots.mkdir()
    (roots / "rows.jsonl").write_text('{"prompt": "a"}\n')
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "private"}\n')
    (roots / "link.jsonl").symlink_to(secret)
    allowed = {"input_roots": [roots]}
    for path in (str(secret), "/etc/passwd", str(roots / "link.jsonl"), str(roots / ".." / "secret.jsonl")):
        status, answer = start({"input_file": path}, **allowed)
        assert status == 422, path
        assert refused(answer) == ["input_file"]
        assert "input roots" in str(answer["message"])
    status, answer = start({"input_file": str(roots / "rows.jsonl")}, **allowed)
    assert status == 200, answer
    status, answer = start({"input_file": str(roots / "missing.jsonl")}, **allowed)
    assert (status, refused(answer)) == (422, ["input_file"])  # before the trainer is told it started
    assert "no such file" in str(answer["message"])


def test_a_device_file_is_refused_even_under_a_root(
    start: Callable[..., tuple[int, dict[str, object]]],
) -> None:
    status, answer = start({"input_file": "/dev/zero"}, input_roots=["/dev"])
    assert (status, refused(answer)) == (422, ["input_file"])
    assert "regular file" in str(answer["message"])


def test_the_roots_default_to_the_generator_data_and_the_working_folder(
    start: Callable[..., tuple[int, dict[str, object]]], generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "data").mkdir()
    (generator_dir / "data" / "rows.jsonl").write_text('{"prompt": "a"}\n')
    assert start({"input_file": str(generator_dir / "data" / "rows.jsonl")})[0] == 200
    assert start({"input_file": "pyproject.toml"})[0] == 200  # relative to the working folder
    assert start({"input_file": str(tmp_path / "out.json")})[0] == 422


def test_engine_hosts_outside_the_allowlist_are_refused(
    start: Callable[..., tuple[int, dict[str, object]]], tmp_path: Path
) -> None:
    hosts = {"allowed_engine_hosts": ["engine.internal", "10.0.0.7"]}
    for field, url in [
        ("remote_engine_url", "http://169.254.169.254/latest"),
        ("reward_model_url", "http://evil.example:80/score"),
        ("remote_buffer_url", "http://evil.example:8889"),
        ("remote_engine_url", "file:///etc/passwd"),
    ]:
        status, answer = start({field: url}, **hosts)
        assert (status, refused(answer)) == (422, [field]), url
    status, answer = start(
        {
            "remote_engine_url": "http://engine.internal:30000/v1",
            "reward_model_urls": ["http://10.0.0.7:9000/score"],
            "remote_buffer_url": "http://127.0.0.1:8889",  # the service itself
        },
        **hosts,
    )
    assert status == 200, answer
    status, answer = start({"reward_model_urls": ["http://10.0.0.7/a", "http://elsewhere/b"]}, **hosts)
    assert refused(answer) == ["reward_model_urls.1"]
    assert start({"remote_engine_url": "http://anywhere.example/v1"})[0] == 200  # default: any host


def test_each_engine_of_a_pool_is_checked_against_the_allowlist(
    start: Callable[..., tuple[int, dict[str, object]]], tmp_path: Path
) -> None:
    hosts = {"allowed_engine_hosts": ["engine.internal", "10.0.0.7"]}
    pool = ["http://engine.internal:30000", "http://10.0.0.7:30000/v1"]
    status, answer = start({"remote_engine_url": pool}, **hosts)
    assert status == 200, answer
    status, answer = start({"remote_engine_url": [*pool, "http://169.254.169.254/latest"]}, **hosts)
    assert (status, refused(answer)) == (422, ["remote_engine_url.2"])
    status, answer = start({"remote_engine_url": ["http://engine.internal", "file:///etc/passwd"]}, **hosts)
    assert (status, refused(answer)) == (422, ["remote_engine_url.1"])


@pytest.mark.parametrize("value", [[], [1], "", 5])
def test_remote_engine_url_is_a_url_or_a_non_empty_list_of_them(
    start: Callable[..., tuple[int, dict[str, object]]], value: object
) -> None:
    status, answer = start({"remote_engine_url": value})
    assert status == 422, answer
    assert refused(answer)[0].startswith("remote_engine_url")


def test_the_job_reads_the_input_file_resolved(
    start: Callable[..., tuple[int, dict[str, object]]], tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    assert start({"input_file": "pyproject.toml"})[0] == 200
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(out.read_text())["input_file"] == str(Path("pyproject.toml").resolve())


# Records whether the sink it opens for data["remote_buffer_url"] sends a key, and which.
KEY_PROBE = """
import json
from buffer.toolkit.sink import open_sink

TASK_TYPE = "key_probe"
START_ROLLOUT_FIELDS = ('out',)

async def run_rollout(data):
    sink = await open_sink(data["remote_buffer_url"], api_key=data.get("buffer_api_key"))
    with open(data["out"], "w") as out:
        json.dump({"authorization": sink.authorization}, out)
    await sink.aclose()
"""


@pytest.mark.anyio
async def test_the_service_key_is_not_sent_to_a_buffer_the_client_chose(
    monkeypatch: pytest.MonkeyPatch, generator_dir: Path, tmp_path: Path
) -> None:
    """Only to the hosts of ``--send-api-key-to``; a client's own key goes where it says."""
    monkeypatch.setenv("ROLLOUT_BUFFER_API_KEY", "service-secret")
    (generator_dir / "key_probe_generator.py").write_text(KEY_PROBE)
    registry = GeneratorRegistry(generator_dir)
    registry.refresh()
    generator = registry.generators["key_probe"]
    for hosts, own_key, sent in [
        (frozenset(), None, None),
        (frozenset({"other.internal"}), None, "Bearer service-secret"),
        (frozenset(), "its-own", "Bearer its-own"),  # the client's own key for it
    ]:
        policy = JobPolicy((tmp_path,), api_key_hosts=hosts)
        jobs = JobManager(RolloutBuffer(), "http://127.0.0.1:8889", policy=policy, isolation="inline")
        out = tmp_path / "out.json"
        data = {"remote_buffer_url": "http://other.internal:9000", "out": str(out), "buffer_api_key": own_key}
        job = jobs.start(generator, data)
        assert job._task is not None
        await asyncio.wait_for(job._task, 10)
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert json.loads(out.read_text()) == {"authorization": sent}
    assert os.environ["ROLLOUT_BUFFER_API_KEY"] == "service-secret"


def test_an_open_engine_policy_is_warned_about_only_beyond_loopback(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    for host, hosts, warned in [
        ("0.0.0.0", None, True),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", ["engine.internal"], False),
    ]:
        caplog.clear()
        JobPolicy.from_settings(Settings(host=host, allowed_engine_hosts=hosts, generator_dir=tmp_path))
        assert ("--allowed-engine-hosts" in caplog.text) is warned, host


@pytest.mark.anyio
async def test_a_job_whose_input_file_the_roots_no_longer_allow_is_not_resumed(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    registry = GeneratorRegistry(generator_dir)
    registry.refresh()
    buffer = RolloutBuffer()
    buffer.job_started("rec", "recorder", {"input_file": "/etc/passwd", "out": str(tmp_path / "out.json")})
    jobs = JobManager(buffer, "http://127.0.0.1:8889", policy=JobPolicy((tmp_path,)))
    (job,) = await jobs.resume(registry)
    assert job.status is JobStatus.FAILED
    assert "input_file: must lie under the service's input roots" in str(job.error)
    assert buffer.jobs == {}


def test_a_refused_restart_leaves_the_running_job_running(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    (generator_dir / "waiting_generator.py").write_text(
        'import asyncio\nTASK_TYPE = "waiting"\n'
        "async def run_rollout(data):\n    await asyncio.Event().wait()\n"
    )
    client = make_client()
    job_id = client.post("/start_rollout", json={"task_type": "waiting"}).json()["job_id"]
    refused_restart = client.post(
        "/start_rollout", json={"task_type": "waiting", "restart": True, "input_file": "/etc/passwd"}
    )
    assert refused_restart.status_code == 422
    assert client.get(f"/jobs/{job_id}").json()["data"]["status"] == "running"
