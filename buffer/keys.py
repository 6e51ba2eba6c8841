"""Where a client finds the buffer's API key when none is passed: one environment variable.

A trainer (``buffer.trainer``), a generator writing to a buffer (``buffer.toolkit``) and the
service's own worker processes (``buffer.workers``, given the service's key in their
environment) all read the same ``ROLLOUT_BUFFER_API_KEY``. It lives in a leaf of its own, with
nothing but the standard library, so that none of them imports another's side of the house
for one line.
"""

from __future__ import annotations

import os

#: Where a client finds the key when none is passed: one variable for a trainer and its generators.
API_KEY_VARIABLE = "ROLLOUT_BUFFER_API_KEY"


def key_or_env(api_key: str | None) -> str | None:
    """``api_key``; when it is None, the ``ROLLOUT_BUFFER_API_KEY`` variable (None if unset).
    An empty ``api_key`` means "send none", whatever the environment holds."""
    return os.environ.get(API_KEY_VARIABLE) if api_key is None else api_key
