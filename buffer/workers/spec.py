"""What the service tells a worker process: everything it needs, as JSON on its stdin.

Plain data only, so that the worker imports nothing of the service: the hosts the service's
own API key may be sent to travel as a list of names (``api_key_hosts``), and the worker builds
the generator's ``buffer.current.JobContext`` from them. The service's key itself travels here
(``api_key``, never in the worker's environment, where every process the generator starts
would inherit it) and is left out of the spec's ``repr``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    log_level: str = "info"
    #: Loggers at levels of their own (``--log-level-for``): name to level.
    log_levels: dict[str, str] = field(default_factory=dict)
    #: Hosts a ``remote_buffer_url`` may name to be sent the service's own API key
    #: (``JobPolicy.api_key_hosts``, ``--send-api-key-to``).
    api_key_hosts: tuple[str, ...] = ()
    #: The service's own key, for writes back to ``buffer_url`` (and the ``api_key_hosts``).
    api_key: str | None = field(default=None, repr=False)
    #: The worker's end of its admission socket (``buffer.policy.channel``), a descriptor it
    #: inherits; None: it asks for admission over HTTP.
    policy_fd: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WorkerSpec:
        raw = dict(raw)
        raw["api_key_hosts"] = tuple(raw.get("api_key_hosts", ()))
        return cls(**raw)
