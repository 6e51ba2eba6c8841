"""The token routes: vLLM's ``POST /v1/completions`` and SGLang's ``POST /generate``.

Both take a rendered prompt as token ids (or as text), which the model reads back into a
conversation (``prompts.py``) and continues, from the reply so far when the prompt ends inside
one. Both are served whichever engine is imitated, each in its own engine's shape.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from starlette.responses import Response

from buffer.simulator.experts import routed_experts
from buffer.simulator.protocol import CompletionRequest, GenerateRequest, stop_strings
from buffer.simulator.replies import Limits
from buffer.simulator.sampling import SamplingFields
from buffer.simulator.server import Answer, Simulator, json_response
from buffer.simulator.shapes import completion_logprobs, meta_info, output_text, usage
from buffer.simulator.streaming import Chunk, completion_chunks, generate_chunks


def prepare_completion(
    sim: Simulator, request: CompletionRequest, reply_rng: random.Random
) -> Answer | Response:
    model = sim.model
    prompt_ids = request.prompt if isinstance(request.prompt, list) else model.encode(request.prompt)
    problem = sim.bad_ids(prompt_ids)
    if problem:
        return sim.error(400, problem, "BadRequestError", "prompt")
    prompt = sim.prompts.tokens(prompt_ids)
    limits = Limits(request.max_tokens, stop_strings(request.stop), tuple(request.stop_token_ids or ()))
    generations = [
        sim.draft(
            prompt.plan,
            limits,
            reply_rng,
            prompt.partial_ids,
            prompt.partial_text,
            logprobs=request.logprobs is not None,
            sampling=SamplingFields.of(request.model_extra),
        )
        for _ in range(request.n)
    ]
    texts = [
        output_text(model, generation, request.skip_special_tokens, request.include_stop_str_in_output)
        for generation in generations
    ]
    head = sim.head("cmpl", "text_completion")

    def body() -> dict[str, Any]:
        choices = []
        for index, (generation, text) in enumerate(zip(generations, texts, strict=True)):
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": completion_logprobs(model, generation) if request.logprobs is not None else None,
                "finish_reason": generation.finish_reason,
                **sim.dialect.stop_field(generation, model.eos_id),
            }
            if request.return_token_ids:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = generation.ids
            choices.append(choice)
        completion_tokens = sum(len(generation.ids) for generation in generations)
        answer = {**head, "choices": choices, "usage": usage(len(prompt_ids), completion_tokens)}
        return {**answer, **sim.dialect.completion_fields(sim.weight_version)}

    chunks = None
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunks() -> Iterator[Chunk]:
            return completion_chunks(
                model,
                head,
                generations,
                texts,
                prompt_ids if request.return_token_ids else None,
                request.logprobs is not None,
                request.skip_special_tokens,
                include_usage,
                len(prompt_ids),
            )

    return Answer(len(prompt_ids), generations, body, chunks)


def prepare_generate(sim: Simulator, request: GenerateRequest, reply_rng: random.Random) -> Answer | Response:
    model = sim.model
    started = time.monotonic()
    if request.input_ids is not None:
        prompt_ids = request.input_ids
    elif request.text is not None:
        prompt_ids = model.encode(request.text)
    else:
        prompt_ids = []
    problem = sim.bad_ids(prompt_ids)
    if problem:
        sim.stats.by_status[400] += 1
        return json_response({"error": {"message": problem}}, 400)
    params = request.sampling_params
    max_new_tokens = params.get("max_new_tokens", 128)
    limits = Limits(
        int(max_new_tokens) if max_new_tokens is not None else None,
        stop_strings(params.get("stop")),
        tuple(params.get("stop_token_ids") or ()),
    )
    prompt = sim.prompts.tokens(prompt_ids)
    generation = sim.draft(
        prompt.plan,
        limits,
        reply_rng,
        prompt.partial_ids,
        prompt.partial_text,
        logprobs=request.return_logprob,
        sampling=SamplingFields.of(params),
    )
    skip_special_tokens = bool(params.get("skip_special_tokens", True))
    text = output_text(model, generation, skip_special_tokens, keep_stop=bool(params.get("no_stop_trim")))

    def body() -> dict[str, Any]:
        info = meta_info(generation, len(prompt_ids), sim.weight_version, request.return_logprob, started)
        if request.return_routed_experts and sim.config.routed_experts:
            info.update(routed_experts(sim.config.routed_experts, [*prompt_ids, *generation.ids]))
        return {"text": text, "output_ids": generation.ids, "meta_info": info}

    chunks = None
    if request.stream:

        def chunks() -> Iterator[Chunk]:
            return generate_chunks(
                model,
                generation,
                text,
                skip_special_tokens,
                len(prompt_ids),
                sim.weight_version,
                request.return_logprob,
                started,
            )

    return Answer(len(prompt_ids), [generation], body, chunks)
