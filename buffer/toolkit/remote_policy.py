"""The policy of a buffer in another process, mirrored for a generator running elsewhere.

A generator in a worker process, or on another machine, cannot await the service's gate. It
keeps a ``Gate`` of its own in step with the service's by long-polling ``GET /policy/watch``
(a pause reaches it as soon as the service has it), and asks ``POST /policy/admit`` before
each group. A request already sent when a pause comes is not counted by the service's
``drain``; in ``abort`` mode the engines abort it, and it is continued after the resume.

It lives in the toolkit, not in ``buffer.policy``: it is generation-side code (the runner uses
it when the buffer it writes to is in another process), and it speaks HTTP, which the policy,
like the core, does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from buffer.policy.gate import Gate

logger = logging.getLogger(__name__)

WATCH_S = 30.0


class RemoteAdmission:
    """``Admission.admit`` over HTTP; stops asking once the service says there is no bound.

    The next group's admission is asked for as soon as one is granted, so a round trip to
    the service is not paid between one group and the next (the service counts it as
    outstanding from then: the bound holds)."""

    def __init__(self, client: httpx.AsyncClient, task_type: str) -> None:
        self._client = client
        self._task_type = task_type
        self.bounded = True
        self._next: asyncio.Task[None] | None = None

    async def admit(self) -> None:
        if not self.bounded:
            return
        if self._next is None:
            self._next = asyncio.create_task(self._ask())
        try:
            await self._next
        finally:
            self._next = None
        if self.bounded:
            self._next = asyncio.create_task(self._ask())

    async def _ask(self) -> None:
        while self.bounded:
            try:
                answer = await self._client.post(
                    "/policy/admit",
                    json={"task_type": self._task_type, "wait_s": WATCH_S},
                    timeout=WATCH_S + 30,
                )
                answer.raise_for_status()
                data = answer.json()["data"]
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                logger.warning("admission: %r; retrying in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            self.bounded = bool(data.get("bounded", True))
            if data.get("admitted"):
                return

    async def aclose(self) -> None:
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._next


class RemotePolicy:
    """A gate kept in step with the service's, and its admission, for one generator."""

    def __init__(self, client: httpx.AsyncClient, task_type: str) -> None:
        self._client = client
        self.gate = Gate()
        self.admission = RemoteAdmission(client, task_type)
        self._watcher: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls, buffer_url: str, task_type: str, api_key: str | None = None
    ) -> RemotePolicy | None:
        """The mirror of the policy at ``buffer_url``, or None if the server has none (an
        older buffer) or cannot be reached now."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.AsyncClient(
            base_url=buffer_url.rstrip("/"), headers=headers, timeout=30.0, trust_env=False
        )
        try:
            answer = await client.get("/policy", timeout=5.0)
            if answer.status_code != 200:
                await client.aclose()
                return None
            state = answer.json()["data"]
        except Exception as exc:  # no policy to follow: the generator runs as it always did
            logger.debug("no policy at %s: %r", buffer_url, exc)
            await client.aclose()
            return None
        remote = cls(client, task_type)
        remote._apply(state)
        remote._watcher = asyncio.create_task(remote._watch(), name="policy-watch")
        return remote

    def _apply(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if state.get("paused"):
            if version is not None:
                self.gate.version = version
            self.gate.pause()
        else:
            self.gate.resume(version)

    async def _watch(self) -> None:
        while True:
            params: dict[str, Any] = {"paused": str(self.gate.paused).lower(), "wait_s": WATCH_S}
            if self.gate.version is not None:
                params["version"] = self.gate.version
            try:
                answer = await self._client.get("/policy/watch", params=params, timeout=WATCH_S + 30)
                answer.raise_for_status()
                self._apply(answer.json()["data"])
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                logger.warning("policy watch: %r; retrying in 1 s", exc)
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        await self.admission.aclose()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self._client.aclose()
