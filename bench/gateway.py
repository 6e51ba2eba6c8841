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
processes, the engine and the agents, and what the machine's cores allow at those costs (the
arithmetic: each gateway process proxies at most one core's worth, all the processes together at
most the machine's). The engine and the agents are made as cheap as this machine allows, so the
gateway processes have the cores: ``--engine raw`` (the default there) answers every request with
one vLLM-shaped answer kept ready, from a bare asyncio server in this file (no framework, the body
unread: a few tens of us a request), ``--engine loopback`` with the stand-in above; ``--agents raw``
(the default) call on the toolkit's HTTP/1.1 transport (``buffer.toolkit.http11``), ``--agents
aiohttp`` on aiohttp's client. Cheaper still, in C: ``--engine nginx`` (nginx, one worker, the
raw engine's answer from its ``return``) and ``--agents wrk`` (the sessions opened at the buffer
as above, then wrk for ``--duration`` seconds, a thread a gateway process on its port,
``--concurrency`` connections among them, each thread's calls spread over the sessions its
process owns, each call's last user message numbered so none repeats another; every call wrk
counts is checked to be recorded in the sessions); skipped, said so, where either is missing.
``--repeat R`` runs the counts R times interleaved and prints the ratio of calls/s, each round's
and their median. ``--stream`` asks for streamed answers; ``--session-calls K``
makes each session K calls, opened, rewarded and ended (written) at the buffer within the time
measured, as a harness does (0, the default: one session an agent for the whole run).

``--breakdown`` measures one gateway process's CPU a call stage by stage, its chat route cut down
(``serve_staged_gateway``: a canned answer; the session found and the body read; the engine asked,
its bytes passed back; through the toolkit's engine client; the whole route, also streamed and
journaled), then what a session's open, reward and end cost the gateway process and the buffer.
Run in a worktree of an earlier commit, it measures that commit's code (it runs the tree it is in).

    .venv/bin/python bench/gateway.py --processes 1,2 --concurrency 16 --calls 8000
    .venv/bin/python bench/gateway.py --processes 1,2 --concurrency 16 --calls 8000 --session-calls 10
    .venv/bin/python bench/gateway.py --processes 1,2 --engine nginx --agents wrk --concurrency 64 --repeat 3
    .venv/bin/python bench/gateway.py --breakdown --concurrency 16 --calls 8000 --sessions 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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


def agents(
    buffer_url: str,
    engine_url: str,
    count: int,
    calls: int,
    first: int,
    go: Any,
    out: Any,
    client: str,
    stream: bool,
    session_calls: int = 0,
) -> None:
    """One agent process: ``count`` agents, each in a fresh session opened at the buffer (handed
    to a gateway process), ``calls`` calls each once ``go`` is set, on ``client`` (``raw``: the
    toolkit's HTTP/1.1 transport; ``aiohttp``); sends back the latencies. ``session_calls``: each
    agent's sessions make that many calls each, every one opened, rewarded and ended at the buffer
    (its trajectory written) within the time measured; 0: one session an agent, discarded after."""

    async def run_agents() -> tuple[list[float], float, float, float]:
        from buffer.toolkit.http11 import Http11Transport

        connector = aiohttp.TCPConnector(limit=count * 2)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=120)
        ) as session_client:
            transport = Http11Transport(max_connections=count * 2, timeout_s=120.0)

            async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
                if client == "raw":
                    reply = await transport.post(
                        url, orjson.dumps(body), {"content-type": "application/json"}
                    )
                    status, content = reply.status, reply.body
                else:
                    async with session_client.post(url, json=body) as response:
                        status, content = response.status, await response.read()
                if status != 200:
                    raise RuntimeError(f"HTTP {status} from {url}: {content[:300]!r}")
                answer: dict[str, Any] = orjson.loads(content)
                return answer

            async def opened(
                instance_id: str,
            ) -> tuple[dict[str, Any], tuple[str, dict[str, Any], dict[str, str]]]:
                body = {"task_type": "bench", "instance_id": instance_id, "remote_engine_url": engine_url}
                session = (await post(f"{buffer_url}/sessions", body))["data"]
                url, call, headers = chat_call(session)
                return session, (url, {**call, "stream": True} if stream else call, headers)

            calling = (
                raw_calls(transport) if client == "raw" else functools.partial(timed_calls, session_client)
            )

            async def in_sessions(index: int) -> list[float]:
                latencies: list[float] = []
                for number in range(-(-calls // session_calls)):
                    session, (url, body, headers) = await opened(f"q{number}")  # the agents' n-th: a group
                    latencies += await calling(url, body, headers, min(session_calls, calls - len(latencies)))
                    await post(f"{buffer_url}/sessions/{session['session_id']}/end", {"reward": index % 2})
                return latencies

            sessions, requests = [], []
            for index in range(count):
                session, request = await opened(f"agent-{first + index}")
                sessions.append(session)
                requests.append(request)
            await asyncio.gather(*[calling(u, b, h, 5) for u, b, h in requests])
            await asyncio.to_thread(go.wait)
            started, cpu_s = time.perf_counter(), time.process_time()
            if session_calls:
                timed = [in_sessions(first + index) for index in range(count)]
            else:
                timed = [calling(u, b, h, calls) for u, b, h in requests]
            latencies = [latency for lists in await asyncio.gather(*timed) for latency in lists]
            ended, cpu_s = time.perf_counter(), time.process_time() - cpu_s
            for session in sessions:
                await post(f"{buffer_url}/sessions/{session['session_id']}/end", {"discard": True})
            await transport.aclose()
            return latencies, started, ended, cpu_s

    out.send(run_in_loop(run_agents()))


def raw_calls(transport: Any) -> Callable[..., Any]:
    """``timed_calls`` on the toolkit's HTTP/1.1 transport: an agent as cheap as Python makes one."""

    async def calling(url: str, body: dict[str, Any], headers: dict[str, str], calls: int) -> list[float]:
        content = orjson.dumps(body)
        headers = {**headers, "content-type": "application/json"}
        latencies = []
        for _ in range(calls):
            started = time.perf_counter()
            reply = await transport.post(url, content, headers)
            latencies.append(time.perf_counter() - started)
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status} from {url}: {reply.text[:300]}")
        return latencies

    return calling


def run_in_loop(main: Any) -> Any:
    """``main`` on uvloop where it is installed (the gateway's and the service's loop)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run(main)
    return uvloop.run(main)


# -- the raw engine: one answer kept ready, from a bare asyncio server -------------------------

RAW_PROMPT_IDS = list(range(1, 40))
RAW_OUTPUT_IDS = [1072, 1101, 1108, 1108, 1111, 1046, 2]


def raw_answer() -> bytes:
    """A vLLM chat completion with the capture's fields: what the gateway reads of every answer."""
    logprobs = [{"token": "t", "logprob": -0.1, "top_logprobs": []} for _ in RAW_OUTPUT_IDS]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello."},
        "logprobs": {"content": logprobs},
        "finish_reason": "stop",
        "token_ids": RAW_OUTPUT_IDS,
    }
    answer = {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [choice],
        "usage": {"prompt_tokens": len(RAW_PROMPT_IDS), "completion_tokens": len(RAW_OUTPUT_IDS)},
        "prompt_token_ids": RAW_PROMPT_IDS,
    }
    return orjson.dumps(answer)


