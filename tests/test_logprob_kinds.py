"""buffer.logprob_kinds: what each engine's logprobs are, per mode and request (issue 20, item 2)."""

from __future__ import annotations

from typing import Any

import pytest

from buffer.logprob_kinds import explain, logprobs_kind, turn_kind

#: Every field that shapes the distribution, set to leave it as it is.
NEUTRAL: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def sampling(**changes: Any) -> dict[str, Any]:
    return {**NEUTRAL, **changes}


@pytest.mark.parametrize(
    ("engine", "mode", "request_fields", "kind"),
    [
        # vLLM's default: the model's logprobs, before temperature, filters and penalties.
        ("vllm", None, sampling(), "sampling"),
        ("vllm", None, sampling(temperature=0.6), "raw"),
        ("vllm", None, sampling(top_p=0.9), "raw"),
        ("vllm", None, sampling(top_k=20), "raw"),
        ("vllm", None, sampling(repetition_penalty=1.05), "raw"),
        ("vllm", None, sampling(logit_bias={"7": 5}), "raw"),
        ("vllm", "raw_logprobs", sampling(min_p=0.1), "raw"),
        # --logprobs-mode processed_logprobs: after all of them, whatever the request.
        ("vllm", "processed_logprobs", sampling(temperature=0.6, top_p=0.9, top_k=20), "sampling"),
        ("vllm", "processed_logprobs", {}, "sampling"),
        ("vllm", "processed_logits", sampling(), "raw"),  # logits are no logprobs
        # SGLang: after penalties and temperature, before top-p, top-k and min-p.
        ("sglang", None, sampling(temperature=0.6, repetition_penalty=1.1), "sampling"),
        ("sglang", None, sampling(temperature=0.6, top_p=0.95), "raw"),
        ("sglang", None, sampling(top_k=20), "raw"),
        ("sglang", "processed_logprobs", sampling(top_k=20), "raw"),  # SGLang has no such mode
        # SGLANG_RETURN_ORIGINAL_LOGPROB=1: before temperature too.
        ("sglang", "raw_logprobs", sampling(temperature=0.6), "raw"),
        ("sglang", "raw_logprobs", sampling(), "sampling"),
        # Greedy samples from no distribution.
        ("sglang", None, sampling(temperature=0.0), "raw"),
        ("vllm", "processed_logprobs", sampling(temperature=0), "raw"),
        # Either engine: what both would say, else unknown.
        ("auto", None, sampling(), "sampling"),
        ("auto", None, sampling(temperature=0.6), "unknown"),
        ("auto", None, sampling(top_p=0.9), "raw"),
    ],
)
def test_the_kind_follows_the_engine_its_mode_and_the_request(
    engine: str, mode: str | None, request_fields: dict[str, Any], kind: str
) -> None:
    assert logprobs_kind(engine, request_fields, mode) == kind


@pytest.mark.parametrize(("engine", "left"), [("vllm", "presence_penalty"), ("sglang", "top_k")])
def test_a_field_left_to_the_server_may_be_the_models_default_so_it_is_unknown(
    engine: str, left: str
) -> None:
    # Both engines fill an unset field from generation_config.json (Qwen3: top_k 20, top_p 0.95).
    fields = {name: value for name, value in NEUTRAL.items() if name != left}
    assert logprobs_kind(engine, fields) == "unknown"
    assert left in explain(engine, fields)


def test_what_to_change_names_the_engines_own_setting() -> None:
    assert "--logprobs-mode processed_logprobs" in explain("vllm", sampling(temperature=0.6))
    assert "top_p 1.0, top_k -1 and min_p 0.0" in explain("sglang", sampling(top_p=0.9))
    assert 'engine: "vllm" or "sglang"' in explain("auto", sampling(temperature=0.6))


def test_a_turn_says_what_its_logprobs_are_and_one_that_does_not_is_unknown() -> None:
    assert turn_kind({"output_logprobs": [-0.5], "logprobs": "raw"}) == "raw"
    assert turn_kind({"output_logprobs": [-0.5]}) == "unknown"
    assert turn_kind({"output_logprobs": None, "logprobs": "sampling"}) is None


@pytest.mark.parametrize(
    "sampling",
    [
        {"structured_outputs": {"regex": "[0-9]+"}},
        {"guided_json": {"type": "object"}},
        {"json_schema": "{}"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "calculator"}}},
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang", "auto"])
def test_logprobs_sampled_under_a_grammar_are_constrained_whatever_the_engine_and_mode(
    engine: str, sampling: dict[str, Any]
) -> None:
    """Both engines mask the logits with the grammar before taking logprobs: the masked
    distribution's, which no trainer computes (found against a real vLLM: forced tokens off the
    model's own logprobs by up to 11 nats)."""
    for mode in (None, "processed_logprobs"):
        assert logprobs_kind(engine, {"temperature": 1.0, **sampling}, mode) == "constrained"
    assert "structured" in explain(engine, sampling) or "constrains" in explain(engine, sampling)


def test_a_free_tool_choice_or_a_text_response_format_is_not_a_constraint() -> None:
    for sampling in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {"response_format": {"type": "text"}}):
        assert logprobs_kind("vllm", {"temperature": 1.0, **sampling}, "processed_logprobs") == "sampling"
