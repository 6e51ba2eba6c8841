"""Generator throughput and memory: a rollout against the simulated policy server.

Two processes, as the issue describes: the simulated server (latency L per request) and the
rollout buffer running the math generator in-process with C trajectories in flight. This
script plays the trainer, draining ``/get_rollout_data`` every second, and reports:

- trajectories per second written to the buffer over a steady window, against the ideal C/L;
- the buffer process's resident memory while C trajectories are in flight (the generator
  runs in it; the trainer keeps what is buffered small).

- with ``--capture both``, the same run with token capture off and on (the generator asks the
  engine for token ids and logprobs, reads them and writes them as the trajectory's ``turns``),
  and what capture costs in throughput.

    .venv/bin/python bench/generator_throughput.py                    # C=256, L=0.5 s; then C=1000
    .venv/bin/python bench/generator_throughput.py --concurrency 256 --latency-s 0.5 --seconds 20
    .venv/bin/python bench/generator_throughput.py --concurrency 256 --capture both
    .venv/bin/python bench/generator_throughput.py --concurrency 64 --latency-s 0.2 --abort-rate 0.1
    .venv/bin/python bench/generator_throughput.py --concurrency 256 --engines 3   # a pool of three
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import common
import httpx

DATA = common.REPO / "generator" / "data" / "math.jsonl"


def measure(
    concurrency: int,
    latency_s: float,
    jitter_s: float,
    warmup_s: float,
    seconds: float,
    capture: bool = True,
    abort_rate: float = 0.0,
    engines: int = 1,
) -> dict[str, Any]:
    latency = ["--latency-mean-s", str(latency_s), "--latency", "uniform" if jitter_s else "fixed"]
    latency += ["--latency-jitter-s", str(jitter_s), "--abort-rate", str(abort_rate)]
    simulators = [
        common.Server(module="buffer.simulator", extra_args=[*latency, "--seed", str(seed)])
        for seed in range(engines)
    ]
    with contextlib.ExitStack() as stack:
        for simulator in simulators:
            stack.enter_context(simulator)
        server = stack.enter_context(common.Server())
        client = stack.enter_context(httpx.Client(base_url=server.url, timeout=60.0))
        urls = [simulator.url for simulator in simulators]
        payload = {
            "task_type": "math",
            "input_file": str(DATA),
            "remote_engine_url": urls[0] if engines == 1 else urls,
            "num_repeat_per_sample": "8",
            "num_process": str(concurrency),
            "num_epoch": "100000",
            "sampling_params": {"max_tokens": 256, "temperature": 1.0},
            "capture": capture,
        }
        client.post("/start_rollout", json=payload).raise_for_status()

        def written() -> int:
            total: int = common.buffer_stats(client)["total_written"]
            client.post("/get_rollout_data", json={"task_type": "math"})  # the trainer drains
            return total

        deadline = time.monotonic() + warmup_s
        while time.monotonic() < deadline:
            written()
            time.sleep(1.0)
        start_count, start_time = written(), time.monotonic()
        rss = []
        while time.monotonic() - start_time < seconds:
            time.sleep(1.0)
            written()
            rss.append(common.rss_bytes(server.pid))
        count = written() - start_count
        elapsed = time.monotonic() - start_time
    rate = count / elapsed
    ideal = concurrency / latency_s
    return {
        "rate": rate,
        "ideal": ideal,
        "share": rate / ideal,
        "rss_max": max(rss),
        "rss_median": sorted(rss)[len(rss) // 2],
    }


def main() -> None:
    common.raise_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[256, 1000])
    parser.add_argument("--latency-s", type=float, default=0.5, help="mean latency of a request")
    parser.add_argument(
        "--jitter-s", type=float, default=0.0, help="uniform latency in mean +- jitter (0: fixed)"
    )
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--capture",
        choices=["on", "off", "both"],
        default="on",
        help="token capture (ids and logprobs asked for and written); both: off, then on, and the cost",
    )
    parser.add_argument(
        "--abort-rate", type=float, default=0.0, help="share of answers the engine aborts (continued)"
    )
    parser.add_argument(
        "--engines", type=int, default=1, help="simulated engines: more than one makes a pool"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each mode, interleaved (off, on, off, on, ...)"
    )
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.capture] * args.repeat
    rows = []
    for concurrency in args.concurrency:
        rates: dict[bool, list[float]] = {}
        for capture in modes:
            result = measure(
                concurrency,
                args.latency_s,
                args.jitter_s,
                args.warmup_s,
                args.seconds,
                capture,
                abort_rate=args.abort_rate,
                engines=args.engines,
            )
            rates.setdefault(capture, []).append(result["rate"])
            rows.append(
                [
                    concurrency,
                    args.latency_s,
                    "on" if capture else "off",
                    f"{result['rate']:.0f}/s",
                    f"{result['ideal']:.0f}/s",
                    f"{100 * result['share']:.0f}%",
                    f"{result['rss_max'] / 2**20:.0f} MiB",
                ]
            )
            print(
                f"C={concurrency} L={args.latency_s}s capture {rows[-1][2]}: {rows[-1][3]} "
                f"of ideal {rows[-1][4]} ({rows[-1][5]}); buffer+generator RSS max {rows[-1][6]}",
                flush=True,
            )
        if len(rates) == 2:
            on, off = statistics.median(rates[True]), statistics.median(rates[False])
            print(f"C={concurrency}: capture costs {100 * (1 - on / off):.1f}% of throughput (medians)")
    print(common.table(["C", "L (s)", "capture", "trajectories", "ideal C/L", "share", "RSS max"], rows))


if __name__ == "__main__":
    main()
