"""What sampling does to a token's logprob, in the simulated model, and what each engine reports.

The simulated model's distribution at each step is two-level: the token the reply goes on with
has the raw logprob ``raw`` (made up, drawn per token), and the rest of the vocabulary shares
what is left equally. The engine samples from that distribution after the request's sampling
steps, in vLLM's order: temperature, min-p, top-k, top-p, each renormalising what it keeps. The
logprob of the token under that last distribution is its *sampling* logprob; greedy decoding
(temperature 0) has none, and engines report the raw one.

What an engine reports is ``engines.Dialect.reported_logprobs``'s: vLLM the raw logprob unless
started with ``--logprobs-mode processed_logprobs``; SGLang the tempered one, before its filters,
or the raw one with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set. The simulator reads the request's
``temperature``, ``top_p``, ``top_k`` and ``min_p`` (fields a real server takes; the reply
itself does not depend on them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GREEDY_BELOW = 1e-5  # both engines' threshold for temperature 0


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The request's fields that shape the distribution (absent: the engine's default, neutral)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    @classmethod
    def of(cls, fields: Mapping[str, Any] | None) -> SamplingFields:
        """The fields of a request body (``model_extra``) or of SGLang's ``sampling_params``."""
        fields = fields or {}
        return cls(
            temperature=_number(fields.get("temperature"), 1.0),
            top_p=_number(fields.get("top_p"), 1.0),
            top_k=int(_number(fields.get("top_k"), -1)),
            min_p=_number(fields.get("min_p"), 0.0),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def tempered_logprob(raw: float, others: int, temperature: float) -> float:
    """The token's logprob after temperature alone (log-softmax of the logits over ``temperature``)."""
    if temperature < GREEDY_BELOW or temperature == 1.0:
        return raw
    return math.log(_tempered(raw, others, temperature)[0])


def sampling_logprob(raw: float, others: int, fields: SamplingFields) -> float:
    """The token's logprob under the distribution it is sampled from (``raw`` when greedy)."""
    if fields.greedy:
        return raw
    own, each_other = _tempered(raw, others, fields.temperature)
    kept = others
    if fields.min_p > 0 and each_other < fields.min_p * max(own, each_other):
        kept = 0
    if fields.top_k > 0:
        kept = min(kept, fields.top_k - 1)
    total = own + kept * each_other
    own, each_other = own / total, each_other / total
    if fields.top_p < 1.0:  # the token leads; others join while the mass before them is <= top_p
        room = fields.top_p - own
        kept = 0 if room < 0 else min(kept, math.floor(room / each_other) + 1)
        own = own / (own + kept * each_other)
    return math.log(own)


def _tempered(raw: float, others: int, temperature: float) -> tuple[float, float]:
    """The token's probability and each other token's, after ``temperature``."""
    rest = max(1e-300, -math.expm1(raw))  # 1 - exp(raw), what the others share
    own_logit = raw / temperature
    other_logit = (math.log(rest) - math.log(others)) / temperature
    top = max(own_logit, other_logit)
    own, each_other = math.exp(own_logit - top), math.exp(other_logit - top)
    total = own + others * each_other
    return own / total, each_other / total


def _number(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return float(value)
