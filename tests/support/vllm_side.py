"""Run by the Python that has vLLM and torch (``.vllm-venv``), never by the project's own: the tiny
model the vLLM tests serve, and the teacher-forced scores the samples are checked against.

    python vllm_side.py build DIR      DIR holds the tokenizer files; writes config and random weights
    python vllm_side.py score DIR      stdin: [{"prompt_ids": [...], "output_ids": [...],
                                                 "temperature": 1.0}, ...]   (temperature optional)
                                       stdout: [[logprob of each output id], ...] (float32, as served)

The model is a Qwen3 with random weights, small enough for a 2-core CPU: the numbers mean
nothing, which is the point. What a test checks is that what the project kept is exactly what
the engine received and sampled, and that the logprobs it kept are the model's own, scored again
here by ``transformers`` from the same weights (teacher forcing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

SEED = 1234


def build(directory: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(SEED)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention has kernels for some head sizes only (not 16)
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    # Random weights of the usual scale make every token nearly equally likely; a wider output
    # layer (logits with a spread of about 2) gives distributions with a shape, so temperature and
    # top-p matter, without the collapse onto one token that tied embeddings of that scale give.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.18)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id})
    )


def score(directory: Path, requests: list[dict[str, Any]]) -> list[list[float]]:
    """The logprob of each output id after the prompt and the ids before it, at the request's
    temperature: the sampling distribution's when nothing else (top-p, top-k) filtered it."""
    model = Qwen3ForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.eval()
    scores = []
    with torch.no_grad():
        for request in requests:
            prompt, output = request["prompt_ids"], request["output_ids"]
            ids = torch.tensor([prompt + output])
            logits = model(ids).logits[0].float() / float(request.get("temperature", 1.0))
            logprobs = torch.log_softmax(logits, dim=-1)
            start = len(prompt) - 1
            scores.append([logprobs[start + i, token].item() for i, token in enumerate(output)])
    return scores


def main() -> None:
    command, directory = sys.argv[1], Path(sys.argv[2])
    if command == "build":
        build(directory)
    elif command == "score":
        json.dump(score(directory, json.load(sys.stdin)), sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
