"""What the service tells a worker process: everything it needs, as JSON on its stdin."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from buffer.service.job_policy import JobPolicy


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    job_id: str
    task_type: str
    generator_file: str
    data: dict[str, Any]
    #: Where the worker writes: the service's own address, or another buffer's.
    buffer_url: str
    #: Which of the job's ``count`` workers this is: the toolkit runs only its share of the plan.
    index: int = 0
    count: int = 1
    #: Where it leaves its outcome (a JSON object) before it exits.
    result_file: str = ""
    #: Where it keeps ``current_job().progress`` (the toolkit's counts) for the service to show.
    progress_file: str = ""
    log_level: str = "info"
    input_roots: tuple[str, ...] = ()
    engine_hosts: tuple[str, ...] | None = None
    api_key_hosts: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WorkerSpec:
        raw = dict(raw)
        raw["input_roots"] = tuple(raw.get("input_roots", ()))
        hosts = raw.get("engine_hosts")
        raw["engine_hosts"] = None if hosts is None else tuple(hosts)
        raw["api_key_hosts"] = tuple(raw.get("api_key_hosts", ()))
        return cls(**raw)

    def policy(self) -> JobPolicy:
        return JobPolicy(
            tuple(Path(root) for root in self.input_roots),
            None if self.engine_hosts is None else frozenset(self.engine_hosts),
            frozenset(self.api_key_hosts),
        )

    @staticmethod
    def policy_fields(policy: JobPolicy) -> dict[str, Any]:
        return {
            "input_roots": tuple(str(root) for root in policy.input_roots),
            "engine_hosts": None if policy.engine_hosts is None else tuple(sorted(policy.engine_hosts)),
            "api_key_hosts": tuple(sorted(policy.api_key_hosts)),
        }
