"""What the recording gateway adds to each proxied call, per dialect, under concurrent load.

Two processes: the stand-in engine that answers with token ids in vLLM's shape
(``tests.support.loopback_engine``, no model, answers in well under a millisecond) and the rollout
buffer. ``--concurrency`` agents make calls back to back: straight to the engine's chat completions
(with the same capture fields the gateway adds, so the engine does the same work; before the rest
and again after), then, for each of ``--dialects``, through fresh sessions in that dialect: OpenAI
chat completions (``chat``), Anthropic Messages (``messages``) and OpenAI Responses
(``responses``), each translated by the gateway into the same chat completion. A dialect's cost
per call is the difference of its median (and p99) from the direct one; the service's CPU time
per proxied call (what bounds the calls a core can proxy) is printed too. ``token`` (token mode)
needs an engine with a token route (``/generate`` or ``/v1/completions``) and a tokenizer: the
loopback engine serves chat completions only, so it is reported as skipped. With ``--data-dir``
every call is journaled and acknowledged once on disk (``--durability`` as the service's);
``--json`` prints the figures as one JSON object instead.

    .venv/bin/python bench/gateway.py                         # 8 agents, 2,000 calls per dialect
    .venv/bin/python bench/gateway.py --concurrency 1 --calls 1000 --dialects chat,messages --json
    .venv/bin/python bench/gateway.py --concurrency 32 --calls 4000 --data-dir /tmp/gw
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import common
import orjson

SYSTEM = "You are a helpful assistant."
QUESTION = "Compute 12 * (3 + 4) and explain the steps briefly."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CAPTURE = {"logprobs": True, "return_token_ids": True, "return_prompt_token_ids": True}
DIALECTS = ("chat", "messages", "responses", "token")
TOKEN_ROUTES = ("/generate", "/v1/completions")


def chat_call(session: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 64}
    return f"{session['base_url']}/chat/completions", body, {"authorization": f"Bearer {session['api_key']}"}


def messages_call(session: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    # as the Anthropic SDK sends it: the key as x-api-key
    body = {
        "model": "policy",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 64,
    }
    return f"{session['base_url']}/messages", body, {"x-api-key": session["api_key"]}


def responses_call(session: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    # stored, as by default: the gateway keeps each response for previous_response_id
    body = {"model": "policy", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 64}
    return f"{session['base_url']}/responses", body, {"authorization": f"Bearer {session['api_key']}"}


CALLS: dict[str, Callable[[dict[str, Any]], tuple[str, dict[str, Any], dict[str, str]]]] = {
    "chat": chat_call,
    "messages": messages_call,
    "responses": responses_call,
}


async def timed_calls(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], calls: int
) -> list[float]:
    content = orjson.dumps(body)
    headers = {**headers, "content-type": "application/json"}
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        async with client.post(url, data=content, headers=headers) as response:
            await response.read()
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
    return latencies


async def token_route(client: aiohttp.ClientSession, engine_url: str) -> str | None:
    """The engine's token route, if it serves one (a route it lacks answers 404)."""
    for route in TOKEN_ROUTES:
        async with client.post(f"{engine_url}{route}", json={}) as response:
            if response.status != 404:
                return route
    return None


