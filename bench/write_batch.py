"""Batch write throughput: trajectories per second through ``POST /buffer/write_batch`` (figure 3).

One httpx client posts ``--batches`` batches of ``--batch-size`` ~2 KB trajectories, one batch
at a time, to a fresh server (``--group-size 8``). Every trajectory has a fresh ``instance_id``
and ``uid`` by default, so each opens a new group that stays pending; ``--per-group 8`` instead
writes whole groups (8 trajectories per instance, varied rewards), so every group finishes and
goes through the read pipeline (the default hooks) during the write.

The request bodies are encoded before the clock starts, so client-side JSON encoding is not
measured; the time is from the first request sent to the last response read. A few warm-up
batches go first. Each of ``--runs`` runs has a fresh server; the median rate is the result.
The script checks with ``/buffer/stats`` that everything landed.

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/write_batch.py                       # 3 runs of 30 batches of 1,000
    .venv/bin/python bench/write_batch.py --batches 50 --batch-size 2000
    .venv/bin/python bench/write_batch.py --per-group 8         # whole groups, hooks included
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

import common
import httpx
import orjson


def make_batches(args: argparse.Namespace, count: int, tag: str) -> list[bytes]:
    rewards = [i / max(1, args.per_group - 1) for i in range(args.per_group)]
    batches = []
    n = 0
    for _ in range(count):
        batch = []
        for _ in range(args.batch_size):
            group, member = divmod(n, args.per_group)
            batch.append(
                common.make_trajectory(f"{tag}-{group}", f"{tag}-u{n}", rewards[member], args.size, seed=n)
            )
            n += 1
        batches.append(orjson.dumps(batch))
    return batches


def one_run(args: argparse.Namespace, warm: list[bytes], batches: list[bytes]) -> dict[str, Any]:
    """One fresh server: the warm-up batches, then the timed ones."""
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    with (
        common.Server(args.group_size, common.server_args(args.server_args)) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        for body in warm:
            client.post("/buffer/write_batch", content=body, headers=headers).raise_for_status()
        before = common.buffer_stats(client)
        cpu_before = common.cpu_seconds(server.pid)
        machine_before = common.machine_cpu()
        start = time.perf_counter()
        for body in batches:
            sent = time.perf_counter()
            response = client.post("/buffer/write_batch", content=body, headers=headers)
            latencies.append(time.perf_counter() - sent)
            response.raise_for_status()
        elapsed = time.perf_counter() - start
        server_cpu = common.cpu_seconds(server.pid) - cpu_before
        machine = common.machine_shares(machine_before, common.machine_cpu())
        after = common.buffer_stats(client)
    total = args.batches * args.batch_size
    ms = common.summary([latency * 1000 for latency in latencies])
    return {
        "rate": total / elapsed,
        "seconds": elapsed,
        "batch_ms": ms,
        "landed": after["total_written"] - before["total_written"],
        "duplicates": after["duplicates"] - before["duplicates"],
        "pending_groups": after["task"].get("pending_groups", 0),
        "ready_groups": after["task"].get("ready_groups", 0),
        "server_cpu": server_cpu / elapsed,
        "steal": machine["steal"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.batch_size % args.per_group:
        raise SystemExit("--batch-size must be a multiple of --per-group")
    print(
        f"write_batch: {args.batches} batches of {args.batch_size:,} ~{args.size} B trajectories, "
        f"{args.per_group} per group, group size {args.group_size}, {args.runs} run(s)"
    )
    tag = uuid.uuid4().hex[:8]
    warm = make_batches(args, args.warmup, f"warm-{tag}")
    batches = make_batches(args, args.batches, f"run-{tag}")
    body_mb = sum(map(len, batches)) / 1e6
    total = args.batches * args.batch_size
    runs = []
    for index in range(args.runs):
        result = one_run(args, warm, batches)
        ms = result["batch_ms"]
        print(
            f"  run {index + 1}: {total:,} trajectories ({body_mb:.1f} MB of JSON) "
            f"in {result['seconds']:.2f}s, {result['rate']:,.0f} trajectories/s; "
            f"per batch min {ms['min']:.1f} / median {ms['median']:.1f} / max {ms['max']:.1f} ms"
        )
        print(
            f"         server CPU {result['server_cpu']:.2f} cores, machine steal {result['steal']:.0%}; "
            f"landed {result['landed']:,} (duplicates {result['duplicates']}), "
            f"pending groups {result['pending_groups']:,}, ready groups {result['ready_groups']:,}"
        )
        runs.append(result)
    rates = [r["rate"] for r in runs]
    summary = common.summary(rates)
    median_batch = statistics.median(r["batch_ms"]["median"] for r in runs)
    print(
        f"median {summary['median']:,.0f} trajectories/s "
        f"(runs: {', '.join(f'{rate:,.0f}' for rate in rates)}); median batch {median_batch:.1f} ms"
    )
    return {"rate": summary["median"], "rates": rates, "batch_ms_median": median_batch, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=30, help="measured batches per run (default 30)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each on a fresh server (default 3)")
    parser.add_argument("--batch-size", type=int, default=1000, help="trajectories per batch (default 1000)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured batches first (default 3)")
    parser.add_argument("--per-group", type=int, default=1, help="trajectories per instance_id (default 1)")
    parser.add_argument("--size", type=int, default=common.DEFAULT_TRAJECTORY_BYTES, help="trajectory bytes")
    common.add_server_arguments(parser)
    return parser


def main() -> None:
    common.raise_on_sigterm()
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()
