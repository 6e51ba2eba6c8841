"""A task's open groups, oldest write first, that a snapshot can capture in O(1) and read
without the buffer's lock while writes go on.

The groups live in one ``OrderedDict`` (``groups``), in order of their last write: a write
moves its group to the end, the groups that time out are at the front. A capture (``capture``)
hands out that dict itself and stops changing it: until ``release``, a write goes to a second
dict (``since``) and the group it replaces in ``groups`` is marked ``gone``; a finished group is
marked ``gone`` too. So ``groups`` stays what it was at the capture, to be read (and encoded)
outside the lock, and the table's view is the groups not gone, then ``since``: still oldest
write first, since every group in ``since`` was written after every one left in ``groups``.

After ``release`` the capture is folded back (``fold``) a bounded slice per call, each under the
buffer's lock: the gone groups deleted from ``groups``, then ``since`` moved to its end. That
costs O(changes made during the capture), never O(groups). ``groups`` keeps its identity, so a
dict the service froze out of the collector's way (``gc.freeze``) stays frozen.

For incremental snapshots the table also notes the keys put or popped since the last capture
(``touched``, when ``track`` turned it on): ``capture`` hands them out with the groups. The
groups a capture holds that were touched since the one before are then its last ones, in
order, since a put moves its key to the end and the others keep their order: a snapshot
writes those again and deletes the rows of the touched keys gone, and leaves the rest.

The values are the task's stored groups (``task.Stored``): tuples, never changed in place, so
a captured one stays as it was; a group past 64 records keeps a list the task copies before
changing it while ``capturing`` (``TaskBuffer.add``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Changes folded back per call of ``fold`` (each under the buffer's lock: a millisecond or so).
FOLD_SLICE = 2000
#: Touched keys noted at most beyond the table's size: past both, a snapshot costs as much whole.
TOUCHED_LIMIT = 1_000_000


class OpenTable(Generic[K]):
    """Key → stored group, oldest write first; not thread-safe (the buffer's lock serialises it),
    except the captured dict, which no call changes until ``release``."""

    __slots__ = ("_front", "_head", "capturing", "gone", "groups", "since", "touched", "tracking")

    def __init__(self) -> None:
        self.groups: OrderedDict[K, Any] = OrderedDict()
        self.since: OrderedDict[K, Any] = OrderedDict()  # written while captured, or folding
        self.gone: set[K] = set()  # keys of ``groups`` whose value no longer counts
        self.capturing = False
        self._front: Iterator[K] | None = None  # over the captured ``groups``: the oldest
        self._head: K | None = None
        #: Keys put or popped since the last capture; None: not tracked (or too many to track).
        self.touched: set[K] | None = None
        self.tracking = False

    # -- the view --------------------------------------------------------------------

    def get(self, key: K) -> Any:
        if self.since:
            group = self.since.get(key)
            if group is not None:
                return group
        if self.gone and key in self.gone:
            return None
        return self.groups.get(key)

    def __len__(self) -> int:
        return len(self.groups) - len(self.gone) + len(self.since)

    def __iter__(self) -> Iterator[K]:
        """The keys, oldest write first."""
        gone = self.gone
        yield from (key for key in self.groups if key not in gone)
        yield from self.since

    def values(self) -> Iterator[Any]:
        gone = self.gone
        yield from (group for key, group in self.groups.items() if key not in gone)
        yield from self.since.values()

    def oldest(self) -> tuple[K, Any] | None:
        """The key and group written least recently, or None."""
        if not self.gone:
            for key, group in self.groups.items():
                return key, group
        elif self.capturing:  # skip what is gone once: ``groups`` does not change meanwhile
            if self._front is None:
                self._front = iter(self.groups)
                self._head = next(self._front, None)
            while self._head is not None and self._head in self.gone:
                self._head = next(self._front, None)
            if self._head is not None:
                return self._head, self.groups[self._head]
        else:  # folding: the gone are deleted within a few slices
            for key, group in self.groups.items():
                if key not in self.gone:
                    return key, group
        for key, group in self.since.items():
            return key, group
        return None

    # -- changes -----------------------------------------------------------------------

    def put(self, key: K, group: Any, *, touch: bool = True) -> None:
        """Store ``group`` as the newest write (``touch``: a change a snapshot has not seen;
        not a group restored from one)."""
        touched = self.touched
        if touched is not None and touch:
            touched.add(key)
            if len(touched) > TOUCHED_LIMIT:
                self._touch(key)
        if self.capturing or self.since:
            if key in self.groups and key not in self.gone:
                self.gone.add(key)
            self.since[key] = group
            self.since.move_to_end(key)
            return
        if self.gone:
            self.gone.discard(key)
        self.groups[key] = group
        self.groups.move_to_end(key)

    def pop(self, key: K) -> Any:
        """Remove and return the group of ``key``; KeyError if there is none."""
        if self.touched is not None:
            self._touch(key)
        if self.since and key in self.since:
            return self.since.pop(key)
        if (self.gone and key in self.gone) or key not in self.groups:
            raise KeyError(key)
        if self.capturing:
            self.gone.add(key)
            return self.groups[key]
        return self.groups.pop(key)

    def _touch(self, key: K) -> None:
        touched = self.touched
        assert touched is not None
        touched.add(key)
        if len(touched) > TOUCHED_LIMIT and len(touched) > len(self.groups):
            self.touched = None  # as costly as the whole table: the next snapshot is whole

    def track(self, on: bool) -> None:
        """Note the keys touched from now on (``touched``), or stop (None)."""
        self.tracking = on
        self.touched = set() if on else None

    # -- captures ------------------------------------------------------------------------

    def capture(self) -> tuple[OrderedDict[K, Any], set[K] | None]:
        """The groups as they are now, unchanged until ``release``, and the keys touched since
        the last capture (None: not tracked); tracking starts afresh. O(1); the table must be
        folded (``folded``) first."""
        assert self.folded, "a capture still being read or folded back"
        self.capturing = True
        touched = self.touched
        if self.tracking:
            self.touched = set()
        return self.groups, touched

    def release(self) -> None:
        """The capture is read: ``groups`` may change again (``fold`` brings it up to date)."""
        self.capturing = False
        self._front = self._head = None

    @property
    def folded(self) -> bool:
        return not self.capturing and not self.gone and not self.since

    def fold(self, budget: int | None = None) -> bool:
        """Fold up to ``budget`` (``FOLD_SLICE``) changes made during a capture back into
        ``groups``; True if more are left."""
        if self.capturing:
            return False
        budget = FOLD_SLICE if budget is None else budget
        groups, gone, since = self.groups, self.gone, self.since
        while budget > 0 and gone:
            del groups[gone.pop()]
            budget -= 1
        while budget > 0 and since and not gone:  # a key of ``since`` is in ``groups`` only if gone
            key, group = since.popitem(last=False)
            groups[key] = group
            budget -= 1
        return bool(gone or since)
