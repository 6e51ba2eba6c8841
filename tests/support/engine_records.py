"""What a simulated engine received and sampled, and whether token records account for it: the
oracle of the token-faithful tests (tests/simulator/test_simulator.py,
tests/toolkit/test_token_faithful.py)."""

from __future__ import annotations

from typing import Any


def sampled(
    engine: str, request: dict[str, Any], answer: dict[str, Any]
) -> tuple[Any, list[int], list[float]]:
    """((prompt ids, seed), output ids, logprobs) of one exchange, read where the engine puts them."""
    if engine == "sglang":
        logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        key = (tuple(request["input_ids"]), request["sampling_params"].get("sampling_seed"))
        return key, answer["output_ids"], logprobs
    [choice] = answer["choices"]
    return (
        (tuple(request["prompt"]), request.get("seed")),
        choice["token_ids"],
        choice["logprobs"]["token_logprobs"],
    )


def covered(
    answers: dict[Any, list[tuple[list[int], list[float]]]],
    prompt: list[int],
    seed: int,
    output: list[int],
    logprobs: list[float],
    done: int,
) -> bool:
    """Whether requests the simulator answered make up ``output[done:]``: one asked for ``prompt`` and
    the output so far, and sampled the next piece of it (with these logprobs), and so on to its end."""
    if done == len(output):
        return True
    for ids, piece_logprobs in answers.get((tuple(prompt + output[:done]), seed), []):
        end = done + len(ids)
        matches = ids and output[done:end] == ids and logprobs[done:end] == piece_logprobs
        if matches and covered(answers, prompt, seed, output, logprobs, end):
            return True
    return False
