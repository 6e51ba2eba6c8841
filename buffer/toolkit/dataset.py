"""Reading a data set and planning the trajectories to run from it.

The data set is JSONL in slime's format: ``prompt`` (a string, or a list of chat messages),
``label``, an optional ``instance_id`` and any other fields, which are kept. A row without
``instance_id`` gets its line number, as in slime, so a resume names the same instances.

``plan`` yields the samples lazily: for each epoch, the rows shuffled with a seed, each
repeated ``num_repeat_per_sample`` times in a row (so its group fills up soon). A
``skip_instance_ids`` entry skips one whole group of that instance: the trainer sends back
the ``finished_groups`` the buffer reported, one entry per finished group.

A job the service resumes after a restart gets a ``ResumePoint``, what its first run already
produced: how many groups finished and which repeats the open group holds, per instance and
epoch where the trajectories said their epoch (``extra_info.epoch``, which ``runner`` writes).
With several epochs run at once, an instance's group of a later epoch can finish before the
one of an earlier epoch: those are skipped by their epoch, exactly. The groups that said no
epoch (a generator not written with the toolkit) are counted per instance alone: an instance's
groups, in plan order, are skipped as the trainer's skips are, then as many more as finished,
and the next gets only its missing repeats. The plan's order is the first run's (same seed),
so the groups skipped are the ones it made.

``read_rows`` reads only a regular file, of at most ``MAX_FILE_BYTES``, in lines of at most
``MAX_LINE_BYTES``: a device (``/dev/zero``), a pipe or a runaway line is an error, not a
process that runs out of memory.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import stat
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from buffer.toolkit.types import Message, Sample


class DatasetError(ValueError):
    """A data set file that cannot be read; names the file and line."""


MAX_FILE_BYTES = 2**30
MAX_LINE_BYTES = 64 * 2**20


def read_rows(
    path: str | Path,
    *,
    max_bytes: int = MAX_FILE_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
    input_key: str = "prompt",
    label_key: str = "label",
) -> list[dict[str, Any]]:
    """The rows of a JSONL data set. ``input_key`` and ``label_key`` name the fields holding the
    prompt and the label (slime's ``--input-key``, ``--label-key``): they are read into ``prompt``
    and ``label``; a row without ``input_key`` that has a ``prompt`` keeps it."""
    rows: list[dict[str, Any]] = []
    total = 0
    with _open_regular(path, max_bytes) as lines:
        for number in itertools.count(1):
            line = lines.readline(max_line_bytes + 1)
            if not line:
                break
            total += len(line)
            if len(line) > max_line_bytes:
                raise DatasetError(f"{path}:{number}: a line longer than {max_line_bytes} bytes")
            if total > max_bytes:
                raise DatasetError(f"{path}: larger than {max_bytes} bytes")
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON: {exc}") from None
            if not isinstance(row, dict) or (input_key not in row and "prompt" not in row):
                named = "a prompt" if input_key == "prompt" else f"its prompt in {input_key!r}"
                raise DatasetError(f"{path}:{number}: a row must be an object with {named}")
            if input_key in row:
                row["prompt"] = row[input_key]
            if label_key in row:
                row["label"] = row[label_key]
            row.setdefault("instance_id", number - 1)
            rows.append(row)
    return rows


def _open_regular(path: str | Path, max_bytes: int) -> BinaryIO:
    """``path`` opened for reading if it is a regular file no larger than ``max_bytes``.

    Opened without blocking (a FIFO would wait for a writer) and checked on the descriptor,
    so what is read is what was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"{path}: not a regular file (a device, a pipe or a folder)")
        if info.st_size > max_bytes:
            raise DatasetError(f"{path}: {info.st_size} bytes, larger than {max_bytes}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


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
class ResumePoint:
    """What a job's earlier run produced, per instance id (matched on its text): ``finished``,
    how many groups that said no epoch finished (delivered, ready, discarded or set aside);
    ``held``, the repeat of each trajectory the open group holds (``None`` where a trajectory
    does not say); ``finished_epochs``, how many groups of each ``(instance id, epoch)``
    finished; ``held_epochs``, the epoch of an open group whose trajectories say it."""

    finished: Mapping[str, int] = field(default_factory=dict)
    held: Mapping[str, Sequence[int | None]] = field(default_factory=dict)
    finished_epochs: Mapping[tuple[str, int], int] = field(default_factory=dict)
    held_epochs: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResumePoint:
        """From the ``resume`` entry of a resumed job's data: ``{"finished_groups": [[id,
        count], ...], "open_groups": [[id, [repeat, ...]], ...], "finished_epochs": [[id, epoch,
        count], ...], "open_epochs": [[id, epoch], ...]}``, the last two optional (a buffer
        that counts no epochs sends none). ``finished_groups`` counts every group of an
        instance, those of ``finished_epochs`` too: what is left counts per instance."""
        finished: Counter[str] = Counter()
        for instance_id, count in data.get("finished_groups", ()):
            finished[str(instance_id)] += int(count)
        finished_epochs: Counter[tuple[str, int]] = Counter()
        for instance_id, epoch, count in data.get("finished_epochs", ()):
            finished_epochs[str(instance_id), _epoch(epoch)] += int(count)
        for (key, _), count in finished_epochs.items():
            finished[key] = max(0, finished[key] - count)
        held = {str(instance_id): list(repeats) for instance_id, repeats in data.get("open_groups", ())}
        held_epochs = {str(instance_id): _epoch(epoch) for instance_id, epoch in data.get("open_epochs", ())}
        return cls(+finished, held, finished_epochs, held_epochs)

    def missing_repeats(self, key: str, group_size: int) -> range | list[int] | None:
        """The repeats the instance's open group still needs; None when it has no open group."""
        held = self.held.get(key)
        if held is None:
            return None
        missing = max(0, group_size - len(held))
        known = {r for r in held if isinstance(r, int) and 0 <= r < group_size}
        candidates = [r for r in range(group_size) if r not in known]
        return candidates[len(candidates) - missing :] if missing else []


def _epoch(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a resume point's epoch must be a whole number >= 0, not {value!r:.50}")
    return value


@dataclass(frozen=True, slots=True)
class Plan:
    rows: Sequence[dict[str, Any]]
    num_repeat_per_sample: int = 1
    num_epoch: int = 1
    seed: int = 0
    shuffle: bool = True
    skip_instance_ids: Iterable[Any] = ()
    resume: ResumePoint | None = None
    #: (index, count): run only every ``count``-th group from the ``index``-th, the share of
    #: one of a job's ``count`` worker processes; every worker computes the same order.
    share: tuple[int, int] = (0, 1)

    def _groups(self) -> Iterator[tuple[int, dict[str, Any], Sequence[int]]]:
        """Each group to run (this worker's share of them): its epoch, its row, its repeats."""
        index, count = self.share
        for position, group in enumerate(self._all_groups()):
            if position % count == index:
                yield group

    def _all_groups(self) -> Iterator[tuple[int, dict[str, Any], Sequence[int]]]:
        # Ids may come back from the trainer as strings: match on the text.
        skips = Counter(str(instance_id) for instance_id in self.skip_instance_ids)
        progress = self.resume or ResumePoint()
        finished = Counter(progress.finished)
        finished_epochs = Counter(progress.finished_epochs)
        open_left = set(progress.held)
        every = range(self.num_repeat_per_sample)
        for epoch in range(self.num_epoch):
            order = list(self.rows)
            if self.shuffle:
                random.Random(f"{self.seed}|{epoch}").shuffle(order)
            for row in order:
                key = str(row["instance_id"])
                if skips[key] > 0:
                    skips[key] -= 1
                    continue
                if finished_epochs[key, epoch] > 0:  # this very group finished
                    finished_epochs[key, epoch] -= 1
                    continue
                held_epoch = progress.held_epochs.get(key) if key in open_left else None
                if held_epoch != epoch and finished[key] > 0:  # groups that said no epoch
                    finished[key] -= 1
                    continue
                if key in open_left and held_epoch in (None, epoch):
                    open_left.discard(key)
                    repeats = progress.missing_repeats(key, self.num_repeat_per_sample)
                    if repeats:
                        yield epoch, row, repeats
                    continue
                yield epoch, row, every

    def __iter__(self) -> Iterator[Sample]:
        for epoch, row, repeats in self._groups():
            messages = prompt_messages(row["prompt"])
            for repeat in repeats:
                yield self._sample(epoch, row, messages, repeat)

    def _sample(
        self, epoch: int, row: dict[str, Any], messages: Sequence[dict[str, Any]], repeat: int
    ) -> Sample:
        instance_id = row["instance_id"]
        return Sample(
            instance_id=instance_id,
            row=row,
            messages=[dict(message) for message in messages],
            epoch=epoch,
            repeat=repeat,
            seed=derive_seed(self.seed, instance_id, repeat, epoch),
        )

    def find(self, items: Iterable[tuple[int, str, int]]) -> list[Sample]:
        """The samples of these ``(epoch, instance id as text, repeat)``, as iteration makes
        them, without walking the epochs before them; items of no row are left out."""
        rows = {str(row["instance_id"]): row for row in self.rows}
        found = []
        for epoch, instance_id, repeat in items:
            row = rows.get(instance_id)
            if row is not None and 0 <= epoch < self.num_epoch:
                found.append(self._sample(epoch, row, prompt_messages(row["prompt"]), repeat))
        return found

    def epoch_sizes(self) -> tuple[dict[int, int], int]:
        """How many samples each epoch of the whole plan (every share) holds, without walking
        every epoch: those of the first epochs, where the skips and the resume point remove
        some, and what each later epoch holds (every row with all its repeats)."""
        walked_epochs = self._special_epochs()
        sizes = dict.fromkeys(range(walked_epochs), 0)
        if walked_epochs:
            for epoch, _, repeats in replace(self, num_epoch=walked_epochs)._all_groups():
                sizes[epoch] += len(repeats)
        return sizes, len(self.rows) * self.num_repeat_per_sample

    def _special_epochs(self) -> int:
        """How many of the first epochs the skips and the resume point can shorten: an epoch
        can skip or shorten a row only while one of them is left, so at most this many."""
        skips = Counter(str(instance_id) for instance_id in self.skip_instance_ids)
        progress = self.resume or ResumePoint()
        # Until an epoch with none of these, each epoch uses up one count or is named by one.
        special = sum(skips.values()) + sum(progress.finished.values()) + len(progress.held)
        special += len(progress.finished_epochs)
        # After it, only the epochs named shorten a row.
        named = [epoch for _, epoch in progress.finished_epochs] + list(progress.held_epochs.values())
        return min(self.num_epoch, max(special + 1 if special else 0, max(named, default=-1) + 1))

    def total(self) -> int:
        """How many samples iteration yields, without walking every epoch: once the skips and
        the resume point are used up (the first epoch or so), each later epoch holds every row
        with all its repeats, and only this worker's share of their positions is counted."""
        index, count = self.share
        rows, repeats = len(self.rows), self.num_repeat_per_sample
        if not rows:
            return 0
        walked_epochs = self._special_epochs()
        total, position = 0, 0
        if walked_epochs:
            walk = replace(self, num_epoch=walked_epochs, share=(0, 1))
            for group_position, (_, _, group_repeats) in enumerate(walk._all_groups()):
                if group_position % count == index:
                    total += len(group_repeats)
                position = group_position + 1
        plain_groups = rows * (self.num_epoch - walked_epochs)  # at positions [position, +plain_groups)
        return total + repeats * (
            _share_of(position + plain_groups, index, count) - _share_of(position, index, count)
        )


def _share_of(positions: int, index: int, count: int) -> int:
    """How many of the positions ``0 .. positions - 1`` are ``index`` modulo ``count``."""
    return max(0, (positions - index + count - 1) // count)
