"""When to ask for rollout data again while waiting for it: long-polling, or polling with pauses."""

from __future__ import annotations

import time

LONG_POLL_CAP_S = 30.0  # the longest wait_s sent in one request
FIRST_PAUSE_S = 0.1  # polling a server that does not long-poll: the first pause ...
MAX_PAUSE_S = 2.0  # ... doubling up to this


class LongPoll:
    """When to ask for data again while waiting up to ``wait_s`` for it.

    Each request asks the server to hold it (``wait_s``, at most ``LONG_POLL_CAP_S``). A
    server that answers "nothing" well before that does not long-poll (slime's own buffer):
    then the client pauses before asking again, ``FIRST_PAUSE_S`` doubling to ``MAX_PAUSE_S``.
    """

    def __init__(self, wait_s: float) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, not {wait_s}")
        self.deadline = time.monotonic() + wait_s
        self._pause_s = FIRST_PAUSE_S

    def next_wait_s(self) -> float:
        return max(0.0, min(LONG_POLL_CAP_S, self.deadline - time.monotonic()))

    def pause_s(self, asked_s: float, answered_in_s: float) -> float | None:
        """After an empty answer: ``None`` to give up, else how long to pause first."""
        remaining_s = self.deadline - time.monotonic()
        if remaining_s <= 0:
            return None
        if answered_in_s >= asked_s / 2:  # the server held the request: ask again at once
            return 0.0
        pause_s = min(self._pause_s, remaining_s)
        self._pause_s = min(self._pause_s * 2, MAX_PAUSE_S)
        return pause_s
