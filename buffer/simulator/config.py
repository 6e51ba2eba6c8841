"""The simulator's settings: one class, read from flags and ``ROLLOUT_BUFFER_SIM_*`` variables
(the service's prefix, then ``SIM_``; the former ``SIM_LLM_*`` ones are still read, beneath)."""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from buffer.simulator.engines import Engine

LatencyDistribution = Literal["fixed", "uniform", "exponential", "lognormal"]
#: The service's prefix, then the simulator's: ``ROLLOUT_BUFFER_SIM_PORT``.
ENV_PREFIX = "ROLLOUT_BUFFER_SIM_"
FORMER_ENV_PREFIX = "SIM_LLM_"


class SimConfig(BaseSettings):
    """Run a simulated OpenAI-compatible LLM server (no model, no GPU) for demos, tests and benchmarks.
    Every option can also be set as an environment variable ROLLOUT_BUFFER_SIM_<OPTION>; flags win
    over variables.
    At run time, POST /outage {"seconds": 10, "mode": "503" or "reset"} makes every chat completion
    fail for that long (an HTTP 503, or a dropped connection); GET /stats counts what was asked."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The flags, then ``ROLLOUT_BUFFER_SIM_*``, then the former ``SIM_LLM_*`` variables."""
        former = EnvSettingsSource(settings_cls, env_prefix=FORMER_ENV_PREFIX)
        return init_settings, env_settings, former

    host: str = Field(default="127.0.0.1", description="interface to listen on")
    port: int = Field(default=30000, ge=1, le=65535, description="port to listen on (SGLang's default)")
    engine: Engine = Field(
        default="sglang",
        description="the engine imitated: where token ids and logprobs go, its errors (vllm: 404 for "
        "an unknown model)",
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"] | None = (
        Field(
            default=None,
            description="the engine's logprobs mode; null: its default. vLLM's --logprobs-mode "
            "(default raw_logprobs: before temperature and top-p/top-k; processed_logprobs: what it samples "
            "from); with --engine sglang, raw_logprobs is SGLANG_RETURN_ORIGINAL_LOGPROB=1 (before "
            "temperature), else SGLang's own (after temperature, before top-p/top-k/min-p)",
        )
    )
    dev_mode: bool = Field(
        default=False,
        description="vLLM's VLLM_SERVER_DEV_MODE=1: serve its development routes, /pause, /resume and "
        "/is_paused among them (with --engine vllm; 404 without, as vLLM)",
    )
    tokenizer_path: str | None = Field(
        default=None, description="a tokenizer directory (save_pretrained); default: the built-in one"
    )
    chat_template: Literal["chatml", "thinking"] = Field(
        default="chatml",
        description="the built-in tokenizer's template: ChatML (Qwen2.5-style) or thinking (Qwen3-style)",
    )
    weight_version: str = Field(default="default", description="the weight version SGLang reports")
    routed_experts: str | None = Field(
        default=None,
        pattern=r"^[1-9][0-9]*,[1-9][0-9]*$",
        description="LAYERS,TOPK: SGLang's --enable-return-routed-experts for an MoE model of LAYERS layers "
        "routing each token to TOPK experts; /generate then answers a request with return_routed_experts "
        "its meta_info.routed_experts, deterministic per token; null: not served",
    )
    served_model_name: str = Field(
        default="sim-model", description="the one model /v1/models lists and completions report"
    )
    latency: LatencyDistribution = Field(
        default="fixed", description="how the latency of a request is drawn around --latency-mean-s"
    )
    latency_mean_s: float = Field(
        default=0.05,
        ge=0,
        description="mean latency of a request, in seconds (an aborted reply and a continuation take "
        "their part of it, in tokens)",
    )
    latency_jitter_s: float = Field(
        default=0.0,
        ge=0,
        description="uniform: half-width of the range; lognormal: standard deviation; else unused",
    )
    latency_per_token_s: float = Field(
        default=0.0, ge=0, description="extra latency per completion token (of the longest choice)"
    )
    error_rate: float = Field(default=0.0, ge=0, le=1, description="probability of an HTTP 500 or 503 answer")
    rate_limit_rate: float = Field(
        default=0.0, ge=0, le=1, description="probability of an immediate HTTP 429 answer with Retry-After"
    )
    retry_after_s: float = Field(default=1.0, gt=0, description="the Retry-After of a 429 answer, in seconds")
    abort_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description='probability that a choice ends with finish_reason "abort" and partial text',
    )
    accuracy: float = Field(
        default=0.8, ge=0, le=1, description="probability that the answer to an arithmetic question is right"
    )
    tool_error_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="probability that a tool call's expression is mistyped (its result off by 1 to 3): "
        "rewards of tool tasks then vary, as training needs",
    )
    seed: int | None = Field(
        default=None, description="seed of the server's random generator; null: seeded from the OS"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="log level"
    )
    access_log: bool = Field(default=False, description="log every HTTP request")

    def sample_latency_s(self, rng: random.Random) -> float:
        """One draw from the configured latency distribution, never negative."""
        mean, jitter = self.latency_mean_s, self.latency_jitter_s
        if mean == 0:
            return 0.0
        if self.latency == "uniform":
            return max(0.0, rng.uniform(mean - jitter, mean + jitter))
        if self.latency == "exponential":
            return rng.expovariate(1 / mean)
        if self.latency == "lognormal":
            sigma_squared = math.log1p((jitter / mean) ** 2)
            return rng.lognormvariate(math.log(mean) - sigma_squared / 2, math.sqrt(sigma_squared))
        return mean
