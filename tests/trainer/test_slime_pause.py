"""The adapter's pause reaches slime's engines (issue 21, item 3).

slime's engines are behind its SGLang router, which forwards no ``/pause_generation`` (a 404
from sglang-router 0.3): in ``abort`` mode the adapter names the engines the router lists, so
the buffer has each abort what is in flight. Before, it named none and nothing was aborted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import respx

from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from buffer.trainer import slime_rollout

ROUTER = "http://10.0.0.1:3000"


class Client:
    """The buffer client's ``pause_generation``, recorded."""

    def __init__(self) -> None:
        self.pauses: list[tuple[str, list[str] | None]] = []

    def pause_generation(
        self, mode: str = "abort", *, engine_urls: list[str] | None = None, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        self.pauses.append((mode, engine_urls))
        return {}


@pytest.fixture
def router() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_mocked=True) as mocked:
        yield mocked


def pause(mode: str) -> SimpleNamespace:
    args = SimpleNamespace(rollout_buffer_pause=mode, sglang_router_ip="10.0.0.1", sglang_router_port=3000)
    session = SimpleNamespace(client=Client(), paused=False)
    slime_rollout._pause_after_step(args, session)
    assert session.paused
    return session


def test_an_abort_pause_names_the_engines_behind_slimes_router(router: respx.MockRouter) -> None:
    engines = ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    router.get(f"{ROUTER}/workers").respond(
        json={"workers": [{"id": "a", "url": engines[0]}, {"id": "b", "url": engines[1]}], "total": 2}
    )
    assert pause("abort").client.pauses == [("abort", engines)]


def test_an_older_router_lists_its_engines_at_list_workers(router: respx.MockRouter) -> None:
    router.get(f"{ROUTER}/workers").respond(404)
    router.get(f"{ROUTER}/list_workers").respond(json={"urls": ["http://10.0.0.2:30000"]})
    assert pause("abort").client.pauses == [("abort", ["http://10.0.0.2:30000"])]


@pytest.mark.parametrize("error", [None, httpx.ConnectError("refused")])
def test_a_server_that_lists_no_engines_is_named_itself(
    router: respx.MockRouter, error: Exception | None
) -> None:
    """An engine serving slime directly (or a router that forwards the pause): the buffer asks
    it, and says so (a 409 naming it) if it cannot pause."""
    if error is None:
        router.get(f"{ROUTER}/workers").respond(404)
        router.get(f"{ROUTER}/list_workers").respond(404)
    else:
        router.get(f"{ROUTER}/workers").mock(side_effect=error)
    assert pause("abort").client.pauses == [("abort", [ROUTER])]


def test_a_drain_pause_names_no_engine(router: respx.MockRouter) -> None:
    assert pause("drain").client.pauses == [("drain", None)]
    assert not router.calls
