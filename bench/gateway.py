"""What the recording gateway adds to each proxied chat completion, under concurrent load.

Two processes: the stand-in engine that answers with token ids in vLLM's shape
(``tests.support.loopback_engine``, no model, answers in well under a millisecond) and the rollout
buffer. ``--concurrency`` agents each open a session and make chat completions back to back,
first straight to the engine (with the same capture fields the gateway adds, so the engine
does the same work), then through their sessions. The gateway's cost per call is the
difference of the medians; the p90s, and the service's CPU time per proxied call (what
bounds the calls a core can proxy), are printed too. With ``--data-dir`` every call is
journaled and acknowledged once on disk (``--durability`` as the service's).

    .venv/bin/python bench/gateway.py                         # 8 agents, 2,000 calls each way
    .venv/bin/python bench/gateway.py --concurrency 32 --calls 4000 --data-dir /tmp/gw
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import common
import httpx
from httpx_aiohttp import AiohttpTransport

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Compute 12 * (3 + 4) and explain the steps briefly."},
]
CAPTURE = {"logprobs": True, "return_token_ids": True, "return_prompt_token_ids": True}


async def timed_calls(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], calls: int
) -> list[float]:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 64}
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        response = await client.post(url, json=body, headers=headers)
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
    return latencies


async def run(
    engine_url: str, buffer_url: str, concurrency: int, calls: int, buffer_pid: int
) -> dict[str, list[float]]:
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=concurrency * 2))
    async with httpx.AsyncClient(transport=transport, timeout=60.0, trust_env=False) as client:
        sessions = []
        for index in range(concurrency):
            body = {"task_type": "bench", "instance_id": index, "remote_engine_url": engine_url}
            opened = (await client.post(f"{buffer_url}/sessions", json=body)).json()["data"]
            sessions.append(opened)
        per_agent = max(1, calls // concurrency)
        direct_url = f"{engine_url}/v1/chat/completions"

        async def direct() -> list[float]:
            # the same fields the gateway sends
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 64, "stream": False, **CAPTURE}
            latencies = []
            for _ in range(per_agent):
                started = time.perf_counter()
                response = await client.post(direct_url, json=body)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()
            return latencies

        await asyncio.gather(*(direct() for _ in range(concurrency)))  # warm-up
        results: dict[str, list[float]] = {"direct": [], "gateway": []}
        for lists in await asyncio.gather(*(direct() for _ in range(concurrency))):
            results["direct"] += lists
        gateway = [
            timed_calls(
                client,
                f"{s['base_url']}/chat/completions",
                {"authorization": f"Bearer {s['api_key']}"},
                per_agent,
            )
            for s in sessions
        ]
        cpu_before = common.cpu_seconds(buffer_pid)
        for lists in await asyncio.gather(*gateway):
            results["gateway"] += lists
        results["cpu_s"] = [common.cpu_seconds(buffer_pid) - cpu_before]
        for s in sessions:
            await client.post(f"{buffer_url}/sessions/{s['session_id']}/end", json={"discard": True})
        return results


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--data-dir", default=None, help="journal every call (default: no data folder)")
    parser.add_argument("--durability", choices=["sync", "async"], default="sync")
    args = parser.parse_args()
    extra: list[str] = []
    temporary = None
    if args.data_dir == "tmp":
        temporary = tempfile.TemporaryDirectory()
        args.data_dir = temporary.name
    if args.data_dir:
        extra += ["--data-dir", args.data_dir, "--durability", args.durability]
    engine = common.Server(module="tests.support.loopback_engine")
    with engine, common.Server(extra_args=extra) as server:
        results: dict[str, Any] = asyncio.run(
            run(engine.url, server.url, args.concurrency, args.calls, server.pid)
        )
    direct, gateway = results["direct"], results["gateway"]
    print(f"{len(gateway)} calls each way, {args.concurrency} agents in parallel, on {common.CPUS} CPUs")
    for name, values in (("engine directly", direct), ("through the gateway", gateway)):
        median_ms, p90_ms = statistics.median(values) * 1000, quantile(values, 0.9) * 1000
        print(f"{name:>20}: median {median_ms:.2f} ms, p90 {p90_ms:.2f} ms")
    added_ms = (statistics.median(gateway) - statistics.median(direct)) * 1000
    print(f"the gateway adds {added_ms:.2f} ms at the median per proxied call")
    cpu_us = results["cpu_s"][0] / len(gateway) * 1e6
    print(f"the service's CPU per proxied call: {cpu_us:.0f} us")
    if temporary is not None:
        temporary.cleanup()


if __name__ == "__main__":
    main()
