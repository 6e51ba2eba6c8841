"""``RemoteRewardModel``: a reward model served over HTTP, called in batches.

The contract with the server::

    POST <url>
    [{"instance_id": ..., "prompt": [<prompt messages>], "response": "<last assistant text>",
      "messages": [<the whole conversation>], "label": <the row's label or null>}, ...]

    200 [0.5, 1.0, ...]              one number per object, in the same order
    200 {"rewards": [0.5, 1.0, ...]} the same, wrapped

Connection errors, timeouts, 429 and 5xx are retried with exponential backoff and full
jitter. Any other status, an answer that is not such a list of finite numbers, or retries
exhausted raise ``RewardModelError`` in every caller of the batch: a reward that could not
be computed is a failed trajectory, never a 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import orjson
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from buffer.toolkit.types import Episode, Sample

logger = logging.getLogger(__name__)


class RewardModelError(Exception):
    """The reward model did not score a batch: refused it, answered nonsense, or never answered."""


class _RetryableStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}: {response.text[:300]}")


@dataclass(slots=True)
class _Request:
    payload: dict[str, Any]
    future: asyncio.Future[float]


class RemoteRewardModel:
    """``await rm(sample, episode) -> float``, many concurrent calls sent as one request.

    A batch leaves when ``batch_size`` calls are waiting, or ``max_wait_s`` after the first of
    them. Each request may take ``timeout_s``; a failed one is retried up to ``max_retries``
    times, after a random wait of up to ``backoff_s * 2**retry`` (at most ``max_backoff_s``).
    Without a ``client`` it makes its own, closed by ``aclose()``; a client passed in is
    left open. Call it from one event loop.
    """

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 32,
        max_wait_s: float = 0.02,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if max_wait_s < 0 or max_retries < 0:
            raise ValueError("max_wait_s and max_retries cannot be negative")
        self.url = url
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._headers = {"content-type": "application/json", **(headers or {})}
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient()
        self._pending: list[_Request] = []
        self._timer: asyncio.TimerHandle | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __call__(self, sample: Sample, episode: Episode) -> float:
        if self._closed:
            raise RuntimeError("this RemoteRewardModel is closed")
        loop = asyncio.get_running_loop()
        payload = {
            "instance_id": sample.instance_id,
            "prompt": sample.messages,
            "response": episode.response,
            "messages": episode.messages,
            "label": sample.label,
        }
        request = _Request(payload, loop.create_future())
        self._pending.append(request)
        if len(self._pending) >= self.batch_size:
            self._send_pending()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._send_pending)
        return await request.future

    def _send_pending(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [request for request in self._pending if not request.future.done()]  # done: cancelled
        self._pending = []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _send(self, batch: list[_Request]) -> None:
        """Score a batch; every caller gets its reward or a ``RewardModelError``, whatever happens."""
        try:
            rewards = await self._score([request.payload for request in batch])
        except Exception as exc:
            reason = str(exc) if isinstance(exc, RewardModelError) else f"scoring failed: {exc!r}"
            logger.warning("reward model %s: a batch of %d failed: %s", self.url, len(batch), reason)
            for request in batch:
                _fail(request, RewardModelError(reason), exc)
        else:
            for request, reward in zip(batch, rewards, strict=True):
                if not request.future.done():
                    request.future.set_result(reward)
        finally:  # only a cancelled batch leaves callers waiting here
            for request in batch:
                _fail(request, RewardModelError("the batch was cancelled"), None)

    async def _score(self, payloads: list[dict[str, Any]]) -> list[float]:
        attempts = self.max_retries + 1
        retrying = AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            retry=retry_if_exception(_is_retryable),
            before_sleep=self._log_retry,
            reraise=True,
        )
        content = orjson.dumps(payloads)
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._client.post(
                        self.url, content=content, headers=self._headers, timeout=self.timeout_s
                    )
                    if response.status_code == 429 or response.status_code >= 500:
                        raise _RetryableStatus(response)
        except (_RetryableStatus, httpx.TransportError) as exc:
            raise RewardModelError(f"no answer after {attempts} attempts; last: {exc}") from exc
        if response.status_code != 200:
            raise RewardModelError(f"HTTP {response.status_code} from {self.url}: {response.text[:300]}")
        return _rewards(response.content, len(payloads))

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning(
            "reward model %s: attempt %d failed (%s); retrying in %.2f s",
            self.url,
            state.attempt_number,
            error,
            wait_s,
        )

    async def aclose(self) -> None:
        """Send what is queued, wait for every batch in flight, then close the own client."""
        self._closed = True
        self._send_pending()
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> RemoteRewardModel:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, (_RetryableStatus, httpx.TransportError))


def _fail(request: _Request, error: RewardModelError, cause: BaseException | None) -> None:
    if not request.future.done():
        error.__cause__ = cause
        request.future.set_exception(error)


def _rewards(content: bytes, expected: int) -> list[float]:
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise RewardModelError(f"the reward model answered invalid JSON: {exc}") from exc
    rewards = answer.get("rewards") if isinstance(answer, dict) else answer
    if not isinstance(rewards, list):
        raise RewardModelError(f"expected a list of rewards or {{'rewards': [...]}}, got {str(answer)[:300]}")
    if len(rewards) != expected:
        raise RewardModelError(f"sent {expected} responses to score, got {len(rewards)} rewards back")
    for index, reward in enumerate(rewards):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RewardModelError(f"reward {index} is not a finite number: {reward!r}")
    return [float(reward) for reward in rewards]
