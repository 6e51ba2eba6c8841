"""What the lease board and a worker walking its plan agree on: the name of a work item, and
the ``data["leases"]`` a worker is given.

The board (``buffer.workers.leases``) is the service's; the walk over the plan
(``buffer.toolkit.leased``) is the generator's. Neither imports the other: the workers sit
beneath the toolkit, and the toolkit, which every generator imports, pulls in nothing of the
service's side. What both must spell the same way lives here, in a leaf of the standard library.
"""

from __future__ import annotations

from typing import Any

#: Repeats beyond this are tracked as whole keys instead of bits (no unbounded bit masks).
MAX_REPEAT_BIT = 4096
#: The items a worker claims at once when its ``num_process`` says nothing.
DEFAULT_CHUNK = 64


class PlanFinished(Exception):
    """The task's job made its whole plan: its board grants nothing more; a worker stops."""


class Settling(Exception):
    """The board is new and may not know what workers had in flight before it: it grants only
    what a worker claims again as its own in flight for ``seconds`` more; claim again after."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the lease board settles for {seconds:.1f} s more")
        self.seconds = seconds


def item_key(epoch: Any, instance_id: Any, repeat: Any) -> str:
    """A work item, one trajectory of the plan: ``epoch|instance_id|repeat``."""
    return f"{epoch}|{instance_id}|{repeat}"


def split_key(key: str) -> tuple[str, str, int] | None:
    """``key``'s epoch, instance and repeat (None: not a key a plan makes)."""
    epoch, sep, rest = key.partition("|")
    instance, sep2, repeat = rest.rpartition("|")
    if not (sep and sep2):
        return None
    try:
        number = int(repeat)
    except ValueError:
        return None
    return (epoch, instance, number) if 0 <= number < MAX_REPEAT_BIT else None


def lease_settings(
    worker: str, ttl_s: float, num_process: Any, *, url: str | None = None, index: int = 0, count: int = 1
) -> dict[str, Any]:
    """What ``leased`` reads from ``data["leases"]``: the worker's name (unique to it), its
    leases' ``ttl_s``, the buffer's ``url`` (none for a worker in the service's process), its
    ``index`` among ``count`` workers, and the ``chunk`` it claims at once: half of the
    ``num_process`` trajectories it keeps in flight, so claims cost little per trajectory and a
    lost worker leaves few unstarted items held."""
    try:
        chunk = max(16, min(1024, int(num_process) // 2))
    except (TypeError, ValueError):
        chunk = DEFAULT_CHUNK
    settings: dict[str, Any] = {"worker": worker, "ttl_s": ttl_s, "index": index, "count": count}
    settings["chunk"] = chunk
    if url is not None:
        settings["url"] = url
    return settings
