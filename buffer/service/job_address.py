"""Where a job writes when the service that resumes it listens elsewhere.

A job's data holds the ``remote_buffer_url`` its generator writes to (the trainer's, or the
service's own address by default), and it is kept as it came, on disk, to resume the job after a
restart. A service restarted on another port would then resume the job writing to its old
address: nothing there, or another service, while the job reports everything done. So the
service records its own address in each job's data (``SERVICE_URL_FIELD``, set by the service,
never by a client), and a job resumed elsewhere (``rehomed``) writes where the service is now
when its ``remote_buffer_url`` named the service it started in, by any of its addresses; one that
named another buffer on purpose keeps it.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from buffer.toolkit.sink import same_service

#: The service's own address when the job started or resumed.
SERVICE_URL_FIELD = "buffer_address"  # no `_url` ending: the policy checks those a client sends


async def rehomed(data: dict[str, Any], started_at: Any, now: str) -> dict[str, Any]:
    """``data`` of a job the service at ``now`` resumes, which started in the service at
    ``started_at`` (its ``SERVICE_URL_FIELD`` then): a ``remote_buffer_url`` that named that
    service names it at its port now, by the same host name (a trainer's view, a Ray cluster's
    too). Resolves host names: in a thread."""
    url = data.get("remote_buffer_url")
    data = {**data, SERVICE_URL_FIELD: now}
    if not (isinstance(url, str) and isinstance(started_at, str)) or started_at == now:
        return data
    if url == started_at or await asyncio.to_thread(same_service, url, started_at):
        parts, port = urlsplit(url), urlsplit(now).port
        host = parts.netloc.rpartition(":")[0] if parts.port is not None else parts.netloc
        data["remote_buffer_url"] = parts._replace(netloc=f"{host}:{port}").geturl()
    return data
