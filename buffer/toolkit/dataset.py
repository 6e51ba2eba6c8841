"""Reading a data set and planning the trajectories to run from it.

The data set is JSONL in slime's format: ``prompt`` (a string, or a list of chat messages),
``label``, an optional ``instance_id`` and any other fields, which are kept. A row without
``instance_id`` gets its line number, as in slime, so a resume names the same instances.

``plan`` yields the samples lazily: for each epoch, the rows shuffled with a seed, each
repeated ``num_repeat_per_sample`` times in a row (so its group fills up soon). A
``skip_instance_ids`` entry skips one whole group of that instance: the trainer sends back
the ``finished_groups`` the buffer reported, one entry per finished group.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from buffer.toolkit.types import Message, Sample


class DatasetError(ValueError):
    """A data set file that cannot be read; names the file and line."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number + 1}: not valid JSON: {exc}") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise DatasetError(f"{path}:{number + 1}: a row must be an object with a prompt")
            row.setdefault("instance_id", number)
            rows.append(row)
    return rows


def prompt_messages(prompt: Any) -> list[Message]:
    """The prompt as chat messages: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(message) for message in prompt]
    raise DatasetError(f"a prompt must be a string or a list of chat messages, not {prompt!r:.100}")


def derive_seed(base_seed: int, instance_id: Any, repeat: int, epoch: int) -> int:
    """A sampling seed that depends only on these four, so a run can be replayed."""
    key = f"{base_seed}|{instance_id!r}|{repeat}|{epoch}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Plan:
    rows: Sequence[dict[str, Any]]
    num_repeat_per_sample: int = 1
    num_epoch: int = 1
    seed: int = 0
    shuffle: bool = True
    skip_instance_ids: Iterable[Any] = ()

    def __iter__(self) -> Iterator[Sample]:
        # Ids may come back from the trainer as strings: match on the text.
        skips = Counter(str(instance_id) for instance_id in self.skip_instance_ids)
        for epoch in range(self.num_epoch):
            order = list(self.rows)
            if self.shuffle:
                random.Random(f"{self.seed}|{epoch}").shuffle(order)
            for row in order:
                instance_id = row["instance_id"]
                if skips[str(instance_id)] > 0:
                    skips[str(instance_id)] -= 1
                    continue
                messages = prompt_messages(row["prompt"])
                for repeat in range(self.num_repeat_per_sample):
                    yield Sample(
                        instance_id=instance_id,
                        row=row,
                        messages=[dict(message) for message in messages],
                        epoch=epoch,
                        repeat=repeat,
                        seed=derive_seed(self.seed, instance_id, repeat, epoch),
                    )

    def total(self) -> int:
        """How many samples iteration yields."""
        skipped = Counter(str(instance_id) for instance_id in self.skip_instance_ids)
        groups = len(self.rows) * self.num_epoch
        present = Counter(str(row["instance_id"]) for row in self.rows)
        groups -= sum(min(count, present[key] * self.num_epoch) for key, count in skipped.items())
        return groups * self.num_repeat_per_sample
