"""Server memory per buffered trajectory, against the trajectory's JSON size (figure 5).

A fresh server (``--group-size 8``) takes a small warm-up write, then its resident memory
(``VmRSS`` in /proc/<pid>/status) is read; then ``--count`` (default 100,000) ~2 KB trajectories
are written through ``POST /buffer/write_batch``, each with its own ``instance_id`` by default,
so they sit in incomplete (pending) groups. Once the server is idle, RSS is read again:

    bytes per trajectory = (RSS after - RSS before) / count
    ratio                = bytes per trajectory / mean compact JSON size of a trajectory

The peak (``VmHWM``) is printed too. ``--per-group k`` writes k trajectories per instance
(k < group size keeps the groups pending; k = 8 makes them ready groups instead).

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/memory.py                    # 100,000 pending trajectories
    .venv/bin/python bench/memory.py --count 200000 --per-group 4
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import common
import httpx
import orjson


def measure(
    args: argparse.Namespace, make: Callable[[str, int], dict[str, Any]], count: int, warmup: int
) -> dict[str, Any]:
    """A fresh server (``args``: ``group_size``, ``server_args``, ``batch_size``, ``settle``)
    given ``warmup`` trajectories, then ``count`` more, ``make(prefix, n)`` each: its RSS before
    and after them, its peak, and what each cost against its JSON."""
    tag = uuid.uuid4().hex[:8]
    json_bytes = 0

    def trajectories(prefix: str, count: int, measure: bool) -> Iterator[dict[str, Any]]:
        nonlocal json_bytes
        for n in range(count):
            trajectory = make(f"{prefix}-{tag}", n)
            if measure:
                json_bytes += len(orjson.dumps(trajectory))
            yield trajectory

    with (
        common.Server(args.group_size, common.server_args(args.server_args)) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        common.fill(client, trajectories("warm", warmup, False), args.batch_size)
        time.sleep(args.settle)
        before = common.rss_bytes(server.pid)
        start = time.perf_counter()
        written = common.fill(client, trajectories("fill", count, True), args.batch_size)
        fill_s = time.perf_counter() - start
        time.sleep(args.settle)
        after = common.rss_bytes(server.pid)
        peak = common.rss_bytes(server.pid, "VmHWM")
        stats = common.buffer_stats(client)["task"]
    per_item = (after - before) / count
    mean_json = json_bytes / count
    return {
        "rss_before": before,
        "rss_after": after,
        "rss_peak": peak,
        "bytes_per_trajectory": per_item,
        "json_bytes": mean_json,
        "ratio": per_item / mean_json,
        "written": written,
        "fill_s": fill_s,
        "stats": stats,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"memory: {args.count:,} ~{args.size} B trajectories, {args.per_group} per instance, "
        f"group size {args.group_size}"
    )

    def make(prefix: str, n: int) -> dict[str, Any]:
        group, member = divmod(n, args.per_group)
        return common.make_trajectory(
            f"{prefix}-{group}", f"{prefix}-u{n}", member / max(1, args.per_group), args.size, seed=n
        )

    result = measure(args, make, args.count, args.warmup)
    before, after, peak = result["rss_before"], result["rss_after"], result["rss_peak"]
    stats = result["stats"]
    print(
        f"  wrote {result['written']:,} in {result['fill_s']:.1f}s; "
        f"pending groups {stats['pending_groups']:,}, pending items {stats['pending_items']:,}, "
        f"ready groups {stats['ready_groups']:,}"
    )
    print(
        f"  RSS before {before / 2**20:,.1f} MiB, after {after / 2**20:,.1f} MiB "
        f"(+{(after - before) / 2**20:,.1f} MiB), peak {peak / 2**20:,.1f} MiB"
    )
    print(
        f"  {result['bytes_per_trajectory']:,.0f} bytes of RSS per trajectory; mean JSON size "
        f"{result['json_bytes']:,.0f} bytes; ratio {result['ratio']:.2f}x"
    )
    return {
        name: result[name]
        for name in ("rss_before", "rss_after", "rss_peak", "bytes_per_trajectory", "json_bytes", "ratio")
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=100_000, help="trajectories buffered (default 100,000)")
    parser.add_argument("--per-group", type=int, default=1, help="trajectories per instance_id (default 1)")
    parser.add_argument("--warmup", type=int, default=2000, help="trajectories written before the baseline")
    parser.add_argument("--batch-size", type=int, default=1000, help="trajectories per write_batch request")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle before each RSS reading")
    parser.add_argument("--size", type=int, default=common.DEFAULT_TRAJECTORY_BYTES, help="trajectory bytes")
    common.add_server_arguments(parser)
    return parser


def main() -> None:
    common.raise_on_sigterm()
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()
