"""The simulator's own CPU time per request: in process, or as a real server under load.

    python bench/simulator_cpu.py [--requests 2000] [--repeats 8]
    python bench/simulator_cpu.py --http [--route chat|generate|completions] [--requests 4000]
        [--concurrency 256] [--latency-s 0.2] [--repeats 8] [--engine sglang|vllm] [--abort-rate 0.1]

In process (the default), it sends chat completions (an arithmetic question, a calculator tool
offered, logprobs and token ids asked for) through ``httpx.ASGITransport`` one after another, and
subtracts the CPU time of as many ``GET /health`` calls, which pay for the client and the ASGI
plumbing alone. What is left is the simulator's work per request: rendering the prompt, drafting,
tokenizing, building the body (less what FastAPI's stack costs ``/health``: the generation routes
skip it, see ``buffer/simulator/front.py``, so ``--http`` is the figure to go by).

``--http`` starts ``python -m buffer.simulator`` as its own process (uvicorn, as a benchmark runs
it), sends ``--requests`` requests with ``--concurrency`` in flight from aiohttp, and reports the
CPU seconds the simulator process used per request, read from ``/proc``: a figure that other load
on the machine barely changes, unlike a rate. ``--route`` picks what is sent, as the toolkit's
capture sends it: chat completions (logprobs, ``return_token_ids``, ``return_prompt_token_ids``,
a calculator tool for every other prompt, a tool result as the second turn of some), SGLang's
``/generate`` or vLLM's ``/v1/completions`` with the rendered prompt's ids.

With ``--abort-rate``, an aborted ``/generate`` or ``/v1/completions`` reply is continued from its
ids, as a partial rollout does, and the replies per second are reported against the ideal C/L
(a rate: other load on the machine changes it).

``--repeats`` sends each prompt that many times, as a group of samples does (the simulator renders
a prompt it has just seen from its cache); 1 makes every prompt new.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from buffer.simulator import SimConfig, create_sim_app

CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


async def measure(requests: int, repeats: int = 1) -> tuple[float, float]:
    app = create_sim_app(SimConfig(latency_mean_s=0.0, seed=0, log_level="warning"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        started = time.process_time()
        for _ in range(requests):
            await client.get("/health")
        plumbing_s = time.process_time() - started
        started = time.process_time()
        for request in range(requests):
            index = request // repeats
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": f"What is {index} + {index + 1} * 3?"}],
                "tools": [CALCULATOR] if index % 2 else None,
                "logprobs": True,
                "return_token_ids": True,
                "return_prompt_token_ids": True,
            }
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        chat_s = time.process_time() - started
    return chat_s / requests, plumbing_s / requests


# -- a real server under load ----------------------------------------------------------------


def chat_body(index: int) -> dict[str, Any]:
    """The chat request of prompt ``index``, with the fields the toolkit's capture sends."""
    question = f"What is {index} + {index + 1} * 3?"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": question},
    ]
    tools = [CALCULATOR] if index % 2 else None
    if index % 4 == 1:  # the second turn of a tool call: the result is back
        call = {
            "id": f"call_{index:016x}",
            "type": "function",
            "function": {"name": "calculator", "arguments": f'{{"expression": "{index} + {index + 1} * 3"}}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(index + 3 * (index + 1))})
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": messages,
        "max_tokens": 512,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
        "return_prompt_token_ids": True,
    }
    if tools:
        body["tools"] = tools
    return body


async def token_body(session: Any, route: str, index: int) -> tuple[str, dict[str, Any]]:
    """The ``/generate`` or ``/v1/completions`` request of prompt ``index``: its rendered ids."""
    async with session.post("/v1/chat/completions", json=chat_body(index)) as response:
        answer = await response.json()
    ids = answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]
    if route == "generate":
        params = {"max_new_tokens": 512, "temperature": 1.0}
        return "/generate", {"input_ids": ids, "sampling_params": params, "return_logprob": True}
    body = {"model": "sim-model", "prompt": ids, "max_tokens": 512, "logprobs": 0, "return_token_ids": True}
    return "/v1/completions", body


@dataclass(slots=True)
class Run:
    """What the simulator process did for one run: its CPU, the requests and replies, the time."""

    cpu_s: float = 0.0
    requests: int = 0  # continuations of aborted replies included
    replies: int = 0
    elapsed_s: float = 0.0


