"""bench/hot_path.py's tokens mode writes whole groups both ways a client does: one trajectory a
``POST /buffer/write``, or a group a ``POST /buffer/write_batch`` as ``HttpSink`` sends it (a JSON
list); every group written finishes and is read, also by the service whose token lists' checks
``--checks free`` makes free (``bench/unchecked_buffer.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.support.bench import bench_module


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    with bench_module("hot_path") as module:
        yield module


@pytest.mark.parametrize(("write", "checks"), [("batch", "real"), ("single", "real"), ("batch", "free")])
def test_tokens_mode_writes_every_group_and_reads_it(bench: ModuleType, write: str, checks: str) -> None:
    args = bench.build_parser().parse_args(["--mode", "tokens", "--groups", "3", "--read-every", "2"])
    row = bench.tokens_run(args, 100, write, checks)
    assert (row["write"], row["checks"]) == (write, checks)
    assert row["tokens"] == 100
    assert row["trajectories"] == row["served"] == 3 * 8


def test_batch_is_the_default_first(bench: ModuleType) -> None:
    assert bench.build_parser().parse_args([]).write.split(",") == ["batch", "single"]
