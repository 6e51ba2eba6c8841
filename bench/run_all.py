"""Run every benchmark in this folder with its defaults and print one summary table.

    figure 1  POST /buffer/write per second, wrk -c16, each write a new group   target >= 2,000/s
    figure 2  the same with 50,000 groups already pending                       target within 15% of 1
    figure 3  POST /buffer/write_batch trajectories per second, batches of 1,000 target >= 20,000/s
    figure 4  POST /get_rollout_data returning 1,000 ready groups of 8          target < 100 ms (httpx median)
    figure 5  server RSS per buffered ~2 KB trajectory / its JSON size          target <= 2x

Each benchmark starts and stops its own servers (see the scripts for details and options).
The table only reports numbers against the targets; nothing fails.

Run (from the repository root, with the dev venv; about 2-3 minutes in all):

    .venv/bin/python bench/run_all.py
    .venv/bin/python bench/run_all.py --runs 5 --duration 20
    .venv/bin/python bench/run_all.py --only write_batch read_latency
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common
import memory
import read_latency
import write_batch
import write_rate

BENCHMARKS = ("write_rate", "write_batch", "read_latency", "memory")


def verdict(met: bool) -> str:
    return "yes" if met else "NO"


def main() -> None:
    common.raise_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--runs", type=int, default=3, help="wrk runs per write_rate mode (default 3)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    parser.add_argument("--server-args", default="", help="extra flags for buffer.py, for every benchmark")
    args = parser.parse_args()
    extra = ["--server-args", args.server_args]

    results: dict[str, Any] = {}
    started = time.monotonic()
    for name in args.only:
        print(f"\n=== {name} ===")
        if name == "write_rate":
            argv = [*extra, "--runs", str(args.runs), "--duration", str(args.duration)]
            results[name] = write_rate.run(write_rate.build_parser().parse_args(argv))
        elif name == "write_batch":
            results[name] = write_batch.run(write_batch.build_parser().parse_args(extra))
        elif name == "read_latency":
            results[name] = read_latency.run(read_latency.build_parser().parse_args(extra))
        elif name == "memory":
            results[name] = memory.run(memory.build_parser().parse_args(extra))

    rows: list[tuple[str, str, str, str]] = []
    if "write_rate" in results:
        rate = results["write_rate"]
        empty, prefilled = rate["empty"], rate["prefilled"]
        runs = [f"{r['rate']:,.0f}" for r in rate["runs"] if r["mode"] == "empty"]
        rows.append(
            (
                "1 write/s (wrk -c16)",
                f"median {empty['median']:,.0f}/s (runs {', '.join(runs)})",
                ">= 2,000/s",
                verdict(empty["median"] >= 2000),
            )
        )
        runs = [f"{r['rate']:,.0f}" for r in rate["runs"] if r["mode"] == "prefilled"]
        ratio = rate["prefilled_ratio"]
        rows.append(
            (
                "2 write/s, 50k pending",
                f"median {prefilled['median']:,.0f}/s ({(ratio - 1) * 100:+.1f}%; runs {', '.join(runs)})",
                "within 15% of 1",
                verdict(abs(ratio - 1) <= 0.15),
            )
        )
    if "write_batch" in results:
        batch = results["write_batch"]
        rows.append(
            (
                "3 write_batch traj/s",
                f"median {batch['rate']:,.0f}/s (runs {', '.join(f'{r:,.0f}' for r in batch['rates'])})",
                ">= 20,000/s",
                verdict(batch["rate"] >= 20_000),
            )
        )
    if "read_latency" in results:
        read = results["read_latency"]
        httpx_total, raw_total = read["httpx"]["total_ms"], read["raw"]["total_ms"]
        rows.append(
            (
                "4 get_rollout_data 1k groups",
                f"httpx min {httpx_total['min']:.0f} / median {httpx_total['median']:.0f} ms; "
                f"raw socket {raw_total['min']:.0f} / {raw_total['median']:.0f} ms",
                "< 100 ms",
                verdict(httpx_total["median"] < 100),
            )
        )
    if "memory" in results:
        mem = results["memory"]
        rows.append(
            (
                "5 RSS per trajectory",
                f"{mem['bytes_per_trajectory']:,.0f} B vs {mem['json_bytes']:,.0f} B of JSON: "
                f"{mem['ratio']:.2f}x",
                "<= 2x",
                verdict(mem["ratio"] <= 2.0),
            )
        )
    print(f"\n=== summary ({time.monotonic() - started:.0f}s) ===")
    print(common.table(("figure", "measured", "target", "met"), rows))


if __name__ == "__main__":
    main()
