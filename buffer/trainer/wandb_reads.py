"""Weights & Biases logging of each read's ``meta_info``, from the trainer (``pip install
'rollout-buffer[wandb]'``).

The trainer is where a W&B run already lives and where the step is known, so the statistics of
each read (reward mean, std, range, group counts, per task when a read covers several) go to
that run at that step, beside the losses, rather than into a run of the service's own::

    from buffer.trainer.wandb_reads import WandbReads

    reads = WandbReads()                     # the trainer's wandb.run, or wandb.init(**kwargs)
    batch = buffer.get_rollout_data(task_type="math", batch_size=512)
    reads.log(batch.meta_info, step=step)    # rollout_buffer/avg_reward, rollout_buffer/served/...

Only numbers are logged (lists such as ``finished_groups`` are counted, not sent). ``wandb`` is
imported when a ``WandbReads`` is made, never at import time, so the base install has no trace
of it; without it the error says which extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

PREFIX = "rollout_buffer/"


def flatten(meta_info: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, float]:
    """The numbers of ``meta_info``, nested keys joined with ``/``; a list becomes its length
    under ``<key>_count``; text and None are left out (W&B charts numbers)."""
    values: dict[str, float] = {}
    for key, value in meta_info.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            values[name] = float(value)
        elif isinstance(value, int | float):
            values[name] = value
        elif isinstance(value, Mapping):
            values.update(flatten(value, f"{name}/"))
        elif isinstance(value, list | tuple):
            values[f"{name}_count"] = len(value)
    return values


__all__ = ["WandbReads", "flatten"]


class WandbReads:
    """Logs each read's ``meta_info`` to a W&B run: the given one, the process's current one,
    or one started with ``init_kwargs`` (``project=...``, ``name=...``)."""

    def __init__(self, run: Any = None, *, prefix: str = PREFIX, **init_kwargs: Any) -> None:
        try:
            wandb = importlib.import_module("wandb")
        except ImportError as exc:
            raise ImportError(
                "W&B logging needs the wandb package: pip install 'rollout-buffer[wandb]'"
            ) from exc
        self._prefix = prefix
        self._own = run is None and getattr(wandb, "run", None) is None
        self.run = run or getattr(wandb, "run", None) or wandb.init(**init_kwargs)
        self.reads = 0

    def log(self, meta_info: Mapping[str, Any], step: int | None = None) -> dict[str, float]:
        """Log one read's statistics (an empty read: nothing); returns what was logged."""
        served = meta_info.get("served")
        served_any = isinstance(served, Mapping) and served.get("total_samples")
        if not meta_info.get("total_samples", 1) and not served_any:
            return {}
        if not meta_info.get("total_samples", 1):  # nothing written since the last read: only
            meta_info = {"served": served}  # what it returned, not slime's zeros
        values = flatten(meta_info, self._prefix)
        if not values:
            return {}
        self.reads += 1
        values[f"{self._prefix}reads"] = self.reads
        if step is None:
            self.run.log(values)
        else:
            self.run.log(values, step=step)
        return values

    def finish(self) -> None:
        """End the run if this object started it; a run the trainer owns is left alone."""
        if self._own:
            self.run.finish()
