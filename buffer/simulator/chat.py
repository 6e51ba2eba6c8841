"""``POST /v1/chat/completions``: both engines', each answering in its own shape.

The prompt is rendered with the chat template (``prompts.py``), each of the ``n`` choices is a
reply of the simulated model, read back as the engine's parsers read it (reasoning, content, tool
calls), and the answer is written where the imitated engine writes it (``engines.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from starlette.responses import Response

from buffer.simulator.conversation import parse_output
from buffer.simulator.protocol import ChatRequest, stop_strings
from buffer.simulator.replies import Limits
from buffer.simulator.sampling import SamplingFields
from buffer.simulator.server import Answer, Simulator
from buffer.simulator.shapes import ChatChoice, chat_logprobs, new_call_ids, output_text, usage
from buffer.simulator.streaming import Chunk, chat_chunks


def prepare_chat(sim: Simulator, request: ChatRequest, reply_rng: random.Random) -> Answer | Response:
    """The answer to a chat request, or the error the engine answers it with."""
    model, dialect = sim.model, sim.dialect
    started = time.monotonic()
    refusal = dialect.chat_refusal(request)
    if refusal is not None:
        return sim.error(400, refusal, "BadRequestError")
    try:
        prompt = sim.prompts.chat(request)
    except ValueError as exc:
        return sim.error(400, str(exc), "BadRequestError", "messages")
    prompt_ids, plan, open_reply = list(prompt.ids), prompt.plan, prompt.open_reply
    thinking = prompt.thinking
    limits = Limits(request.token_limit, stop_strings(request.stop), tuple(request.stop_token_ids or ()))
    choices = []
    for _ in range(request.n):
        generation = sim.draft(
            plan,
            limits,
            reply_rng,
            open_reply.ids if open_reply else None,
            open_reply.text if open_reply else None,
            logprobs=request.logprobs,
            sampling=SamplingFields.of(request.model_extra),
        )
        raw = output_text(model, generation, skip_special_tokens=True, keep_stop=False)
        output = parse_output(raw, thinking and raw.startswith("<think>"))
        if open_reply and open_reply.text and not output.tool_calls:
            # A tool call continued from an aborted text: read the reply as a whole.
            whole = parse_output(open_reply.text + raw, thinking)
            if whole.tool_calls:
                output = whole
        choices.append(ChatChoice(generation, output, new_call_ids(output, reply_rng)))
    head = sim.head("chatcmpl", "chat.completion")

    def body() -> dict[str, Any]:
        return chat_body(sim, request, head, prompt_ids, choices, started)

    chunks = None
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        send_ids = dialect.stream_prompt_ids(request, prompt_ids)

        def chunks() -> Iterator[Chunk]:
            return chat_chunks(
                dialect,
                model,
                head,
                choices,
                send_ids,
                thinking,
                request.logprobs,
                include_usage,
                len(prompt_ids),
            )

    return Answer(len(prompt_ids), [choice.generation for choice in choices], body, chunks)


def chat_body(
    sim: Simulator,
    request: ChatRequest,
    head: dict[str, Any],
    prompt_ids: list[int],
    choices: list[ChatChoice],
    started: float,
) -> dict[str, Any]:
    """The non-streamed answer: the choices, then usage and the engine's own fields."""
    model, dialect, weight_version = sim.model, sim.dialect, sim.weight_version
    bodies = []
    for index, choice in enumerate(choices):
        generation = choice.generation
        logprobs = (
            chat_logprobs(model, generation.ids, generation.logprobs, request.top_logprobs or 0)
            if request.logprobs
            else None
        )
        body: dict[str, Any] = {
            "index": index,
            "message": dialect.message(choice),
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }
        body.update(
            dialect.choice_fields(request, generation, prompt_ids, model.eos_id, weight_version, started)
        )
        bodies.append(body)
    completion_tokens = sum(len(choice.generation.ids) for choice in choices)
    answer = {**head, "choices": bodies, "usage": usage(len(prompt_ids), completion_tokens)}
    answer.update(dialect.answer_fields(request, prompt_ids, weight_version))
    return answer
