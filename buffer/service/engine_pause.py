"""Pausing and resuming the engines themselves around a weight update, in each engine's words.

``POST /policy/pause {"mode": "abort"}`` closes the buffer's gate and asks the engines to abort
what is in flight; ``POST /policy/resume`` lets them go on. The two engines spell it apart (one
entry each in ``ROUTES``):

- SGLang: ``POST /pause_generation {"mode": "abort"}`` and ``POST /continue_generation``;
- vLLM 0.32: ``POST /pause?mode=abort`` and ``POST /resume``, served only when vLLM runs with
  ``VLLM_SERVER_DEV_MODE=1`` (``vllm/entrypoints/rl/online/api_router.py``, registered by
  ``launchers/api_server/routers.py``); the other's routes are a 404.

An engine named ``auto`` is asked in SGLang's words, then in vLLM's when those are not found,
and its kind is remembered per URL (``Policy.engine_kinds``). Every engine's answer is kept
(``EngineAnswer``): an engine that refused or could not be reached is never reported paused.
At most ``MAX_CONCURRENT`` engines are asked at once, each given ``ENGINE_TIMEOUT_S`` in all:
a slow or silent engine costs its own answer, never the service's other requests (its host
names are resolved in the threads every request shares).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from buffer.toolkit.llm import engine_root_url

Action = Literal["pause", "resume"]
#: Statuses that say "no such route here": the engine is of the other kind, or lacks the routes.
NOT_FOUND = frozenset({404, 405})
#: Engines asked at once: the rest wait their turn.
MAX_CONCURRENT = 16
#: How long one engine has to answer, both kinds' routes tried (``auto``) included.
ENGINE_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class EngineRoute:
    path: str
    params: dict[str, str] | None = None
    body: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PauseRoutes:
    """One engine's pause and resume routes, and what to do where they are not found."""

    name: str
    pause: EngineRoute
    resume: EngineRoute
    missing: str

    def route(self, action: Action) -> EngineRoute:
        return self.pause if action == "pause" else self.resume


ROUTES: dict[str, PauseRoutes] = {
    entry.name: entry
    for entry in (
        PauseRoutes(
            "sglang",
            pause=EngineRoute("/pause_generation", body={"mode": "abort"}),
            resume=EngineRoute("/continue_generation", body={}),
            missing="an SGLang without /pause_generation cannot abort for a weight update",
        ),
        PauseRoutes(
            "vllm",
            pause=EngineRoute("/pause", params={"mode": "abort"}),
            resume=EngineRoute("/resume"),
            missing="vLLM serves /pause and /resume only when started with VLLM_SERVER_DEV_MODE=1",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class EngineAnswer:
    """What one engine answered: ``ok`` only when it did what was asked."""

    url: str
    engine: str | None
    ok: bool
    status: int | None = None
    detail: str = ""

    def describe(self) -> str:
        return f"{self.url}: {self.detail}"


async def tell_engines(
    urls: list[str],
    action: Action,
    engine: str,
    kinds: dict[str, str],
    timeout_s: float = ENGINE_TIMEOUT_S,
    concurrency: int = MAX_CONCURRENT,
) -> list[EngineAnswer]:
    """Ask the engines, ``concurrency`` at a time, to pause (abort what is in flight) or to
    resume, each within ``timeout_s``; ``engine`` is their kind ("vllm", "sglang", or "auto":
    found per URL and remembered in ``kinds``). One answer per URL, in their order."""
    if not urls:
        return []
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def ask(client: httpx.AsyncClient, url: str) -> EngineAnswer:
        async with slots:
            try:
                async with asyncio.timeout(timeout_s):
                    return await _tell(client, url, action, engine, kinds)
            except TimeoutError:
                known = engine if engine in ROUTES else kinds.get(url)
                return EngineAnswer(
                    url, known, False, None, f"no answer in {timeout_s:g} s: nothing was {action}d"
                )

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(ask(client, url) for url in urls)))


async def _tell(
    client: httpx.AsyncClient, url: str, action: Action, engine: str, kinds: dict[str, str]
) -> EngineAnswer:
    known = engine if engine in ROUTES else kinds.get(url)
    candidates = [ROUTES[known]] if known in ROUTES else list(ROUTES.values())
    tried: list[str] = []
    for routes in candidates:
        route = routes.route(action)
        try:
            response = await client.post(
                engine_root_url(url) + route.path, params=route.params, json=route.body
            )
        except httpx.HTTPError as exc:
            return EngineAnswer(url, known, False, None, f"not reached ({exc!r}): nothing was {action}d")
        if response.status_code in NOT_FOUND:
            tried.append(f"{routes.name} {route.path} (HTTP {response.status_code})")
            continue
        if response.is_error:
            said = response.text.strip()[:300]
            return EngineAnswer(
                url,
                routes.name,
                False,
                response.status_code,
                f"{routes.name} {route.path} answered HTTP {response.status_code}: {said}",
            )
        kinds[url] = routes.name
        return EngineAnswer(url, routes.name, True, response.status_code, f"{routes.name} {action}d")
    hints = "; ".join(ROUTES[name.split()[0]].missing for name in tried)
    return EngineAnswer(url, known, False, 404, f"no {action} route: tried {', '.join(tried)} ({hints})")
