"""The OpenAPI schema, fuzzed with schemathesis: no request, valid or not, gets a 5xx.

Each operation runs against an app of its own, lifespan included (schemathesis starts it on the
first request and ends it when the test ends), with a generator to start, a job to look up and
groups ready to read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    positive_data_acceptance,
    status_code_conformance,
)

from buffer.service.app import create_app
from buffer.service.settings import Settings
from tests.support.factories import group, write_generator

schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())

# call_and_validate runs every default check; these fail on behaviour that is meant:
EXCLUDED_CHECKS = [
    # Statuses buffer/errors.py documents and the OpenAPI schema does not list: 404 (unknown task or
    # job), 409 (generator failed to load, export without --data-dir), 400 (a body that is not UTF-8:
    # FastAPI's own answer), 413, 429.
    status_code_conformance,
    # Rules JSON Schema cannot state: a message's content may be null only on an assistant message
    # with tool_calls; batch_size may be -1 or at least 1, not 0. Both are 422s naming the field.
    positive_data_acceptance,
    # Lax on purpose, as slime's trainer sends them: numbers as strings ("8"), 0 and 1 as booleans,
    # extra keys kept. (The hook below also turns some invalid /start_rollout bodies valid.)
    negative_data_rejection,
]

FUZZ_GENERATOR = 'TASK_TYPE = "fuzz"\n\ndef run_rollout(data):\n    pass\n'
SEEDED_JOB = "job-1"
#: Long polls (/get_rollout_data's wait_s, /buffer/read's timeout) wait at most this long.
MAX_WAIT_S = 0.05


@schema.hook("flatmap_body")
def _sometimes_the_real_task(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """Half the /start_rollout bodies name the generator that exists: the others get a 404."""
    if (
        context.operation is not None
        and context.operation.path == "/start_rollout"
        and isinstance(body, dict)
    ):
        return st.sampled_from([body, {**body, "task_type": "fuzz"}])
    return st.just(body)


@schema.hook("flatmap_path_parameters")
def _sometimes_the_real_job(
    context: schemathesis.HookContext, path_parameters: dict[str, Any] | None
) -> st.SearchStrategy[dict[str, Any] | None]:
    """Half the /jobs/{job_id} requests name the job the fixture started: the others get a 404."""
    if path_parameters is not None and "job_id" in path_parameters:
        return st.sampled_from([path_parameters, {**path_parameters, "job_id": SEEDED_JOB}])
    return st.just(path_parameters)


@pytest.fixture
def app(generator_dir: Path) -> FastAPI:
    write_generator(generator_dir, "fuzz_generator.py", FUZZ_GENERATOR)
    # schemathesis's client names the host testserver: a service on 127.0.0.1 answers to it only so.
    hosts = ["testserver"]
    app = create_app(
        Settings(generator_dir=generator_dir, host="127.0.0.1", port=8889, group_size=2, allowed_hosts=hosts)
    )
    call = _caller(app)
    assert call("POST", "/start_rollout", {"task_type": "fuzz"}).json()["job_id"] == SEEDED_JOB
    for instance_id in range(5):
        assert call("POST", "/buffer/write_batch", group(instance_id, [0.0, 1.0])).json()["data"]["written"]
    return app


def _caller(app: FastAPI) -> Callable[[str, str, Any], schemathesis.Response]:
    """Requests through schemathesis's own ASGI client, so the app's lifespan is the one it runs."""

    def call(method: str, path: str, body: Any) -> schemathesis.Response:
        response = schema[path][method].Case(body=body, media_type="application/json").call(app=app)
        assert response.status_code == 200, response.text
        return response

    return call


def _bounded_wait(value: Any) -> Any:
    """A wait the app would accept (a number, a numeric string, a boolean), cut to MAX_WAIT_S."""
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return value
    return min(seconds, MAX_WAIT_S) if 0 < seconds <= 300 else value


FUZZ = settings(
    max_examples=int(os.environ.get("ROLLOUT_BUFFER_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # on purpose: one app per operation, across its examples
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


@schema.exclude(path="/buffer/write_batch").parametrize()
@FUZZ
def test_no_request_gets_a_server_error(case: schemathesis.Case, app: FastAPI) -> None:
    _call_and_validate(case, app)


# Lists of trajectories are slow to generate (up to 2 s each), and each is the /buffer/write
# trajectory already fuzzed above: fewer examples keep the whole file near 30 s on 2 cores.
@schema.include(path="/buffer/write_batch").parametrize()
@settings(FUZZ, max_examples=8)
def test_no_batch_write_gets_a_server_error(case: schemathesis.Case, app: FastAPI) -> None:
    _call_and_validate(case, app)


def _call_and_validate(case: schemathesis.Case, app: FastAPI) -> None:
    if isinstance(case.body, dict):
        for key in ("wait_s", "timeout"):
            if key in case.body:
                case.body[key] = _bounded_wait(case.body[key])
    if case.operation.path == "/policy/watch":  # a long poll of 30 s unless told
        query = case.query if isinstance(case.query, dict) else {}
        query["wait_s"] = _bounded_wait(query.get("wait_s", MAX_WAIT_S))
        case.query = query
    case.call_and_validate(app=app, excluded_checks=EXCLUDED_CHECKS)


# -- what the fuzzing found -------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"instance_id": 2**64}, "instance_id"),
        ({"extra_info": {"seed": 10**30}}, "extra_info.seed"),
        ({"messages": [{"role": "user", "content": "q", "n": 2**70}]}, "messages.0.n"),
        ({"score": [1, -(2**63) - 1]}, "score.1"),  # an unknown key, kept as written
    ],
)
def test_an_integer_beyond_64_bits_is_a_422_naming_it(
    client: TestClient, change: dict[str, Any], field: str
) -> None:
    """It passed validation, then failed to encode in the buffer: a 500."""
    item = {**group("q", [1.0])[0], **change}
    for path, body, prefix in (("/buffer/write", item, ""), ("/buffer/write_batch", [item], "0.")):
        response = client.post(path, json=body)
        assert response.status_code == 422, response.text
        (error,) = response.json()["errors"]
        assert error["field"] == prefix + field
        assert "9223372036854775807" in error["reason"]
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 0


def test_integers_within_64_bits_are_stored_as_written(client: TestClient) -> None:
    item = {**group("q", [1.0])[0], "instance_id": 2**63 - 1, "extra_info": {"low": -(2**63)}}
    assert client.post("/buffer/write", json=item).status_code == 200
    (seen,) = client.get("/buffer/tail").json()["data"]["items"]
    assert seen["instance_id"] == 2**63 - 1


def test_a_group_size_beyond_64_bits_is_refused(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    """It was accepted, and from then on every /buffer/stats and /dashboard/data was a 500."""
    write_generator(generator_dir, "fuzz_generator.py", FUZZ_GENERATOR)
    client = make_client()
    response = client.post("/start_rollout", json={"task_type": "fuzz", "num_repeat_per_sample": 2**64})
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "num_repeat_per_sample"
    assert client.get("/buffer/stats").status_code == 200
    assert client.get("/dashboard/data").status_code == 200
