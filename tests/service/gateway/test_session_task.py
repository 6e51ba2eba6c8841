"""Which task ``gateway_session`` opens its session on: inside a job started with a
``rollout_name``, the job's task, also when the generator names its own TASK_TYPE."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from buffer.current import JobContext, running
from buffer.toolkit import gateway_session

BUFFER = "http://buffer.test"
pytestmark = pytest.mark.anyio


def job(task_type: str, generator_task_type: str) -> JobContext:
    data = {"task_type": task_type, "generator_task_type": generator_task_type}
    return JobContext("job-1", task_type, "generator/agent_generator.py", data, buffer_url=BUFFER)


def mock_sessions() -> respx.Route:
    opened = {"session_id": "s1", "base_url": f"{BUFFER}/sessions/s1/v1", "api_key": "k"}
    route = respx.post(f"{BUFFER}/sessions").mock(
        return_value=httpx.Response(200, json={"success": True, "data": opened})
    )
    respx.post(f"{BUFFER}/sessions/s1/end").mock(
        return_value=httpx.Response(200, json={"success": True, "data": {"written": True}})
    )
    return route


async def opened_on(task_type: str | None, context: JobContext | None) -> str:
    with respx.mock:
        route = mock_sessions()
        if context is None:
            async with gateway_session(BUFFER, task_type, "q1") as session:
                session.reward = 1.0
        else:
            with running(context):
                async with gateway_session(None, task_type, "q1") as session:
                    session.reward = 1.0
        task: str = json.loads(route.calls.last.request.content)["task_type"]
    return task


@pytest.mark.parametrize("named", ["agent", None])
async def test_inside_a_job_with_a_rollout_name_the_session_writes_to_it(named: str | None) -> None:
    assert await opened_on(named, job("agent-eval", "agent")) == "agent-eval"


async def test_another_task_named_inside_a_job_is_taken_as_given() -> None:
    assert await opened_on("judge", job("agent-eval", "agent")) == "judge"


async def test_outside_a_job_the_task_is_the_one_named() -> None:
    assert await opened_on("agent", None) == "agent"
    with pytest.raises(ValueError, match="task_type is required"):
        await opened_on(None, None)
