"""The open groups' table (``buffer.core.open_table``): a capture is O(1) and stays as it was
while writes go on, the view is always what one ``OrderedDict`` would hold, and what changed
during a capture is folded back a bounded slice at a time; the keys touched since a capture are
its last ones, in order (what an incremental snapshot rewrites)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from buffer.core.open_table import OpenTable


def oldest(model: OrderedDict[int, tuple[int, int]]) -> tuple[int, tuple[int, int]] | None:
    return next(iter(model.items()), None)


@pytest.mark.parametrize("seed", range(20))
def test_the_table_acts_as_one_ordered_dict_through_captures_and_folds(seed: int) -> None:
    rng = random.Random(seed)
    table, model = OpenTable(), OrderedDict[int, tuple[int, int]]()
    table.track(True)
    snapshot: list[int] = []  # the keys a store holds, in order, after the deltas of each capture
    captured: tuple[OrderedDict[int, tuple[int, int]], list[tuple[int, tuple[int, int]]]] | None = None
    for step in range(3000):
        action = rng.random()
        key = rng.randrange(60)
        if action < 0.45:  # a write: the group becomes the newest
            table.put(key, (key, step))
            model[key] = (key, step)
            model.move_to_end(key)
        elif action < 0.6:  # a group finishes
            if key in model:
                assert table.pop(key) == model.pop(key)
            else:
                with pytest.raises(KeyError):
                    table.pop(key)
        elif action < 0.7:  # a timeout: the oldest finishes
            first = oldest(model)
            assert table.oldest() == first
            if first is not None:
                assert table.pop(first[0]) == model.pop(first[0])
        elif action < 0.76 and captured is None and table.folded:
            groups, touched = table.capture()
            captured = (groups, list(model.items()))
            assert touched is not None
            present = [key for key in touched if key in groups]
            tail = list(groups)[len(groups) - len(present) :]  # the touched ones: the last ones
            assert set(tail) == set(present)
            snapshot = [key for key in snapshot if key not in touched] + tail
            assert snapshot == list(groups)
        elif action < 0.82 and captured is not None:  # the capture is read, then released
            groups, then = captured
            assert list(groups.items()) == then
            table.release()
            captured = None
        elif action < 0.9:
            table.fold(budget=rng.randrange(1, 5))
        assert table.get(key) == model.get(key)
        assert list(table) == list(model)
        assert list(table.values()) == list(model.values())
        assert len(table) == len(model)
    if captured is not None:
        assert list(captured[0].items()) == captured[1]
        table.release()
    while table.fold(budget=3):
        pass
    assert table.folded
    assert list(table.groups.items()) == list(model.items())


def test_a_fold_takes_slices_of_what_changed_not_of_the_groups() -> None:
    table = OpenTable()
    for key in range(10_000):
        table.put(key, (key, 0))
    groups, _ = table.capture()
    for key in range(10):
        table.put(key, (key, 1))  # written again during the capture
    table.pop(20)  # finished during it
    assert len(groups) == 10_000
    assert groups[0] == (0, 0)
    table.release()
    folds = 1
    while table.fold(budget=4):
        folds += 1
    assert folds == 6  # 11 replaced or finished deleted, 10 moved: 4 a slice
    assert table.groups is groups  # the same dict: one the collector was told to skip stays so
    assert list(table)[-10:] == list(range(10))
    assert 20 not in list(table)
