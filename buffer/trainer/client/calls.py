"""The requests both clients make: each one's method, path and body, and how its answer is read.

A ``Call`` is pure data; the clients send it and hand the decoded JSON to ``call.parse``,
which turns it into a typed answer (``buffer.trainer.client.models``) or raises ``ValueError`` and
its kin when the answer is not what the call expects. Older servers (slime's own buffer)
answer in slightly different shapes; the parsers accept both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from buffer.trainer.client.models import BufferStats, JobInfo, RolloutBatch, StartedRollout

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Call(Generic[_T]):
    """One request and how to read its answer's decoded JSON."""

    method: str
    path: str
    parse: Callable[[Any], _T]
    body: dict[str, Any] | None = None
    wait_s: float = 0.0  # the server may hold the request this long: added to the timeout


def _data(answer: Any) -> Any:
    return answer.get("data") if isinstance(answer, dict) else None


def _parse_started(task_type: str) -> Callable[[Any], StartedRollout]:
    def parse(answer: Any) -> StartedRollout:
        fields = answer if isinstance(answer, dict) else {}
        return StartedRollout.model_validate({"task_type": task_type, **fields})

    return parse


def _parse_batch(answer: Any) -> RolloutBatch:
    data = _data(answer)
    if isinstance(data, dict):
        items, meta_info = data.get("data") or [], data.get("meta_info") or {}
    else:  # an older server: the items alone, or nothing
        items, meta_info = data or [], {}
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"items are not a list of trajectories: {str(items)[:200]}")
    message = answer.get("message", "") if isinstance(answer, dict) else ""
    # The items came from the server's own JSON: no need to copy them through validation.
    return RolloutBatch.model_construct(items=items, meta_info=dict(meta_info), message=str(message))


def _parse_stats(answer: Any) -> BufferStats:
    data = _data(answer) or {}
    counters = data.get("data") if isinstance(data, dict) else None
    if isinstance(counters, list):  # this service: {"data": [counters], "meta_info": {...}}
        meta = data.get("meta_info") or {}
        return BufferStats.model_validate({**(counters[0] if counters else {}), **meta})
    return BufferStats.model_validate(data)


def _parse_jobs(answer: Any) -> list[JobInfo]:
    data = _data(answer) or {}
    return [JobInfo.model_validate(job) for job in data.get("jobs", [])]


def _parse_job(answer: Any) -> JobInfo:
    return JobInfo.model_validate(_data(answer))


def _parse_dict(answer: Any) -> dict[str, Any]:
    return dict(answer) if isinstance(answer, dict) else {"answer": answer}


def start_rollout(task_type: str, restart: bool, payload: dict[str, Any]) -> Call[StartedRollout]:
    body = {**payload, "task_type": task_type}
    if restart:
        body["restart"] = True
    return Call("POST", "/start_rollout", _parse_started(task_type), body)


def get_rollout_data(
    batch_size: int | None, task_type: str | None, wait_s: float, replay_ratio: float = 0.0
) -> Call[RolloutBatch]:
    body: dict[str, Any] = {}
    if batch_size is not None:
        body["batch_size"] = batch_size
    if task_type is not None:
        body["task_type"] = task_type
    if wait_s > 0:
        body["wait_s"] = round(wait_s, 3)
    if replay_ratio:
        body["replay_ratio"] = replay_ratio
    return Call("POST", "/get_rollout_data", _parse_batch, body, wait_s)


def _job_path(job_id: str) -> str:
    return f"/jobs/{quote(job_id, safe='')}"


def job(job_id: str) -> Call[JobInfo]:
    return Call("GET", _job_path(job_id), _parse_job)


def cancel_job(job_id: str) -> Call[JobInfo]:
    return Call("POST", _job_path(job_id) + "/cancel", _parse_job)


STATS = Call("GET", "/buffer/stats", _parse_stats)
JOBS = Call("GET", "/jobs", _parse_jobs)
HEALTH = Call("GET", "/health", _parse_dict)
POLICY = Call("GET", "/policy", _parse_dict)


def set_policy_version(version: int) -> Call[dict[str, Any]]:
    return Call("POST", "/policy", _parse_dict, {"version": version})


def pause_generation(mode: str, engine_urls: list[str] | None, timeout_s: float) -> Call[dict[str, Any]]:
    body: dict[str, Any] = {"mode": mode, "timeout_s": timeout_s}
    if engine_urls is not None:
        body["engine_urls"] = engine_urls
    return Call("POST", "/policy/pause", _parse_dict, body, timeout_s)


def resume_generation(version: int | None) -> Call[dict[str, Any]]:
    return Call("POST", "/policy/resume", _parse_dict, {} if version is None else {"version": version})
