"""Run any agent against a fresh gateway session, then score it: RL for agents as they are.

    async with gateway_session(buffer_url, "my_task", instance_id) as session:
        answer = await my_agent(base_url=session.base_url, api_key=session.api_key)
        session.reward = score(answer)

The agent is whatever speaks the OpenAI API (the ``openai`` SDK, LangGraph, a CLI with
``OPENAI_BASE_URL``); the service records its calls with their token ids. Leaving the block
ends the session: with a reward, its trajectory is written to its group; without one, or when
the block raised, the session is discarded (and the error goes on). Inside a job of the service
the buffer's URL is the service's own (``buffer_url=None``).

The task is the job's: a job started with a ``rollout_name`` writes to that task, so inside it
``task_type=None``, or the generator's own ``TASK_TYPE``, opens the session on the job's task (the
task ``/start_rollout`` configured, its group size and timeouts); any other name is taken as given.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from buffer.current import JobContext, current_job
from buffer.keys import key_or_env

logger = logging.getLogger(__name__)


class GatewayError(RuntimeError):
    """The service refused to open or end a session."""


@dataclass(slots=True)
class GatewaySession:
    session_id: str
    base_url: str  # the agent's OpenAI base URL
    api_key: str  # the agent's OpenAI API key
    #: Set it before the block ends: a number, or named rewards. None: the session is discarded.
    reward: float | dict[str, float] | None = None
    #: What the end answered (``uid``, ``written``, ``duplicate``).
    result: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def gateway_session(
    buffer_url: str | None,
    task_type: str | None,
    instance_id: str | int,
    *,
    remote_engine_url: str | list[str] | None = None,
    metadata: dict[str, Any] | None = None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
) -> AsyncIterator[GatewaySession]:
    """A session of the rollout buffer at ``buffer_url`` (None: this job's service), ended on exit,
    for the task ``task_type`` (None: this job's task; see the module's docstring)."""
    job = current_job()
    if buffer_url is None:
        if job is None or job.buffer_url is None:
            raise ValueError("buffer_url is required outside a job of the rollout buffer service")
        buffer_url = job.buffer_url
    task_type = _session_task(task_type, job)
    headers = {}
    if key := key_or_env(api_key, buffer_url):
        headers["authorization"] = f"Bearer {key}"
    body: dict[str, Any] = {"task_type": task_type, "instance_id": instance_id, "metadata": metadata or {}}
    if remote_engine_url is not None:
        body["remote_engine_url"] = remote_engine_url
    async with httpx.AsyncClient(
        base_url=buffer_url.rstrip("/"), headers=headers, timeout=timeout_s
    ) as client:
        opened = await _post(client, "/sessions", body)
        session = GatewaySession(opened["session_id"], opened["base_url"], opened["api_key"])
        path = f"/sessions/{session.session_id}/end"
        try:
            yield session
        except BaseException:
            with contextlib.suppress(httpx.HTTPError, GatewayError):
                await _post(client, path, {"discard": True})
            raise
        if session.reward is None:
            logger.warning("session %s ended without a reward: discarded", session.session_id)
            session.result = await _post(client, path, {"discard": True})
        else:
            session.result = await _post(client, path, {"reward": session.reward})


def _session_task(task_type: str | None, job: JobContext | None) -> str:
    """The task a session writes to: the job's when ``task_type`` is None or its generator's own
    ``TASK_TYPE`` (the job may run under a ``rollout_name``), else ``task_type`` as given."""
    if job is None:
        if task_type is None:
            raise ValueError("task_type is required outside a job of the rollout buffer service")
        return task_type
    if task_type is None or task_type == job.data.get("generator_task_type"):
        return job.task_type
    return task_type


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    if response.is_error or not answer.get("success", False):
        raise GatewayError(
            f"POST {path}: HTTP {response.status_code}: {answer.get('message', response.text[:300])}"
        )
    data: dict[str, Any] = answer.get("data") or {}
    return data
