"""CPU time the policy-server client spends per engine request, in this process.

The simulated policy server runs in its own process (its CPU is not counted); this process keeps
``--concurrency`` chat completions in flight through the toolkit's ``ChatClient`` and reports
the process's CPU time (user + system) per request: the client's own cost (building the body,
the HTTP exchange, reading the answer and its token ids), which in the service competes with
the HTTP API, the generator and its rewards.

    .venv/bin/python bench/engine_client_cpu.py                       # 4,000 requests, 256 in flight
    .venv/bin/python bench/engine_client_cpu.py --requests 8000 --concurrency 512 --capture
"""

from __future__ import annotations

import argparse
import asyncio
import time

import common

from buffer.toolkit.llm import ChatClient

PROMPT = [{"role": "user", "content": "What is 12 + 30?"}]


async def run(url: str, requests: int, concurrency: int, capture: bool) -> tuple[float, float]:
    async with ChatClient(url, capture=capture, max_connections=concurrency) as llm:
        await asyncio.gather(*(llm.complete(PROMPT, max_tokens=64) for _ in range(concurrency)))  # warm
        slots = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with slots:
                await llm.complete(PROMPT, max_tokens=64)

        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.gather(*(one() for _ in range(requests)))
        return time.process_time() - cpu, time.monotonic() - wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--latency-s", type=float, default=0.05, help="the simulated engine's latency")
    parser.add_argument("--capture", action="store_true", help="ask for token ids and logprobs")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the median is reported")
    args = parser.parse_args()
    extra = ["--latency-mean-s", str(args.latency_s), "--seed", "0"]
    results = []
    with common.Server(module="buffer.simulator", extra_args=extra) as simulator:
        for _ in range(args.repeat):
            cpu_s, wall_s = asyncio.run(run(simulator.url, args.requests, args.concurrency, args.capture))
            per_request_us = 1e6 * cpu_s / args.requests
            results.append(per_request_us)
            print(
                f"{args.requests} requests, {args.concurrency} in flight: {per_request_us:.0f} us CPU per "
                f"request, {args.requests / wall_s:.0f} requests/s"
            )
    results.sort()
    print(f"median: {results[len(results) // 2]:.0f} us CPU per engine request")


if __name__ == "__main__":
    main()
