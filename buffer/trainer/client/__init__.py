"""A client for the rollout buffer's HTTP API, for trainers (slime, verl, OpenRLHF, TRL).

    with RolloutBufferClient("http://buffer-host:8889") as buffer:
        buffer.start_rollout("math", input_file="train.jsonl", remote_engine_url=engine,
                             num_repeat_per_sample=8)
        batch = buffer.get_rollout_data(batch_size=64, wait_s=60)
        for group in batch.groups():
            ...

``AsyncRolloutBufferClient`` has the same methods, awaitable. Both speak to this service and
to slime's own buffer: ``get_rollout_data(wait_s=...)`` long-polls where the server supports
it and falls back to polling with growing pauses where it answers at once.

With ``api_key`` (default: the ``ROLLOUT_BUFFER_API_KEY`` variable) every request carries
``Authorization: Bearer <key>``.

Transport errors, timeouts, 429 (honouring ``Retry-After``) and 5xx are retried with
exponential backoff and jitter (0.5 s doubling up to 5 s) for ``max_retry_s``, a minute by
default: longer than the service takes to restart, so a trainer rides out a crash or a deploy
of the buffer (``max_attempts`` bounds the attempts too, if set). Any other 4xx raises at once. A
read is retried too: the server deletes only what it returns, so a retry never takes a
group twice (a response lost in transit is lost with or without a retry). The errors::

    BufferClientError              the base: url, status_code, message, errors, body
    ├── BufferRequestError         a 4xx: the server refused the request (not retried)
    └── BufferUnavailableError     transport errors, timeouts, 429 and 5xx, once retries run out

Request building, response parsing, retries and waiting are shared by the two clients; only
their I/O loops differ:

    models.py         the typed answers: RolloutBatch, JobInfo, BufferStats, StartedRollout
    errors.py         BufferClientError and its two subclasses
    calls.py          each request (method, path, body) and how its answer's JSON is read
    retries.py        HTTP answers decoded or refused, and the retry policy (backoff, Retry-After)
    polling.py        when to ask again while waiting for data (long-polling or not)
    base.py           the configuration and pure parts of both clients
    sync_client.py    RolloutBufferClient, over ``httpx.Client``
    async_client.py   AsyncRolloutBufferClient, over ``httpx.AsyncClient``
"""

from buffer.trainer.client.async_client import AsyncRolloutBufferClient
from buffer.trainer.client.errors import BufferClientError, BufferRequestError, BufferUnavailableError
from buffer.trainer.client.models import BufferStats, JobInfo, RolloutBatch, StartedRollout
from buffer.trainer.client.polling import FIRST_PAUSE_S as FIRST_PAUSE_S
from buffer.trainer.client.polling import LONG_POLL_CAP_S as LONG_POLL_CAP_S
from buffer.trainer.client.polling import MAX_PAUSE_S as MAX_PAUSE_S
from buffer.trainer.client.retries import RETRY_AFTER_CAP_S as RETRY_AFTER_CAP_S
from buffer.trainer.client.sync_client import RolloutBufferClient

__all__ = [
    "AsyncRolloutBufferClient",
    "BufferClientError",
    "BufferRequestError",
    "BufferStats",
    "BufferUnavailableError",
    "JobInfo",
    "RolloutBatch",
    "RolloutBufferClient",
    "StartedRollout",
]
