"""The service's settings: one class, read from flags and ``ROLLOUT_BUFFER_*`` variables."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, SecretStr
from pydantic_settings import BaseSettings, CliImplicitFlag, SettingsConfigDict

from buffer import paths
from buffer.core.replay_pool import ReplaySettings
from buffer.core.task import TaskSettings
from buffer.logs import LogFormat

logger = logging.getLogger(__name__)

#: A century: longer is no retention policy, and past what a date can hold (``inf`` least of all).
MAX_RETENTION_HOURS = 100 * 365 * 24

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _logger_level(entry: str) -> str:
    """``NAME=LEVEL`` (the level in any case), as ``name=level``."""
    name, equals, level = entry.strip().partition("=")
    if not equals or not name.strip() or level.strip().lower() not in LOG_LEVELS:
        raise ValueError(f"{entry!r} is not NAME=LEVEL, LEVEL one of {', '.join(LOG_LEVELS)}")
    return f"{name.strip()}={level.strip().lower()}"


LoggerLevel = Annotated[str, AfterValidator(_logger_level)]

#: ``generator/`` beside ``buffer.py``: the checkout's, or the installed copy's.
DEFAULT_GENERATOR_DIR = paths.GENERATOR_DIR


class Settings(BaseSettings):
    """Run the rollout buffer. Every option can also be set as an environment variable
    ROLLOUT_BUFFER_<OPTION>, e.g. ROLLOUT_BUFFER_PORT=8890; flags win over variables."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLOUT_BUFFER_",
        cli_kebab_case=True,
        cli_prog_name="python buffer.py",
        cli_implicit_flags=False,
        extra="ignore",
    )

    host: str = Field(
        "0.0.0.0", description="interface to listen on; 0.0.0.0 as slime, 127.0.0.1 for local only"
    )
    port: int = Field(8889, ge=1, le=65535, description="port to listen on")
    generator_dir: Path = Field(
        DEFAULT_GENERATOR_DIR, description="folder scanned for *_generator.py task plug-ins"
    )
    group_size: int = Field(
        16, ge=1, description="group size for trajectories written before any /start_rollout names one"
    )
    group_timeout_seconds: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="a group with no write for this long finishes (default for every task)",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="log level"
    )
    log_format: LogFormat = Field(
        "text", description="text: one readable line per event; json: one JSON object a line"
    )
    log_level_for: list[LoggerLevel] = Field(
        default_factory=list,
        description="a logger's own level, e.g. openai=info or buffer.service.jobs=debug: by default "
        "the service's loggers (buffer, generator, uvicorn) log at --log-level and every library's "
        "only its warnings and errors",
        json_schema_extra={"metavar": "NAME=LEVEL"},
    )
    access_log: CliImplicitFlag[bool] = Field(False, description="log every HTTP request (costs throughput)")
    dedup_window: int = Field(
        1_000_000, ge=0, description="uids of delivered trajectories remembered to drop retried writes"
    )
    sweep_interval_s: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="how often timed-out groups are looked for"
    )
    data_dir: Path | None = Field(
        None, description="keep the buffer on disk in this folder and restore it from there at start-up"
    )
    durability: Literal["sync", "flush"] = Field(
        "sync",
        description="with --data-dir, when a write is acknowledged: sync: once on disk (fdatasync; "
        "survives power loss); flush: once handed to the OS (survives a crash of the service)",
    )
    resume_jobs: CliImplicitFlag[bool] = Field(
        True,
        description="with --data-dir, start again the generator jobs that were running when the "
        "service stopped (--no-resume-jobs forgets them)",
    )
    export_retention_hours: float = Field(
        168.0,
        ge=0,
        le=MAX_RETENTION_HOURS,
        allow_inf_nan=False,
        description="with --data-dir, how long delivered trajectories are kept for export",
    )
    journal_compact_bytes: int = Field(
        256 * 2**20,
        ge=2**20,
        description="with --data-dir, compact the journal once it has grown this much at the latest (sooner "
        "at a sixteenth of the snapshot, at least 16 MiB: a compaction writes what changed since the last)",
    )
    max_buffered_trajectories: int = Field(
        1_000_000,
        ge=0,
        description="a write that would take the trajectories buffered past this many by opening groups "
        "gets 429, a whole batch at once (writes that fill open groups are always taken, so groups can "
        "finish); a batch that alone opens more gets 413; 0: no limit",
    )
    max_tasks: int = Field(
        1000,
        ge=0,
        description="a write or /start_rollout that would create a task past this many gets 422 "
        "(each task is kept for good: counters, history, metrics); 0: no limit",
    )
    one_group_per_instance: CliImplicitFlag[bool] = Field(
        True,
        description="a read returns at most one group of each instance_id, the later ones wait for the "
        "next read (slime's trainer merges one read's groups by instance_id and fails on two); "
        "--no-one-group-per-instance returns every ready group in order",
    )
    replay_capacity: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="keep up to this many good groups (filtered, rewards not all equal) after their read, "
        "for a /get_rollout_data replay_ratio to serve again beside fresh ones; 0: the replay pool is off",
    )
    replay_max_uses: int = Field(
        2, ge=1, description="with --replay-capacity, a group leaves the pool once replayed this many times"
    )
    replay_max_lag: int = Field(
        4,
        ge=0,
        description="with --replay-capacity, a group more than this many policy versions behind the "
        "trainer's is never replayed and leaves the pool",
    )
    allowed_origins: list[str] = Field(
        [],
        description="web origins (https://host:port, or * for any) whose pages may POST to the service; "
        "by default a browser request from another origin gets 403",
        json_schema_extra={"metavar": "ORIGIN"},
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="host names (the Host header) the service answers to, or * for any; others get "
        "421, which stops DNS rebinding; loopback names are always allowed. Default: with an API key, "
        "any; listening on 0.0.0.0 or ::, any for clients, and for browsers this machine's name, "
        "names without a dot and IP addresses; else --host",
        json_schema_extra={"metavar": "HOST"},
    )
    max_header_bytes: int = Field(
        64 * 2**10, ge=1024, description="a request whose line and headers are larger than this gets 431"
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="a connection that has not sent a whole request line and headers this long after it "
        "opened (or its previous request ended) is closed",
    )
    max_connections: int = Field(
        0,
        ge=0,
        description="past this many open connections, a new one closes the one that has waited longest "
        "for its headers (or is itself refused); 0: half the file descriptors the process may open",
    )
    max_request_bytes: int = Field(
        64 * 2**20, ge=1024, description="a request body larger than this gets 413"
    )
    input_roots: list[Path] | None = Field(
        None,
        description="folders a /start_rollout input_file may lie in (default: the generator folder's "
        "data and the working folder, unless that is /, a home or a system folder); anything else, "
        "or a device file, gets 422",
        json_schema_extra={"metavar": "DIR"},
    )
    check_engines: CliImplicitFlag[bool] = Field(
        True,
        description="ask a job's remote_engine_url (GET /health) before /start_rollout answers, refusing "
        "a start none of whose engines can be reached (503), and every 2 s while it runs (the job says "
        "since when its engine is unreachable); not for jobs on Ray, whose engines may be reachable "
        "only from the cluster",
    )
    allowed_engine_hosts: list[str] | None = Field(
        None,
        description="hosts a generator job may call for a client (remote_engine_url, reward model and "
        "other *_url fields; this service is always allowed); default: any host",
        json_schema_extra={"metavar": "HOST"},
    )
    gateway_url: list[str] = Field(
        default_factory=list,
        description="a gateway process (rollout-buffer gateway) POST /sessions hands new sessions to, "
        "in turn; repeat for each (default: the sessions are served by this service)",
        json_schema_extra={"metavar": "URL"},
    )
    send_api_key_to: list[str] = Field(
        default_factory=list,
        description="hosts a job's remote_buffer_url may name to be sent this service's own API key; "
        "default: none (a client naming another buffer sends its key as buffer_api_key)",
        json_schema_extra={"metavar": "HOST"},
    )
    job_isolation: Literal["process", "inline"] = Field(
        "process",
        description="process: each job's generator runs in worker processes of its own, which "
        "cannot stop or slow the service; inline: in the service's process (debugging)",
    )
    worker_grace_s: float = Field(
        5.0, ge=0, description="a cancelled job's workers get SIGTERM, then SIGKILL after this long"
    )
    ray_address: str | None = Field(
        None,
        description="run each job's workers as Ray actors on this cluster (e.g. ray://head:10001, auto, "
        "or local for a Ray instance of the service's own); needs the ray extra",
        json_schema_extra={"metavar": "ADDRESS"},
    )
    worker_env_api_key: CliImplicitFlag[bool] = Field(
        False,
        description="put the API key in the environment of jobs' workers too, for generators whose "
        "own subprocesses write to the buffer (by default a worker gets it privately, on stdin)",
    )
    hook_timeout_s: float = Field(
        2.0, gt=0, description="a generator's hook (is_valid_group, ...) that runs longer fails its group"
    )
    generator_import_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a generator file whose import (tried first in a process of its own) takes longer "
        "is reported, not loaded",
    )
    strict_tasks: CliImplicitFlag[bool] = Field(
        False,
        description="refuse (422) writes to a task no /start_rollout or PUT /tasks/{name} configured, "
        "instead of grouping them by --group-size",
    )
    api_key: SecretStr | None = Field(
        None,
        description="require 'Authorization: Bearer <key>' on every endpoint but GET / and /health; "
        "better set as ROLLOUT_BUFFER_API_KEY than on the command line",
        json_schema_extra={"metavar": "KEY"},
    )

    def log_levels(self) -> dict[str, str]:
        """``--log-level-for``, as logger name to level (a later entry for a name wins)."""
        return dict(entry.split("=", 1) for entry in self.log_level_for)

    def default_task_settings(self) -> TaskSettings:
        return TaskSettings(group_size=self.group_size, group_timeout_s=self.group_timeout_seconds)

    def replay_settings(self) -> ReplaySettings:
        return ReplaySettings(self.replay_capacity, self.replay_max_uses, self.replay_max_lag)

    def input_folders(self) -> list[Path]:
        """``input_roots``, or by default the generator folder's ``data`` and the working folder,
        the latter left out (with a warning) when it is too broad a folder to read from."""
        if self.input_roots is not None:
            return list(self.input_roots)  # the operator's choice, even /
        roots = [self.generator_dir / "data"]
        cwd = Path.cwd().resolve()
        if paths.too_broad(cwd):
            logger.warning(
                "the working folder %s is not an input root (it is /, a home or a system folder): "
                "/start_rollout input files must lie in %s; name the folders they may lie in with "
                "--input-roots",
                cwd,
                roots[0],
            )
        else:
            roots.append(cwd)
        return roots
