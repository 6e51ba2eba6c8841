"""Whether a job's policy servers can be reached: before it starts, and while it runs.

A generator retries a refused connection for minutes (``max_retry_s``), so a dead
``remote_engine_url`` would otherwise show as a job ``running`` with nothing written.
``unreachable`` asks each engine before ``/start_rollout`` answers (the start is refused when
none answers); ``EngineWatch`` asks again every ``WATCH_INTERVAL_S`` while the job runs, and
the job says "engine unreachable since ..." from the first failed probe on, for every generator
(slime's, which talk to the engine with the OpenAI SDK, included).

A probe is a GET of the engine's ``/v1/models``, which SGLang, vLLM and routers answer from
memory (SGLang's ``/health`` runs a one-token generation: every 2 s per job, that would take
engine time from the rollouts). Any HTTP answer, even an error or one slower than the probe,
means the engine is there; only a connection that cannot be made, or is not made within
``PROBE_TIMEOUT_S``, is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

#: How long a probe waits for the engine's connection (and, once connected, its answer).
PROBE_TIMEOUT_S = 3.0
#: How often a running job's engines are probed.
WATCH_INTERVAL_S = 2.0


def engine_urls(value: Any) -> list[str]:
    """The URLs of a ``remote_engine_url`` (one, or a list: a pool)."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list):
        return [url for url in value if isinstance(url, str) and url]
    return []


def probe_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1") + "/v1/models"


async def unreachable(urls: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str]:
    """Each of ``urls`` that cannot be reached, with why."""
    timeout = httpx.Timeout(timeout_s)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        errors = await asyncio.gather(*(_probe(client, url) for url in urls))
    return {url: error for url, error in zip(urls, errors, strict=True) if error is not None}


async def _probe(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        await client.get(probe_url(url))
    except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError):
        return None  # connected: something is there
    except httpx.ConnectTimeout:
        return f"no connection within {client.timeout.connect:g} s"
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        return str(exc) or type(exc).__name__
    return None


@dataclass(slots=True)
class EngineStatus:
    """What the last probes of a job's engines found."""

    urls: list[str]
    #: Since when (wall clock) no engine has answered; None while one does.
    unreachable_since: float | None = None
    error: str | None = None
    checked_at: float | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "urls": self.urls,
            "reachable": self.unreachable_since is None,
            "unreachable_since": self.unreachable_since,
            "error": self.error,
            "checked_at": self.checked_at,
        }

    def warning(self) -> str | None:
        if self.unreachable_since is None:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.unreachable_since))
        return f"engine unreachable since {since} ({self.error})"


def watch_engines(
    name: str, remote_engine_url: Any, done: Callable[[], bool], tasks: set[asyncio.Task[None]]
) -> EngineStatus | None:
    """Probe the engines of ``remote_engine_url`` until ``done()``, in a task added to ``tasks``
    (and taken out when it ends); what it finds, or None when there is no engine to probe."""
    urls = engine_urls(remote_engine_url)
    if not urls:
        return None
    watch = EngineWatch(urls, done)
    task = asyncio.get_running_loop().create_task(watch.run(name), name=f"{name}/engine")
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return watch.status


class EngineWatch:
    """Probes a job's engines every ``interval_s`` until ``done()``; ``status`` says what it found."""

    def __init__(
        self, urls: list[str], done: Callable[[], bool], *, interval_s: float = WATCH_INTERVAL_S
    ) -> None:
        self.status = EngineStatus(urls)
        self._done = done
        self._interval_s = interval_s

    async def run(self, name: str) -> None:
        while not self._done():
            errors = await unreachable(self.status.urls)
            self._record(name, errors)
            await asyncio.sleep(self._interval_s)

    def _record(self, name: str, errors: dict[str, str]) -> None:
        status = self.status
        status.checked_at = time.time()
        if len(errors) < len(status.urls):  # one engine answers: the job can go on
            if status.unreachable_since is not None:
                logger.info("%s: its engine answers again", name)
            status.unreachable_since, status.error = None, None
            return
        status.error = "; ".join(f"{url}: {error}" for url, error in errors.items())
        if status.unreachable_since is None:
            status.unreachable_since = status.checked_at
            logger.warning("%s: engine unreachable: %s", name, status.error)