def aborted_ids(route: str, answer: dict[str, Any]) -> list[int] | None:
    """The ids of an aborted token reply, to continue from; None if it was not aborted."""
    if route == "generate":
        aborted = answer["meta_info"]["finish_reason"]["type"] == "abort"
        return list(answer["output_ids"]) if aborted else None
    if route == "completions":
        [choice] = answer["choices"]
        return list(choice["token_ids"]) if choice["finish_reason"] == "abort" else None
    return None


def continued(route: str, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The request that continues an aborted token reply from its ids, as a partial rollout does."""
    if route == "generate":
        params = body["sampling_params"]
        left = params["max_new_tokens"] - len(ids)
        return {
            **body,
            "input_ids": body["input_ids"] + ids,
            "sampling_params": {**params, "max_new_tokens": left},
        }
    return {**body, "prompt": body["prompt"] + ids, "max_tokens": body["max_tokens"] - len(ids)}


async def drive(url: str, route: str, requests: int, concurrency: int, repeats: int, pid: int) -> Run:
    """Send ``requests`` replies' requests ``concurrency`` at a time (an aborted token reply is
    continued from its ids, as one more request); the CPU seconds process ``pid`` used."""
    import aiohttp
    import common  # bench/common.py: run this file as a script

    prompts = max(1, requests // repeats)
    bodies: list[tuple[str, dict[str, Any]]] = []
    run = Run()
    async with aiohttp.ClientSession(
        url, connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        if route == "chat":
            bodies = [("/v1/chat/completions", chat_body(index)) for index in range(prompts)]
        else:  # the prompts' ids, as a client renders them, asked before the timing starts
            bodies = list(
                await asyncio.gather(*(token_body(session, route, index) for index in range(prompts)))
            )
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        for request in range(requests):
            queue.put_nowait(bodies[(request // repeats) % len(bodies)])

        async def client() -> None:
            while not queue.empty():
                path, body = queue.get_nowait()
                while True:
                    async with session.post(path, json=body) as response:
                        assert response.status == 200, await response.text()
                        answer = await response.json()
                    run.requests += 1
                    ids = aborted_ids(route, answer)
                    if not ids:
                        break
                    body = continued(route, body, ids)
                run.replies += 1

        cpu_before, started = common.cpu_seconds(pid), time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        run.elapsed_s = time.monotonic() - started
        run.cpu_s = common.cpu_seconds(pid) - cpu_before
    return run


def measure_http(args: argparse.Namespace) -> None:
    import common

    flags = ["--latency-mean-s", str(args.latency_s), "--seed", "0", "--engine", args.engine]
    flags += ["--abort-rate", str(args.abort_rate)]
    with common.Server(module="buffer.simulator", extra_args=flags) as server:
        run = asyncio.run(
            drive(server.url, args.route, args.requests, args.concurrency, args.repeats, server.pid)
        )
    print(
        f"{args.route}: {run.replies} replies ({run.requests} requests) at concurrency {args.concurrency},"
        f" latency {args.latency_s} s, {args.repeats} per prompt, abort rate {args.abort_rate},"
        f" {args.engine}: {run.elapsed_s:.1f} s"
    )
    if args.latency_s:
        ideal = args.concurrency / args.latency_s
        rate = run.replies / run.elapsed_s
        print(f"replies per second: {rate:.0f}, {rate / ideal:.0%} of the ideal C/L ({ideal:.0f})")
    print(f"the simulator process: {run.cpu_s / run.requests * 1e3:.3f} ms CPU per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1, help="requests per prompt")
    parser.add_argument("--http", action="store_true", help="a real server process, driven over HTTP")
    parser.add_argument("--route", choices=("chat", "generate", "completions"), default="chat")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight (--http)")
    parser.add_argument("--latency-s", type=float, default=0.2, help="the simulator's latency (--http)")
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument(
        "--abort-rate", type=float, default=0.0, help="the simulator's (--http; token routes continue them)"
    )
    args = parser.parse_args()
    if args.http:
        measure_http(args)
        return
    chat_s, plumbing_s = asyncio.run(measure(args.requests, args.repeats))
    print(f"chat completion: {chat_s * 1e3:.3f} ms CPU per request")
    print(f"GET /health (client and ASGI alone): {plumbing_s * 1e3:.3f} ms")
    print(f"the simulator's own work: {(chat_s - plumbing_s) * 1e3:.3f} ms CPU per request")


if __name__ == "__main__":
    main()