def serve_raw_engine(host: str, port: int) -> None:
    """Answer every request with ``raw_answer()`` (``GET /health``: ``{}``), kept alive, until
    SIGTERM: the cheapest engine this machine runs, so the gateway processes get the cores."""
    import signal

    import httptools

    answer = raw_answer()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    reply = head % len(answer) + answer
    health = head % 2 + b"{}"

    class Engine(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.get = False

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_headers_complete(self) -> None:
            self.get = self.parser.get_method() == b"GET"

        def on_message_complete(self) -> None:
            self.transport.write(health if self.get else reply)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
        server = await loop.create_server(Engine, host, port, backlog=1024)
        async with server:
            await stop

    run_in_loop(main())


class RawEngine:
    """``serve_raw_engine`` in a process of its own (``url``, ``pid``), stopped on leaving."""

    def __enter__(self) -> RawEngine:
        import subprocess

        port = common.free_port()
        self.url = f"http://{common.HOST}:{port}"
        command = [sys.executable, __file__, "--serve-raw-engine", str(port)]
        self.process = subprocess.Popen(command, cwd=common.REPO)
        self.pid = self.process.pid
        _wait(f"{self.url}/health")
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(10)


# -- an engine and agents in C (--engine nginx, --agents wrk): what Python cannot make as cheap ---


def nginx_binary() -> str | None:
    """nginx on the PATH or where Debian puts it (/usr/sbin, off a user's PATH)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


NGINX_CONF = """daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            default_type application/json;
            return 200 '{answer}';
        }}
    }}
}}
"""


class NginxEngine:
    """nginx (one worker) answering every request with ``raw_answer()``, from a temporary prefix,
    stopped on leaving: an engine that costs a few us a call. ``pids``: the master and its worker."""

    def __enter__(self) -> NginxEngine:
        import subprocess

        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        answer = raw_answer().decode()
        if any(character in answer for character in "'\\$"):  # nginx's quoting and variables
            raise ValueError("the raw answer cannot go into nginx's return as it is")
        port = common.free_port()
        self.url = f"http://{common.HOST}:{port}"
        self.prefix = tempfile.TemporaryDirectory(prefix="bench-nginx-")
        prefix = self.prefix.name
        conf = Path(prefix, "nginx.conf")
        conf.write_text(NGINX_CONF.format(prefix=prefix, host=common.HOST, port=port, answer=answer))
        command = [binary, "-p", prefix, "-c", str(conf), "-e", f"{prefix}/error.log"]
        self.process = subprocess.Popen(command, cwd=prefix)
        _wait(f"{self.url}/health")
        self.pids = [self.process.pid, *children(self.process.pid)]
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()  # SIGTERM: nginx's fast shutdown, the worker too
        self.process.wait(10)
        self.prefix.cleanup()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


#: wrk's script: each thread on one gateway process's port (``setup``), its calls spread over the
#: sessions that process owns, each call's last user message made unique; ``done`` prints the counts.
WRK_SCRIPT = """
local ports = {ports}
local sessions = {sessions}
local head, tail = [==[{head}]==], [==[{tail}]==]
local tag = "{tag}"
local threads = 0

