"""The service's settings: one class, read from flags and ``ROLLOUT_BUFFER_*`` variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, CliImplicitFlag, SettingsConfigDict

from buffer.logs import LogFormat
from buffer.task import TaskSettings

#: ``generator/`` beside ``buffer.py``: the checkout's, or the installed copy's.
DEFAULT_GENERATOR_DIR = Path(__file__).resolve().parent.parent / "generator"


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
        300.0, gt=0, description="a group with no write for this long finishes (default for every task)"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="log level"
    )
    log_format: LogFormat = Field(
        "text", description="text: one readable line per event; json: one JSON object a line"
    )
    access_log: CliImplicitFlag[bool] = Field(False, description="log every HTTP request (costs throughput)")
    dedup_window: int = Field(
        1_000_000, ge=0, description="uids of delivered trajectories remembered to drop retried writes"
    )
    sweep_interval_s: float = Field(1.0, gt=0, description="how often timed-out groups are looked for")

    def default_task_settings(self) -> TaskSettings:
        return TaskSettings(group_size=self.group_size, group_timeout_s=self.group_timeout_seconds)
