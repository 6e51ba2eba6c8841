"""What a run follows: the buffer's policy (its gate and admission) and the plan's samples.

``follow`` finds the policy of the buffer the run writes to: in this process (a job of the
service, or a buffer running here), the policy itself; elsewhere its mirror
(``remote_policy.RemotePolicy``), whose admission comes over the worker process's admission
socket when the buffer is the service that started it (``policy_channel``), else over HTTP.

``PlanSamples`` hands the run its samples: the plan's, or with leases (a job's worker, or
``rollout-buffer worker --leases``) those the buffer grants this worker (``leased``), claimed
from the moment the run is set up and read ahead: the first claims (a round trip each) overlap
the rest of the run's setup, and the claim of the next chunk overlaps the run's use of the last
ones, instead of leaving the slots they free idle meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from buffer.policy import find_policy
from buffer.policy.admission import Admits
from buffer.policy.gate import Gate
from buffer.toolkit.dataset import Plan
from buffer.toolkit.leased import leased
from buffer.toolkit.remote_policy import RemotePolicy
from buffer.toolkit.sink import HttpSink, TrajectorySink
from buffer.toolkit.types import Sample

#: Samples of a worker's leased plan taken ahead of the run.
LEASE_READ_AHEAD = 32


@dataclass
class Following:
    """The gate a run's engine requests pass and the admission its groups wait for (None: the
    buffer has no policy to follow); ``remote``: the mirror they come from, if elsewhere."""

    gate: Gate | None = None
    admission: Admits | None = None
    remote: RemotePolicy | None = None

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()


async def follow(buffer_url: str | None, task_type: str, sink: TrajectorySink, *, mirror: bool) -> Following:
    """The policy of the buffer at ``buffer_url``; a buffer elsewhere only when ``mirror``
    (``follow_policy``), asked with the sink's own credentials."""
    policy = find_policy(buffer_url)
    if policy is not None:
        return Following(policy.gate, policy.admission(task_type))
    if not buffer_url or not mirror:
        return Following()
    authorization = sink.authorization if isinstance(sink, HttpSink) else None
    remote = await RemotePolicy.connect(buffer_url, task_type, authorization)
    if remote is None:
        return Following()
    return Following(remote.gate, remote.admission, remote)


class PlanSamples:
    """The run's samples (see the module's docstring); ``aclose`` when the run is over."""

    def __init__(self, plan: Plan, task_type: str, leases: dict[str, Any] | None) -> None:
        self._plan = plan
        self._queue: asyncio.Queue[tuple[Sample] | BaseException | None] | None = None
        self._puller: asyncio.Task[None] | None = None
        if leases is not None:  # claiming starts now
            self._queue = asyncio.Queue(LEASE_READ_AHEAD)
            self._puller = asyncio.create_task(
                self._pull(leased(plan, task_type, leases), self._queue), name="plan-read-ahead"
            )

    @staticmethod
    async def _pull(samples: AsyncIterator[Sample], queue: asyncio.Queue[Any]) -> None:
        try:
            async for sample in samples:
                await queue.put((sample,))
        except Exception as exc:  # the run's, raised where it asks
            await queue.put(exc)
            return
        await queue.put(None)

    async def __aiter__(self) -> AsyncIterator[Sample]:
        if self._queue is None:
            for sample in self._plan:
                yield sample
            return
        while (got := await self._queue.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            yield got[0]

    async def aclose(self) -> None:
        if self._puller is not None:
            self._puller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._puller
