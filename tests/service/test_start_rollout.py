"""Mistakes caught at the door of /start_rollout, before a job starts (issue 23): an unknown
field, an input file that is not there, an engine nobody answers at, a second start that
differs from the running one, a copied generator. And what still passes: slime's payloads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port
from tests.support.calls import wait_for
from tests.support.factories import write_generator
from tests.support.paths import SLIME_STUB

# The docs' snippet, as a user writes it: no START_ROLLOUT_FIELDS; it waits until cancelled.
PLAIN = """
import asyncio
TASK_TYPE = "{task}"

async def run_rollout(data):
    await asyncio.Event().wait()
"""

TYPED = """
import asyncio
from pydantic import BaseModel

class Fields(BaseModel):
    difficulty: int
    topic: str = "algebra"

TASK_TYPE = "typed"
START_ROLLOUT_FIELDS = Fields

async def run_rollout(data):
    await asyncio.Event().wait()
"""


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Engine:
    """An engine stand-in that answers ``/health``, and can be stopped."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()


@pytest.fixture
def engine() -> Iterator[Engine]:
    stand_in = Engine()
    yield stand_in
    stand_in.stop()


@pytest.fixture
def rows(generator_dir: Path) -> Path:
    (generator_dir / "data").mkdir()
    path = generator_dir / "data" / "rows.jsonl"
    path.write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    return path


@pytest.fixture
def client(make_client: Callable[..., TestClient], generator_dir: Path) -> TestClient:
    write_generator(generator_dir, "math_generator.py", PLAIN.format(task="math"))
    return make_client(group_size=16)


def slime_payload(engine: Engine, rows: Path) -> dict[str, Any]:
    """Exactly what slime's trainer (rollout_buffer_example.py) POSTs, numbers as strings."""
    return {
        "num_process": "100",
        "num_epoch": "3",
        "remote_engine_url": engine.url,
        "remote_buffer_url": "http://127.0.0.1:8889",
        "task_type": "math",
        "input_file": str(rows),
        "num_repeat_per_sample": "8",
        "max_tokens": "1024",
        "sampling_params": {"max_tokens": 1024, "temperature": 0.8, "top_p": 1.0},
        "tokenizer_path": "/models/qwen",
        "skip_instance_ids": [],
    }


def jobs(client: TestClient) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = client.get("/jobs").json()["data"]["jobs"]
    return listed


def refused(response: Any) -> list[str]:
    return [error["field"] for error in response.json()["errors"]]


# -- unknown fields -------------------------------------------------------------------------


def test_a_misspelt_field_is_refused_with_the_closest_name_and_the_generator_file(
    client: TestClient, engine: Engine, rows: Path
) -> None:
    payload = slime_payload(engine, rows)
    payload["num_repeat_per_sampel"] = payload.pop("num_repeat_per_sample")
    response = client.post("/start_rollout", json=payload)
    assert response.status_code == 422, response.text
    assert refused(response) == ["num_repeat_per_sampel"]
    reason = response.json()["errors"][0]["reason"]
    assert "did you mean num_repeat_per_sample?" in reason
    assert "generator/math_generator.py" in reason
    assert "rollout_generator_" not in response.text  # no internal module name
    assert jobs(client) == []  # no job with groups of the default 16


