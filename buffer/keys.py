"""Where a client finds the buffer's API key when none is passed: the running job, else one
environment variable.

A trainer (``buffer.trainer``) and a generator writing to a buffer (``buffer.toolkit``) read
``ROLLOUT_BUFFER_API_KEY``. A generator in one of the service's worker processes is given the
service's own key in its ``WorkerSpec``, not its environment (every process the generator
starts would inherit it): ``buffer.current.JobContext.key_for`` hands it out for the job's own
buffer and the hosts the service names, and only there. It lives in a leaf of its own, with
nothing but the standard library and that other leaf, so that none of them imports another's
side of the house for one line.
"""

from __future__ import annotations

import os

from buffer.current import current_job

#: Where a client finds the key when none is passed: one variable for a trainer and its generators.
API_KEY_VARIABLE = "ROLLOUT_BUFFER_API_KEY"


def key_or_env(api_key: str | None, url: str | None = None) -> str | None:
    """``api_key``; when it is None, the running job's key for ``url`` (a worker process
    writing to its own service), else the ``ROLLOUT_BUFFER_API_KEY`` variable (None if unset).
    An empty ``api_key`` means "send none", whatever the environment holds."""
    if api_key is not None:
        return api_key
    job = current_job()
    if url is not None and job is not None and (key := job.key_for(url)) is not None:
        return key
    return os.environ.get(API_KEY_VARIABLE)