function setup(thread)
    threads = threads + 1
    thread.addr = wrk.lookup("{host}", tostring(ports[threads]))[1]
    thread:set("index", threads)
end

local mine, host, headers
local counter = 0

function init(args)
    mine = sessions[index]
    host = "{host}:" .. ports[index]
end

function request()
    counter = counter + 1
    local session = mine[counter % #mine + 1]
    local body = head .. tag .. "-" .. index .. "-" .. counter .. tail
    return wrk.format("POST", session[1], {{
        ["Host"] = host,
        ["Content-Type"] = "application/json",
        ["Authorization"] = "Bearer " .. session[2],
    }}, body)
end

function done(summary, latency, requests)
    local errors = summary.errors
    io.write(string.format(
        'WRK {{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, '
        .. '"status": %d, "timeout": %d, "median_us": %d, "p99_us": %d}}\\n',
        summary.requests, summary.duration, errors.connect, errors.read, errors.write,
        errors.status, errors.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_script(sessions: list[dict[str, Any]], ports: list[int], tag: str) -> str:
    """``WRK_SCRIPT`` for ``sessions`` (opened at the buffer, each owned by the gateway process
    its ``base_url`` names), one wrk thread a port of ``ports``; ``tag`` makes this run's calls
    differ from another run's in the same sessions."""
    marker = "@@call@@"
    messages = [MESSAGES[0], {"role": "user", "content": f"{QUESTION} ({marker})"}]
    head, tail = (
        orjson.dumps({"model": "policy", "messages": messages, "max_tokens": 64}).decode().split(marker)
    )
    owned: list[list[str]] = [[] for _ in ports]
    for session in sessions:
        address = urlsplit(session["base_url"])
        path = f"{address.path}/chat/completions"
        owned[ports.index(address.port)].append(f'{{"{path}", "{session["api_key"]}"}}')
    if not all(owned):
        raise RuntimeError("a gateway process owns none of the sessions: more agents than that")
    lua = "{" + ", ".join("{" + ", ".join(paths) + "}" for paths in owned) + "}"
    return WRK_SCRIPT.format(
        ports="{" + ", ".join(map(str, ports)) + "}",
        sessions=lua,
        head=head,
        tail=tail,
        tag=tag,
        host=common.HOST,
    )


def run_wrk(script: str, ports: list[int], connections: int, duration_s: int) -> dict[str, Any]:
    """wrk, one thread a gateway port and ``connections`` among them, ``duration_s`` seconds:
    its counts (``done``) and its CPU seconds (``cpu_s``, from the rusage of its exit)."""
    import subprocess

    with tempfile.NamedTemporaryFile("w", suffix=".lua") as file:
        file.write(script)
        file.flush()
        command = [
            "wrk", "-t", str(len(ports)), "-c", str(connections), "-d", f"{duration_s}s",
            "--timeout", "60s", "-s", file.name, f"http://{common.HOST}:{ports[0]}/",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        with process.stdout:
            output = process.stdout.read().decode()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in output.splitlines() if line.startswith("WRK ")]
    if process.returncode or not lines:
        raise RuntimeError(f"wrk failed ({process.returncode}): {output[-2000:]}")
    counts: dict[str, Any] = orjson.loads(lines[-1][4:])
    counts["cpu_s"] = usage.ru_utime + usage.ru_stime
    return counts


def run_processes(args: argparse.Namespace, counts: list[int]) -> dict[str, Any]:
    """For each count of gateway processes, ``--repeat`` rounds (the counts interleaved, so load
    that drifts weighs on each): throughput and CPU per call, agents in processes of their own;
    and what the cores allow at those costs. ``runs``: each count's median round by calls/s."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # before any event loop in this process
    report: dict[str, Any] = {
        "concurrency": args.concurrency,
        "cpus": common.CPUS,
        "engine": args.engine,
        "agents": args.agents,
        "agent_processes": args.agent_processes,
        "stream": args.stream,
        "session_calls": args.session_calls,
        "duration_s": args.duration if args.agents == "wrk" else None,
        "runs": {},
        "rounds": [],
    }
    with contextlib.ExitStack() as stack:
        if args.engine == "raw":
            engine: Any = stack.enter_context(RawEngine())
            engine_pids = [engine.pid]
        elif args.engine == "nginx":
            engine = stack.enter_context(NginxEngine())
            engine_pids = engine.pids
        else:
            engine = stack.enter_context(common.Server(module="tests.support.loopback_engine"))
            engine_pids = [engine.pid]
        for _ in range(args.repeat):
            runs = {str(count): one_count(args, count, engine.url, engine_pids, context) for count in counts}
            report["rounds"].append(runs)
    for count in map(str, counts):
        ranked = sorted((runs[count] for runs in report["rounds"]), key=lambda run: run["calls_per_s"])
        report["runs"][count] = ranked[(len(ranked) - 1) // 2]
    return report


def one_count(
    args: argparse.Namespace, count: int, engine_url: str, engine_pids: list[int], context: Any
) -> dict[str, Any]:
    """One run with ``count`` gateway processes feeding a fresh buffer: the agents in processes of
    their own (``--agents raw``, ``aiohttp``) or wrk (``--agents wrk``)."""
    import subprocess

    ports = [common.free_port() for _ in range(count)]
    gateways = [f"http://127.0.0.1:{port}" for port in ports]
    extra = [arg for url in gateways for arg in ("--gateway-url", url)]
    with common.Server(extra_args=extra) as buffer, contextlib.ExitStack() as running:
        processes = []
        for index, port in enumerate(ports):
            data = ["--data-dir", f"{args.data_dir}/{count}-{index}"] if args.data_dir else []
            if args.data_dir:
                data += ["--durability", args.durability]
            log = running.enter_context(tempfile.TemporaryFile())
            command = gateway_command(sys.executable, port, buffer.url, data)
            process = subprocess.Popen(command, cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT)
            running.callback(process.wait)
            running.callback(process.terminate)
            processes.append(process)
        for url in gateways:
            _wait(f"{url}/health")
        pids = {"service": [buffer.pid], "gateways": [p.pid for p in processes], "engine": engine_pids}
        if args.agents == "wrk":
            return wrk_count(args, count, ports, buffer.url, engine_url, pids)
        go = context.Event()
        pipes, workers = [], []
        share = [args.concurrency // args.agent_processes] * args.agent_processes
        for index in range(args.concurrency % args.agent_processes):
            share[index] += 1
        per_agent = max(1, args.calls // args.concurrency)
        for index, agents_here in enumerate(share):
            receive, send = context.Pipe(duplex=False)
            first = sum(share[:index])
            worker = context.Process(
                target=agents,
                args=(
                    buffer.url,
                    engine_url,
                    agents_here,
                    per_agent,
                    first,
                    go,
                    send,
                    args.agents,
                    args.stream,
                    args.session_calls,
                ),
            )
            worker.start()
            pipes.append(receive)
            workers.append(worker)
        time.sleep(0.5)  # the agents' sessions opened and warmed (they wait for go)
        before = readings(pids)
        go.set()
        results = [pipe.recv() for pipe in pipes]
        after = readings(pids)
        for worker in workers:
            worker.join()
    latencies = [latency for lists, *_ in results for latency in lists]
    elapsed_s = max(result[2] for result in results) - min(result[1] for result in results)
    agents_cpu_s = sum(result[3] for result in results)
    figures = summary(latencies)
    return measured(before, after, len(latencies), elapsed_s, figures, agents_cpu_s, args.agent_processes)


def wrk_count(
    args: argparse.Namespace,
    count: int,
    ports: list[int],
    buffer_url: str,
    engine_url: str,
    pids: dict[str, list[int]],
) -> dict[str, Any]:
    """``--concurrency`` sessions opened at the buffer (each handed to a gateway process), a
    second of wrk to warm, then ``--duration`` seconds of wrk measured, one thread a gateway
    process; every call wrk counts must be recorded in the sessions (checked), which are ended
    (discarded) after."""
    if args.concurrency % count:
        raise SystemExit(
            f"--agents wrk: --concurrency {args.concurrency} must divide among {count} processes"
        )
    with httpx.Client(trust_env=False, timeout=60.0) as client:

        def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
            response = client.post(url, json=body)
            response.raise_for_status()
            answer: dict[str, Any] = response.json()["data"]
            return answer

        def recorded() -> int:
            time.sleep(0.5)  # calls a wrk that stopped left in flight, answered
            states = [client.get(f"{buffer_url}/sessions/{s['session_id']}") for s in sessions]
            return sum(state.raise_for_status().json()["data"]["calls"] for state in states)

        sessions = [
            post(f"{buffer_url}/sessions", {"task_type": "bench", "instance_id": f"agent-{index}",
                                            "remote_engine_url": engine_url})
            for index in range(args.concurrency)
        ]  # fmt: skip
        run_wrk(wrk_script(sessions, ports, "warm"), ports, args.concurrency, 1)
        first = recorded()
        before = readings(pids)
        counts = run_wrk(wrk_script(sessions, ports, "run"), ports, args.concurrency, args.duration)
        after = readings(pids)
        calls = recorded() - first
        for session in sessions:
            post(f"{buffer_url}/sessions/{session['session_id']}/end", {"discard": True})
    errors = {
        name: counts[name] for name in ("connect", "read", "write", "status", "timeout") if counts[name]
    }
    if errors:
        raise RuntimeError(f"wrk's calls failed: {errors}")
    # every call wrk counted recorded; at most one a connection more (in flight when wrk stopped)
    if not counts["requests"] <= calls <= counts["requests"] + args.concurrency:
        raise RuntimeError(f"wrk made {counts['requests']} calls, the sessions recorded {calls}")
    figures = {"median_ms": counts["median_us"] / 1000, "p99_ms": counts["p99_us"] / 1000}
    elapsed_s = counts["duration_us"] / 1e6
    run = measured(before, after, counts["requests"], elapsed_s, figures, counts["cpu_s"], len(ports))
    run["recorded_calls"] = calls
    return run


def readings(pids: dict[str, list[int]]) -> dict[str, Any]:
    """The CPU so far of each process of ``pids``, the gateway processes' context switches and
    the machine's CPU counters: ``measured`` takes two."""
    return {
        "cpu": {name: [common.cpu_seconds(pid) for pid in group] for name, group in pids.items()},
        "switches": [context_switches(pid) for pid in pids["gateways"]],
        "machine": common.machine_cpu(),
    }


def measured(
    before: dict[str, Any],
    after: dict[str, Any],
    calls: int,
    elapsed_s: float,
    latencies: dict[str, float],
    agents_cpu_s: float,
    agent_cores: int,
) -> dict[str, Any]:
    """A run's figures from its ``readings`` before and after, ``calls`` made in ``elapsed_s``:
    calls/s, the CPU a call of each process group, what the cores allow."""
    shares = common.machine_shares(before["machine"], after["machine"])
    used = {name: sum(after["cpu"][name]) - sum(before["cpu"][name]) for name in before["cpu"]}
    switched = [
        [later - earlier for earlier, later in zip(first, last, strict=True)]
        for first, last in zip(before["switches"], after["switches"], strict=True)
    ]
    gateways = zip(before["cpu"]["gateways"], after["cpu"]["gateways"], strict=True)
    run = {
        "calls": calls,
        "calls_per_s": calls / elapsed_s,
        **latencies,
        **{f"{name}_cpu_us_per_call": used[name] / calls * 1e6 for name in used},
        "agents_cpu_us_per_call": agents_cpu_s / calls * 1e6,
        "per_gateway_process_cpu_share": [(b - a) / elapsed_s for a, b in gateways],
        "machine_busy": shares["busy"],
        "load_average": os.getloadavg()[0],
        # how often the gateway processes slept waiting for work, and were preempted, a call
        "gateway_waits_per_call": sum(voluntary for voluntary, _ in switched) / calls,
        "gateway_preemptions_per_call": sum(preempted for _, preempted in switched) / calls,
    }
    run["allowed_calls_per_s"] = allowed(run, len(before["switches"]), agent_cores)
    # at this run's costs, what the cores allow over one gateway process: 2G / (G + E + A + S)
    # for two on 2 cores, whatever load the run met (the doc's arithmetic)
    run["allowed_over_one"] = run["allowed_calls_per_s"]["at_most"] / allowed(run, 1, agent_cores)["at_most"]
    return run


def context_switches(pid: int) -> tuple[int, int]:
    """A process's voluntary (it waited) and involuntary (it was preempted) context switches so far."""
    counts = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            counts[name] = int(value)
    return counts.get("voluntary_ctxt_switches", 0), counts.get("nonvoluntary_ctxt_switches", 0)


def allowed(run: dict[str, Any], processes: int, agent_processes: int) -> dict[str, float]:
    """The calls a second the machine allows at a run's CPU costs a call: each process runs on
    at most one core (the gateway processes together ``processes`` cores' worth, the engine one,
    the agents ``agent_processes``), and all of them share ``common.CPUS`` cores."""
    total_us = sum(run[f"{name}_cpu_us_per_call"] for name in ("service", "gateways", "engine", "agents"))
    bounds = {
        "cores": common.CPUS / total_us * 1e6,
        "gateway_processes": processes / run["gateways_cpu_us_per_call"] * 1e6,
        "engine": 1 / run["engine_cpu_us_per_call"] * 1e6,
        "agents": agent_processes / run["agents_cpu_us_per_call"] * 1e6,
    }
    bounds["at_most"] = min(bounds.values())
    bounds["cpu_us_per_call"] = total_us
    return bounds


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


# -- a gateway process's CPU a call, stage by stage (--breakdown) -------------------------------

#: The stages the chat route is cut down to, in order; "whole" is the route itself.
STAGES = ("route", "body", "engine", "client", "whole")
STAGE_NAMES = {
    "route": "the HTTP server, the guards, the route, a canned answer written",
    "body": "+ the session found, the body read, parsed and checked",
    "engine": "+ the engine asked, its answer's bytes passed back",
    "client": "+ the toolkit's engine client, the answer decoded and encoded",
    "whole": "the whole call: recorded, the agent's disconnect watched",
    "streamed": "the whole call, streamed",
    "journaled": "the whole call, journaled (--data-dir, durability sync)",
}
CANNED = orjson.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}
        ],
    }
)


