"""What a simulated engine received and sampled, and whether token records account for it: the
oracle of the token-faithful tests (tests/simulator/test_simulator.py,
tests/toolkit/test_token_faithful.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Expected:
    """What a trajectory's token records make, turn by turn: each turn's whole prompt (the tokens
    before it cut at its ``prompt_offset``, then its own ``prompt_ids``) and what it sampled; and,
    for a trajectory of one branch, the sample a trainer must get."""

    #: (whole prompt, output ids, output logprobs) of each turn.
    turns: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


def assert_sampled(answers: dict[Any, list[tuple[list[int], list[float]]]], item: dict[str, Any]) -> Expected:
    """Check that every turn of ``item`` is what the engine sampled after the prompt the turn
    shows (``covered``: aborted answers continued included); returns what the turns make."""
    expected = Expected()
    for index, turn in enumerate(item["turns"]):
        prompt = expected.tokens[: turn.get("prompt_offset", 0)] + turn["prompt_ids"]
        seed = (turn.get("sampling") or {}).get("seed")
        assert covered(answers, prompt, seed, turn["output_ids"], turn["output_logprobs"], 0), (
            f"{item.get('uid')}: turn {index} is not what the engine sampled after the prompt it shows"
        )
        expected.turns.append((prompt, turn["output_ids"], turn["output_logprobs"]))
        observed = prompt[len(expected.tokens) :] if expected.tokens else []
        expected.mask += [0] * len(observed) + [1] * len(turn["output_ids"])
        expected.log_probs += [0.0] * len(observed) + turn["output_logprobs"]
        expected.tokens = prompt + turn["output_ids"]
    return expected
