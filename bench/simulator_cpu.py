"""The simulator's own CPU time per chat completion, in process (no network, no latency).

    python bench/simulator_cpu.py [--requests 2000] [--repeats 8]

Sends chat completions (an arithmetic question, a calculator tool offered, logprobs and token ids
asked for) through ``httpx.ASGITransport`` one after another, and subtracts the CPU time of as many
``GET /health`` calls, which pay for the client and the ASGI plumbing alone. What is left is the
simulator's work per request: rendering the prompt, drafting, tokenizing, building the body.
``--repeats`` sends each prompt that many times in a row, as a group of samples does (the
simulator renders a prompt it has just seen from its cache); 1 makes every prompt new.
"""

from __future__ import annotations

import argparse
import asyncio
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1, help="requests per prompt")
    args = parser.parse_args()
    chat_s, plumbing_s = asyncio.run(measure(args.requests, args.repeats))
    print(f"chat completion: {chat_s * 1e3:.3f} ms CPU per request")
    print(f"GET /health (client and ASGI alone): {plumbing_s * 1e3:.3f} ms")
    print(f"the simulator's own work: {(chat_s - plumbing_s) * 1e3:.3f} ms CPU per request")


if __name__ == "__main__":
    main()