def serve_staged_gateway(stage: str, argv: list[str]) -> None:
    """``rollout-buffer gateway`` (``argv``) with its chat route cut down to ``stage``. The code of
    the tree it runs in; the previous code's too (its chat route is first in FastAPI's table)."""
    sys.path.insert(0, str(common.REPO))  # this tree's code, whatever is installed
    from starlette.responses import Response
    from starlette.routing import Route

    from buffer.service import cli, gateway_process
    from buffer.service.routes import agent_body, sessions
    from buffer.service.routes.dialects import unless_disconnected

    async def staged(request: Any) -> Any:
        if stage == "route":
            return Response(CANNED, media_type="application/json")
        gateway = request.app.state.gateway
        key = request.headers.get("authorization")
        session = gateway.session(request.path_params["session_id"], key, agent=True)
        if hasattr(agent_body, "read_call"):
            _, body = await agent_body.read_call(request)
        else:  # the previous code
            body = await agent_body.read_call_body(request)
        if stage == "body":
            return Response(CANNED, media_type="application/json")
        upstream = gateway.proxy.upstream_body(body)
        if stage == "engine":
            url = session.engine_urls[0].rstrip("/") + "/v1/chat/completions"
            headers = {"content-type": "application/json"}
            reply = await gateway.proxy._transport.post(url, orjson.dumps(upstream), headers)
            return Response(reply.body, media_type="application/json")
        answer = gateway.proxy.chat(session.engine_urls, upstream, key=session.session_id)
        return Response(
            orjson.dumps(await unless_disconnected(request, answer)), media_type="application/json"
        )

    if stage in ("route", "body", "engine", "client"):
        if hasattr(gateway_process, "CALLS"):
            gateway_process.CALLS["chat/completions"] = staged
        else:  # the previous code
            sessions.ROUTES[0] = Route("/sessions/{session_id}/v1/chat/completions", staged, methods=["POST"])
    sys.argv = ["rollout-buffer", "gateway", *argv]
    cli.main()


