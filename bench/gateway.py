"""What the recording gateway adds to each proxied call, per dialect, under concurrent load.

Two processes: the stand-in engine that answers with token ids in vLLM's shape
(``tests.support.loopback_engine``, no model, answers in well under a millisecond) and the rollout
buffer. ``--concurrency`` agents make calls back to back: straight to the engine's chat completions
(with the same capture fields the gateway adds, so the engine does the same work; before the rest
and again after), then, for each of ``--dialects``, through fresh sessions in that dialect: OpenAI
chat completions (``chat``), Anthropic Messages (``messages``) and OpenAI Responses
(``responses``), each translated by the gateway into the same chat completion, and legacy
completions (``completions``: a prompt string, sent to the engine's own ``/v1/completions``). A dialect's cost
per call is the difference of its median (and p99) from the direct one; the service's CPU time
per proxied call (what bounds the calls a core can proxy) is printed too. ``token`` (token mode)
needs an engine with a token route (``/generate`` or ``/v1/completions``) and a tokenizer whose
template it renders: the loopback engine has none, so it is reported as skipped. With ``--data-dir``
every call is journaled and acknowledged once on disk (``--durability`` as the service's);
``--json`` prints the figures as one JSON object instead.

    .venv/bin/python bench/gateway.py                         # 8 agents, 2,000 calls per dialect
    .venv/bin/python bench/gateway.py --concurrency 1 --calls 1000 --dialects chat,messages --json
    .venv/bin/python bench/gateway.py --concurrency 32 --calls 4000 --data-dir /tmp/gw
    .venv/bin/python bench/gateway.py --processes 1,2 --concurrency 16 --calls 4000   # rollout-buffer gateway

``--processes 1,2`` measures gateway processes (``rollout-buffer gateway``) instead, chat only: the
buffer hands the sessions out (``--gateway-url``), the agents run in ``--agent-processes`` processes
of their own, and each count prints its calls/s and the CPU a call of the service, the gateway
processes, the engine and the agents.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import common
import httpx
import orjson

SYSTEM = "You are a helpful assistant."
QUESTION = "Compute 12 * (3 + 4) and explain the steps briefly."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CAPTURE = {"logprobs": True, "return_token_ids": True, "return_prompt_token_ids": True}
DIALECTS = ("chat", "messages", "responses", "completions", "token")
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


def completions_call(session: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    # legacy completions: one prompt string, to the engine's own /v1/completions
    body = {"model": "policy", "prompt": f"{SYSTEM}\n\nQuestion: {QUESTION}\nAnswer:", "max_tokens": 64}
    return f"{session['base_url']}/completions", body, {"authorization": f"Bearer {session['api_key']}"}


CALLS: dict[str, Callable[[dict[str, Any]], tuple[str, dict[str, Any], dict[str, str]]]] = {
    "chat": chat_call,
    "messages": messages_call,
    "responses": responses_call,
    "completions": completions_call,
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


# -- across processes (--processes): gateway processes feeding the one buffer ----------------


def gateway_command(python: str, port: int, buffer_url: str, extra: list[str]) -> list[str]:
    command = [python, "-m", "buffer", "gateway", "--buffer-url", buffer_url, "--host", "127.0.0.1"]
    return [*command, "--port", str(port), "--log-level", "warning", *extra]


def agents(buffer_url: str, engine_url: str, count: int, calls: int, first: int, go: Any, out: Any) -> None:
    """One agent process: ``count`` agents, each in a fresh session opened at the buffer (handed
    to a gateway process), ``calls`` calls each once ``go`` is set; sends back the latencies."""

    async def run_agents() -> tuple[list[float], float, float, float]:
        connector = aiohttp.TCPConnector(limit=count * 2)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=120)
        ) as client:
            sessions = []
            for index in range(count):
                body = {"task_type": "bench", "instance_id": first + index, "remote_engine_url": engine_url}
                async with client.post(f"{buffer_url}/sessions", json=body) as response:
                    response.raise_for_status()
                    sessions.append((await response.json())["data"])
            requests = [chat_call(session) for session in sessions]
            await asyncio.gather(*[timed_calls(client, u, b, h, 5) for u, b, h in requests])
            await asyncio.to_thread(go.wait)
            started, cpu_s = time.perf_counter(), time.process_time()
            timed = [timed_calls(client, u, b, h, calls) for u, b, h in requests]
            latencies = [latency for lists in await asyncio.gather(*timed) for latency in lists]
            ended, cpu_s = time.perf_counter(), time.process_time() - cpu_s
            for session in sessions:
                async with client.post(
                    f"{buffer_url}/sessions/{session['session_id']}/end", json={"discard": True}
                ):
                    pass
            return latencies, started, ended, cpu_s

    out.send(asyncio.run(run_agents()))


def run_processes(args: argparse.Namespace, counts: list[int]) -> dict[str, Any]:
    """For each count of gateway processes: throughput and CPU per call, agents in processes of their own."""
    import multiprocessing
    import subprocess

    context = multiprocessing.get_context("fork")  # before any event loop in this process
    report: dict[str, Any] = {"concurrency": args.concurrency, "cpus": common.CPUS, "runs": {}}
    per_agent = max(1, args.calls // args.concurrency)
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(common.Server(module="tests.support.loopback_engine"))
        for count in counts:
            ports = [common.free_port() for _ in range(count)]
            gateways = [f"http://127.0.0.1:{port}" for port in ports]
            extra = [arg for url in gateways for arg in ("--gateway-url", url)]
            with common.Server(extra_args=extra) as buffer, contextlib.ExitStack() as running:
                processes = []
                for index, port in enumerate(ports):
                    data = ["--data-dir", f"{args.data_dir}/{count}-{index}"] if args.data_dir else []
                    log = running.enter_context(tempfile.TemporaryFile())
                    command = gateway_command(sys.executable, port, buffer.url, data)
                    process = subprocess.Popen(command, cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT)
                    running.callback(process.wait)
                    running.callback(process.terminate)
                    processes.append(process)
                for url in gateways:
                    _wait(f"{url}/health")
                go = context.Event()
                pipes, workers = [], []
                share = [args.concurrency // args.agent_processes] * args.agent_processes
                for index in range(args.concurrency % args.agent_processes):
                    share[index] += 1
                for index, agents_here in enumerate(share):
                    receive, send = context.Pipe(duplex=False)
                    first = sum(share[:index])
                    worker = context.Process(
                        target=agents, args=(buffer.url, engine.url, agents_here, per_agent, first, go, send)
                    )
                    worker.start()
                    pipes.append(receive)
                    workers.append(worker)
                time.sleep(0.5)  # the agents' sessions opened and warmed (they wait for go)
                pids = {
                    "service": [buffer.pid],
                    "gateways": [p.pid for p in processes],
                    "engine": [engine.pid],
                }
                before = {name: sum(common.cpu_seconds(pid) for pid in group) for name, group in pids.items()}
                go.set()
                results = [pipe.recv() for pipe in pipes]
                after = {name: sum(common.cpu_seconds(pid) for pid in group) for name, group in pids.items()}
                for worker in workers:
                    worker.join()
            latencies = [latency for lists, *_ in results for latency in lists]
            elapsed_s = max(result[2] for result in results) - min(result[1] for result in results)
            calls = len(latencies)
            report["runs"][str(count)] = {
                "calls": calls,
                "calls_per_s": calls / elapsed_s,
                **summary(latencies),
                **{f"{name}_cpu_us_per_call": (after[name] - before[name]) / calls * 1e6 for name in pids},
                "agents_cpu_us_per_call": sum(result[3] for result in results) / calls * 1e6,
            }
    return report


def _wait(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def print_processes(report: dict[str, Any]) -> None:
    print(f"{report['concurrency']} agents, on {report['cpus']} CPUs")
    one = report["runs"].get("1", {}).get("calls_per_s")
    for count, run in report["runs"].items():
        scale = f" ({run['calls_per_s'] / one:.2f}x one)" if one else ""
        print(
            f"{count} gateway process(es): {run['calls_per_s']:.0f} calls/s{scale},"
            f" median {run['median_ms']:.2f} ms, p99 {run['p99_ms']:.2f} ms; CPU a call:"
            f" service {run['service_cpu_us_per_call']:.0f} us,"
            f" gateways {run['gateways_cpu_us_per_call']:.0f} us,"
            f" engine {run['engine_cpu_us_per_call']:.0f} us, agents {run['agents_cpu_us_per_call']:.0f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000, help="calls each way, per dialect")
    parser.add_argument(
        "--dialects",
        default="chat,messages,responses,completions,token",
        help=f"comma-separated, of {', '.join(DIALECTS)} (default: all)",
    )
    parser.add_argument("--data-dir", default=None, help="journal every call (default: no data folder)")
    parser.add_argument("--durability", choices=["sync", "async"], default="sync")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument(
        "--processes",
        default=None,
        help="gateway processes (rollout-buffer gateway) instead of the service's own gateway: counts to "
        "measure, e.g. 1,2 (chat; throughput and CPU a call)",
    )
    parser.add_argument(
        "--agent-processes", type=int, default=2, help="with --processes: processes the agents run in"
    )
    args = parser.parse_args()
    if args.processes:
        counts = [int(count) for count in args.processes.split(",")]
        report = run_processes(args, counts)
        if args.json:
            print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        else:
            print_processes(report)
        return
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
