"""A stand-in policy server that answers with token ids in vLLM's shape, for the gateway's tests
and benchmark (``python -m tests.support.loopback_engine --host H --port P``).

Its "tokenizer" renders a message as its role's id, the bytes of its text (+1000), 4 image
tokens (300) per image, its tool calls as text, and an end token (2); the generation prompt is
the assistant's role id. So a reply in the history renders exactly as the generation prompt and
the sampled ids: a conversation's prompts extend one another, as with a real template that keeps
history. ``GET /log`` lists what it received and sampled, per request.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

ROLES = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
END, IMAGE = 2, 300


def text_ids(text: str) -> list[int]:
    return [byte + 1000 for byte in text.encode()]


def tool_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    return f"<tool>{function.get('name')}:{function.get('arguments')}</tool>"


def render_message(message: dict[str, Any]) -> list[int]:
    ids = [ROLES.get(message.get("role", ""), 14)]
    content = message.get("content")
    if isinstance(content, str):
        ids += text_ids(content)
    elif isinstance(content, list):
        for part in content:
            if part.get("type") == "text":
                ids += text_ids(part.get("text", ""))
            elif part.get("type") == "image_url":
                ids += [IMAGE] * 4
    for call in message.get("tool_calls") or ():
        ids += text_ids(tool_text(call))
    return [*ids, END]


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    ids = [1]
    if tools:
        names = ",".join(str((tool.get("function") or {}).get("name")) for tool in tools)
        ids += [*text_ids(names), END]
    for message in messages:
        ids += render_message(message)
    return [*ids, ROLES["assistant"]]


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, count: int) -> dict[str, Any]:
    """An image description, a tool call to the first tool (with the user's expression), or
    the tool's result as the answer."""
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        images = sum(1 for part in content if part.get("type") == "image_url")
        return {"role": "assistant", "content": f"I see {images} image(s)."}
    if last.get("role") == "tool":
        return {"role": "assistant", "content": f"The answer is {content}."}
    if tools and last.get("role") == "user":
        expression = str(content).removeprefix("Compute ").rstrip(".")
        name = (tools[0].get("function") or {}).get("name")
        function = {"name": name, "arguments": orjson.dumps({"expression": expression}).decode()}
        call = {"id": f"call_{count}", "type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "assistant", "content": "Hello."}


def create_engine_app() -> Starlette:
    log: list[dict[str, Any]] = []

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body.get("stream") and body.get("return_token_ids"):
            return Response(b'{"error": {"message": "no token ids when streaming"}}', status_code=400)
        if body.get("model") == "missing":
            error = {"message": "The model `missing` does not exist.", "type": "NotFoundError", "code": 404}
            return Response(orjson.dumps({"error": error}), status_code=404)
        messages, tools = body["messages"], body.get("tools")
        prompt_ids = render(messages, tools)
        message = reply(messages, tools, len(log))
        output_ids = render_message(message)[1:]  # the role id is the generation prompt's
        logprobs = [-((i % 5) + 1) / 10 for i in range(len(output_ids))]
        entries = [{"token": "t", "logprob": value, "top_logprobs": []} for value in logprobs]
        log.append({"prompt_ids": prompt_ids, "output_ids": output_ids, "logprobs": logprobs, "body": body})
        answer = {
            "id": f"chatcmpl-{len(log)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "loopback"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": entries} if body.get("logprobs") else None,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    "token_ids": output_ids if body.get("return_token_ids") else None,
                }
            ],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)},
        }
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = prompt_ids
        return Response(orjson.dumps(answer), media_type="application/json")

    async def completions(request: Request) -> Response:
        """vLLM's legacy completions: a prompt (text as its bytes' ids, or ids) answered "Hello."."""
        body = orjson.loads(await request.body())
        prompt = body["prompt"]
        prompt_ids = text_ids(prompt) if isinstance(prompt, str) else list(prompt)
        output_ids = [*text_ids("Hello."), END]
        logprobs = [-((i % 5) + 1) / 10 for i in range(len(output_ids))]
        log.append({"prompt_ids": prompt_ids, "output_ids": output_ids, "logprobs": logprobs, "body": body})
        choice: dict[str, Any] = {"index": 0, "text": "Hello.", "finish_reason": "stop", "stop_reason": None}
        choice["logprobs"] = {"token_logprobs": logprobs} if body.get("logprobs") is not None else None
        if body.get("return_token_ids"):
            choice.update(prompt_token_ids=prompt_ids, token_ids=output_ids)
        answer = {"id": f"cmpl-{len(log)}", "object": "text_completion", "created": 0, "choices": [choice]}
        answer["model"] = body.get("model", "loopback")
        answer["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)}
        return Response(orjson.dumps(answer), media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(b'{"object": "list", "data": [{"id": "loopback", "object": "model"}]}')

    async def get_log(request: Request) -> Response:
        return Response(orjson.dumps([{k: v for k, v in e.items() if k != "body"} for e in log]))

    async def health(request: Request) -> Response:
        return Response(b"{}")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/log", get_log),
            Route("/health", health),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    app = create_engine_app()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