def run_breakdown(args: argparse.Namespace) -> dict[str, Any]:
    """One gateway process at each stage (and whole: streamed, journaled), ``--concurrency``
    agents on the toolkit's HTTP/1.1 transport in this process, the raw engine: the gateway's CPU
    a call, the median of ``--rounds`` rounds of ``--calls``; then what a session's open, reward
    and end cost the gateway process and the buffer (``--sessions`` of one call each)."""
    import subprocess

    stages = [*STAGES, "streamed", "journaled"]
    report: dict[str, Any] = {"concurrency": args.concurrency, "calls": args.calls, "cpus": common.CPUS}
    report["stages"] = {}
    with RawEngine() as engine:
        for stage in [*stages, "sessions"]:
            port = common.free_port()
            gateway_url = f"http://{common.HOST}:{port}"
            with (
                common.Server(extra_args=["--gateway-url", gateway_url], group_size=10**6) as buffer,
                tempfile.TemporaryDirectory() as data,
            ):
                argv = ["--buffer-url", buffer.url, "--host", common.HOST, "--port", str(port)]
                argv += ["--log-level", "warning"]
                if stage == "journaled":
                    argv += ["--data-dir", data, "--durability", "sync"]
                command = [sys.executable, __file__, "--serve-staged-gateway", stage, *argv]
                process = subprocess.Popen(command, cwd=common.REPO)
                try:
                    _wait(f"{gateway_url}/health")
                    if stage == "sessions":
                        report["sessions"] = run_in_loop(
                            session_costs(args, buffer.url, engine.url, process.pid, buffer.pid)
                        )
                    else:
                        rounds = run_in_loop(
                            staged_calls(args, buffer.url, engine.url, process.pid, stage == "streamed")
                        )
                        report["stages"][stage] = {
                            "cpu_us_per_call": statistics.median(rounds),
                            "rounds": rounds,
                            "load_average": os.getloadavg()[0],
                        }
                finally:
                    process.terminate()
                    process.wait(30)
    return report


