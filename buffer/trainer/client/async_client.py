"""``AsyncRolloutBufferClient``: the rollout buffer's API over one ``httpx.AsyncClient``, awaitable."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import httpx
from tenacity import AsyncRetrying

from buffer.trainer.client import calls
from buffer.trainer.client.base import DEFAULT_MAX_RETRY_S, ClientBase
from buffer.trainer.client.calls import Call
from buffer.trainer.client.models import BufferStats, JobInfo, RolloutBatch, StartedRollout
from buffer.trainer.client.polling import LongPoll
from buffer.trainer.client.retries import RetryableStatus, decode

_T = TypeVar("_T")


class AsyncRolloutBufferClient(ClientBase):
    """The rollout buffer's API over one ``httpx.AsyncClient``; ``aclose`` it, or ``async with`` it."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_attempts: int | None = None,
        max_retry_s: float | None = DEFAULT_MAX_RETRY_S,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            max_retry_s=max_retry_s,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
        )
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=timeout_s,
            transport=transport,
            trust_env=False,
        )

    async def __aenter__(self) -> AsyncRolloutBufferClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def start_rollout(self, task_type: str, *, restart: bool = False, **payload: Any) -> StartedRollout:
        """Start the task's generator (slime's payload as keyword arguments), or get its running job."""
        return await self._call(calls.start_rollout(task_type, restart, payload))

    async def get_rollout_data(
        self,
        batch_size: int | None = None,
        task_type: str | None = None,
        wait_s: float = 0.0,
        replay_ratio: float = 0.0,
    ) -> RolloutBatch:
        """Whole ready groups, at most ``batch_size`` items (at least one group); with ``wait_s``,
        wait up to that long for some. An empty batch when nothing came in time. With
        ``replay_ratio`` (the service started with ``--replay-capacity``), up to that share of
        the groups are served again from the replay pool (``RolloutBatch.replayed``)."""
        poll = LongPoll(wait_s)
        while True:
            asked_s = poll.next_wait_s()
            sent_at = time.monotonic()
            batch = await self._call(calls.get_rollout_data(batch_size, task_type, asked_s, replay_ratio))
            if batch.success:
                return batch
            pause_s = poll.pause_s(asked_s, time.monotonic() - sent_at)
            if pause_s is None:
                return batch
            if pause_s:
                await asyncio.sleep(pause_s)

    async def stats(self) -> BufferStats:
        return await self._call(calls.STATS)

    async def jobs(self) -> list[JobInfo]:
        return await self._call(calls.JOBS)

    async def job(self, job_id: str) -> JobInfo:
        return await self._call(calls.job(job_id))

    async def cancel_job(self, job_id: str) -> JobInfo:
        return await self._call(calls.cancel_job(job_id))

    async def health(self) -> dict[str, Any]:
        return await self._call(calls.HEALTH)

    async def _call(self, call: Call[_T]) -> _T:
        options = self._request_options(call)
        retrying = AsyncRetrying(**self._retry_options())
        try:
            async for attempt in retrying:
                with attempt:
                    answer = decode(await self._client.request(call.method, call.path, **options))
        except (RetryableStatus, httpx.TransportError) as exc:
            raise self._gave_up(call, exc, retrying.statistics.get("attempt_number", 1)) from exc
        return self._parse(call, answer)