async def run(
    engine_url: str, buffer_url: str, concurrency: int, calls: int, buffer_pid: int, dialects: list[str]
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        per_agent = max(1, calls // concurrency)
        direct_body = {"model": "policy", "messages": MESSAGES, "max_tokens": 64, "stream": False, **CAPTURE}
        direct_url = f"{engine_url}/v1/chat/completions"

        async def direct_round() -> list[float]:
            rounds = [timed_calls(client, direct_url, direct_body, {}, per_agent) for _ in range(concurrency)]
            return [latency for lists in await asyncio.gather(*rounds) for latency in lists]

        await direct_round()  # warm-up
        results: dict[str, Any] = {"direct": await direct_round(), "skipped": {}}
        for dialect in dialects:
            if dialect == "token":
                route = await token_route(client, engine_url)
                reason = (
                    f"the engine serves {route}, but this benchmark has no tokenizer for token-mode sessions"
                    if route
                    else "the loopback engine serves no token route (/generate, /v1/completions)"
                )
                results["skipped"]["token"] = reason
                continue
            sessions = []
            for index in range(concurrency):
                body = {"task_type": "bench", "instance_id": index, "remote_engine_url": engine_url}
                async with client.post(f"{buffer_url}/sessions", json=body) as response:
                    response.raise_for_status()
                    sessions.append((await response.json())["data"])
            requests = [CALLS[dialect](session) for session in sessions]
            warm = [timed_calls(client, url, body, headers, 5) for url, body, headers in requests]
            await asyncio.gather(*warm)
            cpu_before = common.cpu_seconds(buffer_pid)
            timed = [timed_calls(client, url, body, headers, per_agent) for url, body, headers in requests]
            latencies = [latency for lists in await asyncio.gather(*timed) for latency in lists]
            cpu_s = common.cpu_seconds(buffer_pid) - cpu_before
            results[dialect] = {"latencies": latencies, "cpu_s": cpu_s}
            for s in sessions:
                async with client.post(
                    f"{buffer_url}/sessions/{s['session_id']}/end", json={"discard": True}
                ):
                    pass
        results["direct"] += await direct_round()  # before and after: load that drifts weighs on both
        return results


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values) * 1000, "p99_ms": quantile(values, 0.99) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000, help="calls each way, per dialect")
    parser.add_argument(
        "--dialects",
        default="chat,messages,responses,token",
        help=f"comma-separated, of {', '.join(DIALECTS)} (default: all)",
    )
    parser.add_argument("--data-dir", default=None, help="journal every call (default: no data folder)")
    parser.add_argument("--durability", choices=["sync", "async"], default="sync")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    dialects = [name.strip() for name in args.dialects.split(",") if name.strip()]
    unknown = sorted(set(dialects) - set(DIALECTS))
    if unknown or not dialects:
        parser.error(
            f"--dialects: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(DIALECTS)}"
        )
    extra: list[str] = []
    temporary = None
    if args.data_dir == "tmp":
        temporary = tempfile.TemporaryDirectory()
        args.data_dir = temporary.name
    if args.data_dir:
        extra += ["--data-dir", args.data_dir, "--durability", args.durability]
    engine = common.Server(module="tests.support.loopback_engine")
    with engine, common.Server(extra_args=extra) as server:
        results = asyncio.run(run(engine.url, server.url, args.concurrency, args.calls, server.pid, dialects))
    if temporary is not None:
        temporary.cleanup()
    direct = summary(results["direct"])
    report: dict[str, Any] = {
        "concurrency": args.concurrency,
        "calls": len(results["direct"]) // 2,  # per dialect; the direct ones twice
        "cpus": common.CPUS,
        "data_dir": bool(args.data_dir),
        "direct": direct,
        "dialects": {},
        "skipped": results["skipped"],
    }
    for dialect in dialects:
        if dialect not in results:
            continue
        figures = summary(results[dialect]["latencies"])
        report["dialects"][dialect] = {
            **figures,
            "added_median_ms": figures["median_ms"] - direct["median_ms"],
            "added_p99_ms": figures["p99_ms"] - direct["p99_ms"],
            "cpu_us_per_call": results[dialect]["cpu_s"] / len(results[dialect]["latencies"]) * 1e6,
        }
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    print(f"{report['calls']} calls each way, {args.concurrency} agents in parallel, on {common.CPUS} CPUs")
    print(f"{'engine directly':>20}: median {direct['median_ms']:.2f} ms, p99 {direct['p99_ms']:.2f} ms")
    for dialect, figures in report["dialects"].items():
        print(
            f"{'through ' + dialect:>20}: median {figures['median_ms']:.2f} ms,"
            f" p99 {figures['p99_ms']:.2f} ms;"
            f" adds {figures['added_median_ms']:.2f} ms (median), {figures['added_p99_ms']:.2f} ms (p99);"
            f" service CPU {figures['cpu_us_per_call']:.0f} us a call"
        )
    for dialect, reason in report["skipped"].items():
        print(f"{dialect:>20}: skipped: {reason}")


if __name__ == "__main__":
    main()