def test_slimes_payloads_all_pass_for_a_generator_that_declares_nothing(
    client: TestClient, engine: Engine, rows: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # slime's example trainer, with the older buffer's grouping fields.
    older = {
        "min_valid_group_size_ratio": 1.0,
        "min_valid_item_size_ratio": 0.7,
        "group_timeout_seconds": 300,
        "min_timeout_group_size_ratio": 0.7,
    }
    started = client.post("/start_rollout", json={**slime_payload(engine, rows), **older})
    assert started.status_code == 200, started.text
    # This project's slime adapter (buffer.trainer.slime_rollout), evaluation fields included.
    monkeypatch.syspath_prepend(str(SLIME_STUB))  # the adapter imports slime's types
    from buffer.trainer.slime_rollout import _payload

    args = SimpleNamespace(
        rollout_num_process=8,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=int(engine.url.rsplit(":", 1)[1]),
        rollout_buffer_url="http://127.0.0.1:8889",
        hf_checkpoint="/models/qwen",
        input_key="prompt",
        label_key="label",
        rollout_seed=1,
    )
    sampling = {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0}
    adapter = _payload(args, input_file=str(rows), n=4, num_epoch=1, sampling=sampling)
    body = {
        **adapter,
        "task_type": "math",
        "rollout_name": "eval-math",
        "evaluation": True,
        "restart": True,
        "max_staleness": 1,
    }
    started = client.post("/start_rollout", json=body)
    assert started.status_code == 200, started.text


def test_a_generator_declares_its_fields_as_a_pydantic_model_checked_at_the_door(
    client: TestClient, generator_dir: Path, engine: Engine, rows: Path
) -> None:
    write_generator(generator_dir, "typed_generator.py", TYPED)
    base = {**slime_payload(engine, rows), "task_type": "typed"}
    missing = client.post("/start_rollout", json=base)
    assert (missing.status_code, refused(missing)) == (422, ["difficulty"])
    wrong = client.post("/start_rollout", json={**base, "difficulty": "hard"})
    assert (wrong.status_code, refused(wrong)) == (422, ["difficulty"])
    typo = client.post("/start_rollout", json={**base, "difficulty": 2, "topik": "x"})
    assert refused(typo) == ["topik"]
    assert "did you mean topic?" in typo.text
    assert "generator/typed_generator.py" in typo.text
    started = client.post("/start_rollout", json={**base, "difficulty": "2", "topic": "geometry"})
    assert started.status_code == 200, started.text


def test_the_toolkits_fields_are_typed_and_a_generator_may_take_any_field(
    client: TestClient, generator_dir: Path, engine: Engine, rows: Path
) -> None:
    wrong = client.post("/start_rollout", json={**slime_payload(engine, rows), "request_timeout_s": "soon"})
    assert (wrong.status_code, refused(wrong)) == (422, ["request_timeout_s"])
    source = PLAIN.format(task="open").replace("TASK_TYPE", 'START_ROLLOUT_FIELDS = "*"\nTASK_TYPE')
    write_generator(generator_dir, "open_generator.py", source)
    body = {**slime_payload(engine, rows), "task_type": "open", "anything": {"at": "all"}}
    started = client.post("/start_rollout", json=body)
    assert started.status_code == 200, started.text


# -- the input file -------------------------------------------------------------------------


def test_a_missing_input_file_is_refused_before_the_trainer_is_told_it_started(
    client: TestClient, engine: Engine, rows: Path
) -> None:
    payload = {**slime_payload(engine, rows), "input_file": str(rows.parent / "missing.jsonl")}
    response = client.post("/start_rollout", json=payload)
    assert (response.status_code, refused(response)) == (422, ["input_file"])
    assert "no such file" in response.text
    assert jobs(client) == []


# -- the engine -----------------------------------------------------------------------------


def test_an_engine_nobody_answers_at_is_refused_naming_remote_engine_url(
    client: TestClient, engine: Engine, rows: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    response = client.post("/start_rollout", json={**slime_payload(engine, rows), "remote_engine_url": dead})
    assert response.status_code == 503, response.text
    assert refused(response) == ["remote_engine_url"]
    assert dead in response.json()["message"]
    assert jobs(client) == []
    # A pool with one engine up starts: the pool routes around the other.
    pool = client.post(
        "/start_rollout", json={**slime_payload(engine, rows), "remote_engine_url": [dead, engine.url]}
    )
    assert pool.status_code == 200, pool.text


def test_a_running_job_says_since_when_its_engine_is_unreachable(
    client: TestClient, engine: Engine, rows: Path
) -> None:
    started = client.post("/start_rollout", json=slime_payload(engine, rows))
    assert started.status_code == 200, started.text
    job_id = started.json()["job_id"]

    def described() -> dict[str, Any]:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()["data"]
        return job

    wait_for(lambda: (described()["engine"] or {}).get("checked_at"), 30, "a probe of the engine")
    assert described()["warning"] is None
    engine.stop()
    warning = wait_for(lambda: described()["warning"], 30, "the job to say its engine is unreachable")
    assert warning.startswith("engine unreachable since ")
    job = described()
    assert job["status"] == "running"
    assert job["engine"]["reachable"] is False
    assert engine.url in job["engine"]["error"]


# -- a second start -------------------------------------------------------------------------


def test_a_second_start_is_idempotent_when_the_same_and_409_naming_what_differs(
    client: TestClient, engine: Engine, rows: Path
) -> None:
    payload = slime_payload(engine, rows)
    first = client.post("/start_rollout", json=payload).json()["job_id"]
    same = client.post("/start_rollout", json={**payload, "num_repeat_per_sample": 8})  # "8" parsed alike
    assert same.status_code == 200, same.text
    assert (same.json()["message"], same.json()["job_id"]) == ("Rollout already running", first)
    changed = client.post("/start_rollout", json={**payload, "num_epoch": "5", "num_process": "10"})
    assert changed.status_code == 409, changed.text
    assert changed.json()["differs"] == ["num_epoch", "num_process"]
    assert "num_epoch, num_process" in changed.json()["message"]
    assert [job["status"] for job in jobs(client)] == ["running"]
    # A trainer resumed from a checkpoint sends its finished groups: the running job goes on.
    resumed = client.post("/start_rollout", json={**payload, "skip_instance_ids": [1, 2]})
    assert resumed.status_code == 200, resumed.text
    assert (resumed.json()["job_id"], resumed.json()["ignored"]) == (first, ["skip_instance_ids"])
    replaced = client.post("/start_rollout", json={**payload, "num_epoch": "5", "restart": True})
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["job_id"] != first
    assert client.get(f"/jobs/{first}").json()["data"]["status"] == "cancelled"


# -- a copied generator ---------------------------------------------------------------------


def test_a_copy_of_a_generator_leaves_its_task_working_and_is_reported(
    client: TestClient, generator_dir: Path, engine: Engine, rows: Path
) -> None:
    write_generator(generator_dir, "geometry_generator.py", PLAIN.format(task="math"))
    started = client.post("/start_rollout", json=slime_payload(engine, rows))
    assert started.status_code == 200, started.text
    assert started.json()["job"]["generator_file"].endswith("math_generator.py")
    listed = client.get("/generators").json()["data"]
    assert [generator["task_type"] for generator in listed["generators"]] == ["math"]
    (error,) = listed["errors"]
    assert error["kind"] == "duplicate"
    assert error["file"].endswith("geometry_generator.py")
    assert "math_generator.py" in error["error"]
    assert client.get("/health").json()["generator_errors"] == 1
