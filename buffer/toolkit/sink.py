"""Where a generator's trajectories go.

Inside the service (a job of this process whose ``remote_buffer_url`` is the service itself)
they go to the writer the service handed the job (``buffer.current.JobContext.writer``:
straight into the buffer, validated as a write would be, with no HTTP round trip). Elsewhere
they go over HTTP to ``/buffer/write_batch``: batched, retried until the buffer takes them (a
429 or an outage slows the generator down; nothing is dropped), idempotent because the buffer
deduplicates by ``uid``.

A trajectory the buffer refuses as invalid is a bug of the generator, never retried: the local
writer raises ``RejectedTrajectory`` from ``write``; the HTTP sink, which sends from the
background, counts it and raises ``RejectedTrajectory`` from ``aclose``. Either also counts it
on the job it writes for (``JobContext.record_refusal``), so a job whose writes were refused
fails, saying how many, even when its generator catches the error (or never closes its sink)
and returns as if all went well.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from buffer.current import current_job
from buffer.keys import key_or_env
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.retries import retry_after_s
from buffer.toolkit.transport import Reply, Unreachable

logger = logging.getLogger(__name__)


class TrajectorySink(Protocol):
    async def write(self, trajectory: dict[str, Any]) -> None: ...

    async def aclose(self) -> None: ...


class _Flush:
    """Queued by ``HttpSink.flush``: the batch goes out with what is queued before it."""


_FLUSH = _Flush()


class RejectedTrajectory(ValueError):
    """The buffer refused a trajectory as invalid: a bug of the generator, never retried."""


class HttpSink:
    """Writes to a rollout buffer over HTTP, in batches, from a background task; with ``api_key``
    (default: the ``ROLLOUT_BUFFER_API_KEY`` variable) as ``Authorization: Bearer``.

    The POSTs go over the engine client's HTTP/1.1 transport (``http11``): httpx cost a
    worker some 25 us of CPU per trajectory in them. ``client`` sends them through an
    ``httpx.AsyncClient`` instead (tests: respx, an ASGI app)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        batch_size: int = 64,
        flush_interval_s: float = 0.05,
        max_pending: int = 10_000,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._url = url.rstrip("/") + "/buffer/write_batch"
        self._headers = {"content-type": "application/json"}
        api_key = key_or_env(api_key, url)
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._wait = wait_random_exponential(multiplier=backoff_s, max=max_backoff_s)
        self._queue: asyncio.Queue[dict[str, Any] | _Flush | None] = asyncio.Queue(max_pending)
        self._client = client
        self._transport = Http11Transport(max_connections=8, timeout_s=60.0) if client is None else None
        self._flusher: asyncio.Task[None] | None = None
        self.written = 0
        self.rejected = 0
        self._first_rejection: str | None = None  # why the first refused trajectory was refused
        self._job = current_job()  # where refusals are counted too: the job fails with them

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header this sink sends (others talking to the same buffer for
        it, such as its policy, send the same and no other)."""
        return self._headers.get("authorization")

    @property
    def first_rejection(self) -> str | None:
        """Why the first trajectory the buffer refused was refused (its uid first)."""
        return self._first_rejection

    async def write(self, trajectory: dict[str, Any]) -> None:
        """Queue a trajectory; waits when ``max_pending`` are already queued (backpressure)."""
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_forever(), name="trajectory-sink")
        if self._flusher.done():
            self._flusher.result()  # surface the flusher's failure
        await self._queue.put(trajectory)

    def flush(self) -> None:
        """Send what is queued now, without waiting out the flush interval for more (the runner
        says so when a group's last trajectory is written: a group is served, or dropped and
        its room in admission freed, only once whole)."""
        if self._flusher is not None and not self._flusher.done():
            with contextlib.suppress(asyncio.QueueFull):  # full: the batch goes out at once anyway
                self._queue.put_nowait(_FLUSH)

    async def aclose(self) -> None:
        """Send everything queued, then stop; ``RejectedTrajectory`` if the buffer refused any."""
        try:
            if self._flusher is not None and not self._flusher.done():
                await self._queue.put(None)
                await self._flusher
        finally:
            if self._transport is not None:
                await self._transport.aclose()
        if self.rejected:
            raise RejectedTrajectory(
                f"the buffer refused {self.rejected} of {self.rejected + self.written} trajectories "
                f"(the first: {self._first_rejection})"
            )

    async def _flush_forever(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            if isinstance(first, _Flush):  # what it was for is sent already
                continue
            batch = [first]
            closing = await self._fill(batch)
            await self._send(batch)
            if closing:
                return

    async def _fill(self, batch: list[dict[str, Any]]) -> bool:
        """Add what arrives within the flush interval; True when the close marker came.

        One timeout per batch, not per trajectory (``wait_for`` per item cost more CPU than
        the batch's POST); a ``Queue.get`` cut off by it loses no item."""
        queue = self._queue
        try:
            async with asyncio.timeout(self._flush_interval_s):
                while len(batch) < self._batch_size:
                    item = queue.get_nowait() if not queue.empty() else await queue.get()
                    if item is None:
                        return True
                    if isinstance(item, _Flush):
                        return False
                    batch.append(item)
        except TimeoutError:
            pass
        return False

    async def _send(self, batch: list[dict[str, Any]]) -> None:
        try:
            await self._post(batch)
        except (RejectedTrajectory, BatchTooLarge) as exc:
            if len(batch) == 1:
                self.rejected += 1
                reason = f"{batch[0].get('uid')}: {str(exc)[:500]}"
                if self._first_rejection is None:
                    self._first_rejection = reason
                if self._job is not None:
                    self._job.record_refusal(reason)
                logger.error("the buffer refused trajectory %s: %s", batch[0].get("uid"), exc)
                return
            if isinstance(exc, BatchTooLarge):  # past --max-request-bytes: send it in halves
                await self._send(batch[: len(batch) // 2])
                await self._send(batch[len(batch) // 2 :])
                return
            for trajectory in batch:  # find the bad one; the rest still go in
                await self._send([trajectory])
        else:
            self.written += len(batch)

    async def _post(self, batch: list[dict[str, Any]]) -> None:
        await post_batch(self._send_once, orjson.dumps(batch), self._url, self._wait)

    async def _send_once(self, content: bytes) -> Reply:
        if self._transport is not None:
            return await self._transport.post(self._url, content, self._headers)
        assert self._client is not None
        try:
            response = await self._client.post(self._url, content=content, headers=self._headers)
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__, str(exc), connect=False) from exc
        return Reply(response.status_code, response.content, response.headers.get("retry-after"))


class BatchTooLarge(Exception):
    """The batch is larger than the buffer's --max-request-bytes."""


class WriteRefused(Exception):
    """The buffer answered a status no retry or split can help (a 401, a 404, ...)."""


class _BufferBusy(Exception):
    def __init__(self, reply: Reply) -> None:
        super().__init__(f"HTTP {reply.status}")
        self.retry_after_s = retry_after_s(reply.retry_after)


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (_BufferBusy, Unreachable))


async def post_batch(
    send: Callable[[bytes], Awaitable[Reply]],
    content: bytes,
    url: str,
    wait: Callable[[RetryCallState], float],
) -> Reply:
    """A batch of trajectories (``content``, a JSON list) posted with ``send`` to a buffer's
    ``/buffer/write_batch`` at ``url``, sent again while the buffer cannot be reached or answers
    429 or 5xx (after ``wait``'s time, or its ``Retry-After`` when longer); the buffer's answer.
    ``RejectedTrajectory`` for a 422, ``BatchTooLarge`` for a 413, ``WriteRefused`` for any other
    error status."""

    def waited(state: RetryCallState) -> float:
        wait_s = wait(state)
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, _BufferBusy) and error.retry_after_s is not None:
            wait_s = max(wait_s, error.retry_after_s)
        logger.warning("writing to the buffer failed (%s); retrying in %.1f s", error, wait_s)
        return wait_s

    retrying = AsyncRetrying(wait=waited, retry=retry_if_exception(_is_transient), reraise=True)
    async for attempt in retrying:
        with attempt:
            reply = await send(content)
            if reply.status == 422:
                raise RejectedTrajectory(reply.text[:1000])
            if reply.status == 413:
                raise BatchTooLarge(reply.text[:1000])
            if reply.status == 429 or reply.status >= 500:
                raise _BufferBusy(reply)
            if reply.is_error:
                raise WriteRefused(f"HTTP {reply.status} from {url}: {reply.text[:300]}")
    return reply


async def open_sink(remote_buffer_url: str | None, *, api_key: str | None = None) -> TrajectorySink:
    """The job's own writer when this runs as a job of the service ``remote_buffer_url``
    names (or names nothing) in the service's process, an HTTP sink to the service's own
    address from its worker processes (with the service's key, which it gave them), else an
    HTTP sink to ``remote_buffer_url``."""
    job = current_job()
    if job is not None and (job.writer is not None or job.in_worker):
        local = (
            remote_buffer_url is None
            or remote_buffer_url == job.buffer_url
            or await asyncio.to_thread(same_service, remote_buffer_url, job.buffer_url)
        )
        if local and job.writer is not None:
            return job.writer
        if local and job.buffer_url is not None:  # a worker process of the service: its loopback
            return HttpSink(job.buffer_url, api_key=api_key)
    if remote_buffer_url is None:
        raise ValueError("remote_buffer_url is required outside the rollout buffer service")
    if job is not None and api_key is None and not job.may_send_api_key(remote_buffer_url):
        api_key = ""  # the service's own key (its environment's) never goes to a URL a client chose
    return HttpSink(remote_buffer_url, api_key=api_key)


def same_service(url: str, local: str | None) -> bool:
    """Whether ``url`` reaches the service listening at ``local``: the same port on an
    address of this machine (slime's trainer sends its own view, e.g. http://10.0.0.5:8889).
    Resolves the host name: blocking, so call it in a thread."""
    if local is None:
        return False
    target, own = urlsplit(url), urlsplit(local)
    if target.port != own.port or target.hostname is None:
        return False
    return _is_this_machine(target.hostname)


def _is_this_machine(host: str) -> bool:
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback or address.is_unspecified:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))  # succeeds only for this machine's own addresses
        except OSError:
            return False
    return True