async def staged_calls(
    args: argparse.Namespace, buffer_url: str, engine_url: str, pid: int, stream: bool
) -> list[float]:
    from buffer.toolkit.http11 import Http11Transport

    transport = Http11Transport(max_connections=args.concurrency * 2)
    headers = {"content-type": "application/json"}
    sessions = []
    for index in range(args.concurrency):
        body = {"task_type": "bench", "instance_id": index, "remote_engine_url": engine_url}
        reply = await transport.post(f"{buffer_url}/sessions", orjson.dumps(body), headers)
        sessions.append(orjson.loads(reply.body)["data"])
    request = {
        "model": "policy",
        "messages": MESSAGES,
        "max_tokens": 64,
        **({"stream": True} if stream else {}),
    }
    content = orjson.dumps(request)

    async def calls(session: dict[str, Any], count: int) -> None:
        sent = {**headers, "authorization": f"Bearer {session['api_key']}"}
        for _ in range(count):
            reply = await transport.post(f"{session['base_url']}/chat/completions", content, sent)
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {reply.text[:300]}")

    await asyncio.gather(*(calls(session, 20) for session in sessions))
    per_agent = max(1, args.calls // args.concurrency)
    rounds = []
    for _ in range(args.rounds):
        cpu_s = common.cpu_seconds(pid)
        await asyncio.gather(*(calls(session, per_agent) for session in sessions))
        rounds.append((common.cpu_seconds(pid) - cpu_s) / (per_agent * len(sessions)) * 1e6)
    await transport.aclose()
    return rounds


async def session_costs(
    args: argparse.Namespace, buffer_url: str, engine_url: str, pid: int, buffer_pid: int
) -> dict[str, Any]:
    """``--sessions`` sessions opened at the buffer, each making one call, rewarded, ended (its
    trajectory written), ``--concurrency`` at a time, phase by phase: each phase's CPU a session,
    the gateway process's and the buffer's."""
    from buffer.toolkit.http11 import Http11Transport

    transport = Http11Transport(max_connections=args.concurrency * 2)
    headers = {"content-type": "application/json"}
    slots = asyncio.Semaphore(args.concurrency)

    async def post(url: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        sent = headers if key is None else {**headers, "authorization": f"Bearer {key}"}
        async with slots:
            reply = await transport.post(url, orjson.dumps(body), sent)
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status} from {url}: {reply.text[:300]}")
        answer: dict[str, Any] = orjson.loads(reply.body)
        return answer

    def opening(index: int) -> Any:
        body = {"task_type": "bench", "instance_id": f"q{index}", "remote_engine_url": engine_url}
        return post(f"{buffer_url}/sessions", body)

    await asyncio.gather(*(opening(-1 - index) for index in range(20)))  # warm
    call = {"model": "policy", "messages": MESSAGES, "max_tokens": 64}
    phases: dict[str, Callable[[int], Any]] = {
        "open": opening,
        "call": lambda i: post(f"{opened[i]['base_url']}/chat/completions", call, opened[i]["api_key"]),
        "reward": lambda i: post(
            f"{buffer_url}/sessions/{opened[i]['session_id']}/reward", {"reward": i % 2}
        ),
        "end": lambda i: post(f"{buffer_url}/sessions/{opened[i]['session_id']}/end", {}),
    }
    costs: dict[str, Any] = {"sessions": args.sessions}
    opened: list[dict[str, Any]] = []
    for name, phase in phases.items():
        gateway_s, buffer_s = common.cpu_seconds(pid), common.cpu_seconds(buffer_pid)
        answers = await asyncio.gather(*(phase(index) for index in range(args.sessions)))
        if name == "open":
            opened = [answer["data"] for answer in answers]
        costs[name] = {
            "gateway_cpu_us": (common.cpu_seconds(pid) - gateway_s) / args.sessions * 1e6,
            "buffer_cpu_us": (common.cpu_seconds(buffer_pid) - buffer_s) / args.sessions * 1e6,
        }
    costs["load_average"] = os.getloadavg()[0]
    await transport.aclose()
    return costs


def print_breakdown(report: dict[str, Any]) -> None:
    print(f"one gateway process, {report['concurrency']} agents, the raw engine, on {report['cpus']} CPUs")
    for stage, figures in report["stages"].items():
        rounds = ", ".join(f"{value:.0f}" for value in figures["rounds"])
        print(
            f"{STAGE_NAMES[stage]:>66}: {figures['cpu_us_per_call']:4.0f} us a call ({rounds});"
            f" load {figures['load_average']:.1f}"
        )
    costs = report["sessions"]
    print(f"a session of one call ({costs['sessions']}): CPU of the gateway process / the buffer")
    for phase in ("open", "call", "reward", "end"):
        print(
            f"{phase:>10}: {costs[phase]['gateway_cpu_us']:5.0f} us / {costs[phase]['buffer_cpu_us']:5.0f} us"
        )
    print(f"load {costs['load_average']:.1f}")


def print_processes(report: dict[str, Any]) -> None:
    agents = f"{report['agent_processes']} processes" if report["agents"] != "wrk" else "a thread a process"
    print(
        f"{report['concurrency']} agents ({report['agents']} client, {agents}),"
        f" engine {report['engine']}, on {report['cpus']} CPUs{', streamed' if report['stream'] else ''}"
        + (f", {report['session_calls']} calls a session" if report["session_calls"] else "")
        + (f", {report['duration_s']:g} s a run" if report["duration_s"] else "")
    )
    for number, runs in enumerate(report["rounds"], 1):
        if len(report["rounds"]) > 1:
            print(f"round {number}:")
        print_round(runs)
    one = report["runs"].get("1")
    if one is None or len(report["runs"]) < 2:
        return
    for count in (count for count in report["runs"] if count != "1"):
        ratios = [runs[count]["calls_per_s"] / runs["1"]["calls_per_s"] for runs in report["rounds"]]
        rates = {
            n: ", ".join(f"{runs[n]['calls_per_s']:.0f}" for runs in report["rounds"]) for n in ("1", count)
        }
        loads = [runs[n]["load_average"] for runs in report["rounds"] for n in ("1", count)]
        bounds = [runs[count]["allowed_over_one"] for runs in report["rounds"]]
        rest = [
            sum(runs[count][f"{name}_cpu_us_per_call"] for name in ("service", "engine", "agents"))
            for runs in report["rounds"]
        ]
        gateway = [runs[count]["gateways_cpu_us_per_call"] for runs in report["rounds"]]
        print(
            f"{count} gateway processes / 1: {statistics.median(ratios):.2f}x"
            f" (rounds {', '.join(f'{ratio:.2f}x' for ratio in ratios)}; calls/s with 1: {rates['1']},"
            f" with {count}: {rates[count]}; load {min(loads):.1f}-{max(loads):.1f});"
            f" at the costs of the runs with {count} (a gateway process"
            f" {min(gateway):.0f}-{max(gateway):.0f} us a call, engine + agents + service"
            f" {min(rest):.0f}-{max(rest):.0f} us) the cores allow {min(bounds):.2f}-{max(bounds):.2f}x"
        )


def print_round(runs: dict[str, Any]) -> None:
    one = runs.get("1")
    for count, run in runs.items():
        bound = run["allowed_calls_per_s"]
        scale = allowed_scale = ""
        if one:
            scale = f" ({run['calls_per_s'] / one['calls_per_s']:.2f}x one)"
            allowed_scale = f" ({bound['at_most'] / one['allowed_calls_per_s']['at_most']:.2f}x one)"
        rest = sum(run[f"{name}_cpu_us_per_call"] for name in ("service", "engine", "agents"))
        print(
            f"{count} gateway process(es): {run['calls_per_s']:.0f} calls/s{scale},"
            f" median {run['median_ms']:.2f} ms, p99 {run['p99_ms']:.2f} ms; CPU a call:"
            f" service {run['service_cpu_us_per_call']:.0f} us,"
            f" gateways {run['gateways_cpu_us_per_call']:.0f} us,"
            f" engine {run['engine_cpu_us_per_call']:.0f} us, agents {run['agents_cpu_us_per_call']:.0f} us"
            f" (engine + agents + service {rest:.0f} us);"
            f" load {run['load_average']:.1f}, machine {run['machine_busy']:.0%} busy"
        )
        shares = ", ".join(f"{share:.0%}" for share in run["per_gateway_process_cpu_share"])
        shares += (
            f"; a call: {run['gateway_waits_per_call']:.2f} waits for work,"
            f" {run['gateway_preemptions_per_call']:.2f} preemptions"
        )
        print(
            f"    the cores allow {bound['at_most']:.0f} calls/s{allowed_scale}"
            f" at {bound['cpu_us_per_call']:.0f} us a call (the {common.CPUS} cores {bound['cores']:.0f},"
            f" the gateway processes {bound['gateway_processes']:.0f},"
            f" the engine {bound['engine']:.0f}, the agents {bound['agents']:.0f});"
            f" each gateway process busy {shares}"
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
    parser.add_argument(
        "--engine",
        choices=["raw", "nginx", "loopback"],
        default="raw",
        help="with --processes: the engine (raw: one answer kept ready, the cheapest in Python; nginx: the "
        "same answer from nginx, one worker; loopback: the stand-in)",
    )
    parser.add_argument(
        "--agents",
        choices=["raw", "aiohttp", "wrk"],
        default="raw",
        help="with --processes: the agents' HTTP client (raw: the toolkit's HTTP/1.1 transport; wrk: "
        "wrk, a thread a gateway process, --concurrency connections, for --duration)",
    )
    parser.add_argument(
        "--duration", type=int, default=10, help="with --agents wrk: seconds measured (after 1 s warm)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --processes: rounds, the counts interleaved (each: its median)",
    )
    parser.add_argument("--stream", action="store_true", help="with --processes: streamed answers")
    parser.add_argument(
        "--session-calls",
        type=int,
        default=0,
        help="with --processes: each session makes this many calls, then is rewarded and ended (written); "
        "opens and ends counted in the time and CPU (default 0: one session an agent for the whole run)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="one gateway process's CPU a call stage by stage, and a session's open, reward and end",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --breakdown: rounds a stage (the median)")
    parser.add_argument("--sessions", type=int, default=1000, help="with --breakdown: sessions of one call")
    sys.path.insert(0, str(common.REPO))  # this tree's code (a worktree's), whatever is installed
    if sys.argv[1:2] == ["--serve-raw-engine"]:
        serve_raw_engine(common.HOST, int(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--serve-staged-gateway"]:
        serve_staged_gateway(sys.argv[2], sys.argv[3:])
        return
    args = parser.parse_args()
    if args.breakdown:
        report = run_breakdown(args)
        if args.json:
            print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        else:
            print_breakdown(report)
        return
    if args.processes:
        counts = [int(count) for count in args.processes.split(",")]
        if args.agents == "wrk" and (args.stream or args.session_calls):
            parser.error(
                "--agents wrk makes plain calls in one session an agent: no --stream, --session-calls"
            )
        missing = [
            f"{name} is not installed ({hint})"
            for name, wanted, found, hint in (
                ("nginx", args.engine == "nginx", nginx_binary(), "apt-get install nginx-light"),
                ("wrk", args.agents == "wrk", shutil.which("wrk"), "apt-get install wrk"),
            )
            if wanted and not found
        ]
        if missing:
            reason = "; ".join(missing)
            print(orjson.dumps({"skipped": reason}).decode() if args.json else f"skipped: {reason}")
            return
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
