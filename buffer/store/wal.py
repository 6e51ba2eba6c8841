"""A check of the database's write-ahead log (``buffer.sqlite3-wal``), read before SQLite opens it.

SQLite's recovery replays the WAL's frames up to the first one that fails its checksum and
drops everything after it without a word: 16 flipped bytes in the middle of the WAL lose
every commit written after them. Read here in Python, before the database is opened (a
connection closed after recovery would checkpoint and delete the WAL, and the evidence
with it), the WAL says whether that happened.

The format (sqlite.org/fileformat2.html#walformat): a 32-byte header (magic, version, page
size, checkpoint sequence, two salts, a checksum of its first 24 bytes), then frames of a
24-byte header (page number, the database's size in pages for the last frame of a commit
and 0 otherwise, the two salts, a checksum) and one page. Each frame's checksum runs on from
the one before it over the frame header's first 8 bytes and the page, so each frame can be
checked on its own from the checksum stored in the frame before it.

What counts as damage: a frame that fails, followed by frames of this WAL (its salts) that
pass and end **two or more** commits. A crash in the middle of writing a commit leaves its
frames half on disk (a torn tail, or after a power loss frames written out of order), but
only ever of the one commit being written, which nobody was told had been kept: that is
SQLite's normal recovery, and the start-up goes on. Frames left from before the WAL was last
restarted carry other salts and are not this WAL's. A lost commit of the last two (a torn
tail of a commit that *was* acknowledged, say) is what the commit count beside the database
(``commits``) catches.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_HEADER = struct.Struct(">IIIIIIII")  # magic, version, page size, checkpoint, salts, checksum
_FRAME_HEADER = struct.Struct(">IIIIII")  # page, commit size, salts, checksum
_MAGIC = 0x377F0682  # | 1: the checksums are of big-endian words
_MASK = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class WalDamage:
    """Where the WAL stops verifying, and what SQLite would drop after it."""

    path: Path
    frame: int  # the first frame that fails (counting from 0)
    offset: int
    frames: int  # the frames in the file
    lost_commits: int  # commits after it in frames that verify

    def __str__(self) -> str:
        return (
            f"{self.path}: frame {self.frame} of {self.frames} (byte {self.offset}) fails its checksum, "
            f"and {self.lost_commits} commits were written after it: SQLite would drop them all"
        )


def _checksum(data: bytes, big_endian: bool, s1: int, s2: int) -> tuple[int, int]:
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    pairs = iter(words)
    for first, second in zip(pairs, pairs, strict=True):
        s1 = (s1 + first + s2) & _MASK
        s2 = (s2 + second + s1) & _MASK
    return s1, s2


def check(path: Path) -> WalDamage | None:
    """The damage in the WAL at ``path``, or None (no WAL, an empty one, a sound one, or one
    whose only loss is the commit a crash cut short)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, _, page_size, _, salt1, salt2, check1, check2 = _HEADER.unpack_from(data)
    if magic & ~1 != _MAGIC or page_size < 512 or page_size & (page_size - 1):
        return None  # no WAL SQLite would read: it starts an empty one, and quick_check judges the rest
    big_endian = bool(magic & 1)
    if _checksum(data[:24], big_endian, 0, 0) != (check1, check2):
        return None  # SQLite ignores a WAL whose header fails: nothing of it was ever replayed
    frame_size = _FRAME_HEADER.size + page_size
    frames = (len(data) - _HEADER.size) // frame_size
    previous = (check1, check2)  # the checksum stored before each frame
    first_bad: int | None = None
    lost = 0
    for index in range(frames):
        offset = _HEADER.size + index * frame_size
        _, commit, frame_salt1, frame_salt2, sum1, sum2 = _FRAME_HEADER.unpack_from(data, offset)
        body = data[offset : offset + 8] + data[offset + _FRAME_HEADER.size : offset + frame_size]
        sound = (frame_salt1, frame_salt2) == (salt1, salt2) and _checksum(body, big_endian, *previous) == (
            sum1,
            sum2,
        )
        previous = (sum1, sum2)
        if not sound:
            if first_bad is None:
                first_bad = index
            continue
        if first_bad is not None and commit:
            lost += 1
    if first_bad is None or lost < 2:
        return None
    return WalDamage(path, first_bad, _HEADER.size + first_bad * frame_size, frames, lost)
