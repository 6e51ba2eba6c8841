"""The engines behind slime's SGLang router, for a pause that aborts what they have in flight.

slime serves its engines behind sglang-router (``http://{sglang_router_ip}:{sglang_router_port}``),
which does not forward ``/pause_generation`` or ``/continue_generation``: sglang-router 0.3
(sgl-model-gateway, ``src/server.rs``) has no such route and answers 404. So a pause names the
engines themselves, found as slime's own ``abort`` finds them (``slime/rollout/sglang_rollout.py``):
``GET /workers`` (``{"workers": [{"url": ...}]}``), or the older routers' ``GET /list_workers``
(``{"urls": [...]}``). A server that names no workers is taken to be an engine (or a router that
forwards the pause) and is named itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0


def _workers(body: Any) -> list[str]:
    return [str(worker["url"]) for worker in body["workers"]]


def _urls(body: Any) -> list[str]:
    return [str(url) for url in body["urls"]]


_LISTINGS: tuple[tuple[str, Callable[[Any], list[str]]], ...] = (
    ("/workers", _workers),
    ("/list_workers", _urls),
)


def engine_urls(router_url: str, timeout_s: float = TIMEOUT_S) -> list[str]:
    """The URLs of the engines behind the router at ``router_url``; ``[router_url]`` when it
    lists none (an engine itself, or a router that cannot say)."""
    root = router_url.rstrip("/")
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for path, read in _LISTINGS:
            try:
                answer = client.get(root + path)
                urls = read(answer.json()) if answer.status_code == 200 else []
            except httpx.HTTPError as exc:
                logger.warning("the router at %s: %r; the pause names it", root, exc)
                return [root]
            except (ValueError, KeyError, TypeError):
                continue  # not the listing this route means here
            if urls:
                return urls
    return [root]
