"""What an engine's logprobs are: the sampling distribution's, or not (``logprobs_kind``).

A token's *sampling logprob* is its log-probability under the distribution it was drawn from:
the model's logits after every step of the request's sampling (penalties and logit bias,
temperature, then the top-p/top-k/min-p filters, renormalised). An importance ratio (slime's
``--use-tis``, any off-policy correction) needs exactly that. Neither engine returns it by
default whatever the request asks (read in their code):

==========================  ==================================================  ==============
engine, mode                what ``logprobs`` are (chat and the token route)    sampling when
==========================  ==================================================  ==============
vLLM ``raw_logprobs``       the model's, before penalties, temperature and      nothing changes
(its default)               filters (``v1/sample/sampler.py``, ``Sampler``)     the distribution
vLLM ``processed_logprobs`` after all of them (``TopKTopPSampler``)             always
vLLM ``*_logits``           logits, not logprobs                                never
SGLang (its default)        after penalties and temperature, before top-p,      no filter set
                            top-k and min-p (``layers/sampler.py``)
SGLang with                 after penalties, before temperature and filters     temperature 1,
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (declared as ``raw_logprobs``)             no filter set
==========================  ==================================================  ==============

Greedy decoding (temperature 0) samples from no distribution: its logprobs are never sampling
logprobs. A field the request leaves unset is not known to be neutral: both engines take it
from the model's ``generation_config.json`` by default (vLLM's ``--generation-config auto``,
SGLang's ``--sampling-defaults model``), which for Qwen3 means temperature 0.6, top-p 0.95,
top-k 20. So the answer is one of three kinds:

- ``"sampling"``: the sampling distribution's, known from the engine, its mode and the request;
- ``"raw"``: known not to be (a step the request sets changes the distribution after the point
  where the engine takes its logprobs), or not logprobs at all;
- ``"unknown"``: it cannot be known (the engine is not named and the two would differ, or a field
  that matters is left to the server's defaults);
- ``"constrained"``: the request constrained decoding (structured outputs, a JSON schema, a regex,
  a grammar, a required tool call). Both engines mask the logits with the grammar before they take
  logprobs (vLLM ``v1/worker/gpu_model_runner.py``, the bitmask before the sampler; SGLang's
  ``apply_logits_bias``), so these are the masked distribution's: what was sampled, but not the
  model's, which is what a trainer computes. A token the grammar forced has logprob 0 there.

A shared leaf: the toolkit marks each token record (``turn["logprobs"]``) with it, the service
validates and counts it, the trainer side hands over only ``"sampling"`` logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

LogprobsKind = Literal["sampling", "raw", "unknown", "constrained"]
KINDS: tuple[str, ...] = get_args(LogprobsKind)

#: An engine's logprobs mode, in vLLM's words (``--logprobs-mode``). SGLang's equivalents: its
#: default (None here), and ``raw_logprobs`` for ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.
LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
MODES: tuple[str, ...] = get_args(LogprobsMode)

#: The engines whose behaviour is known, by the toolkit's dialect names.
ENGINES = ("vllm", "sglang")

_MISSING = object()

#: Request fields that constrain decoding to a grammar (vLLM's and SGLang's names, the OpenAI ones).
_CONSTRAINTS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "json_schema",
    "regex",
    "ebnf",
)
#: Each step of sampling, and the request fields that set it, with their neutral test.
_TEMPERATURE = ("temperature",)
_FILTERS = ("top_p", "top_k", "min_p")
_PENALTIES = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "min_new_tokens",
    "bad_words",
    "allowed_token_ids",
    "logits_processors",
    "custom_logit_processor",
)
_NEUTRAL_VALUE: dict[str, float] = {
    "temperature": 1.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "min_new_tokens": 0,
}

#: The fields an engine takes from the model's generation config when a request leaves them unset
#: (vLLM: ``ModelConfig.get_diff_sampling_param``; SGLang: ``ModelConfig.get_default_sampling_params``).
MODEL_DEFAULTS: dict[str, frozenset[str]] = {
    "vllm": frozenset(
        {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
        | {"presence_penalty", "frequency_penalty"}
    ),
    "sglang": frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}),
}

#: The steps whose effect each engine's logprobs include, by mode (None: the engine's default).
_COVERED: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("vllm", None): (),
    ("vllm", "raw_logprobs"): (),
    ("vllm", "processed_logprobs"): (*_TEMPERATURE, *_FILTERS, *_PENALTIES),
    ("sglang", None): (*_TEMPERATURE, *_PENALTIES),
    ("sglang", "processed_logprobs"): (*_TEMPERATURE, *_PENALTIES),  # SGLang never filters them
    ("sglang", "raw_logprobs"): _PENALTIES,
}

#: What to change, per engine, for its logprobs to be sampling logprobs.
FIXES: dict[str, str] = {
    "vllm": "start vLLM with --logprobs-mode processed_logprobs and say so (logprobs_mode: "
    '"processed_logprobs" in /start_rollout)',
    "sglang": "SGLang returns logprobs before its top-p, top-k and min-p filters whatever its flags "
    "(and before temperature with SGLANG_RETURN_ORIGINAL_LOGPROB set): sample with top_p 1.0, "
    "top_k -1 and min_p 0.0 set in sampling_params, and that variable unset",
    "auto": 'name the engine (engine: "vllm" or "sglang" in /start_rollout): what its logprobs are '
    "depends on it",
}


def logprobs_kind(engine: str, sampling: Mapping[str, Any] | None, mode: str | None = None) -> LogprobsKind:
    """What ``engine``'s logprobs are for a request with these sampling fields (``sampling``: the
    request's, as sent; ``mode``: the engine's logprobs mode, None for its default).

    An engine not in ``ENGINES`` (``"auto"``: either) gives the kind both engines agree on, else
    ``"unknown"``."""
    if constraint(sampling) is not None:
        return "constrained"
    if engine not in ENGINES:
        kinds = {logprobs_kind(name, sampling, mode) for name in ENGINES}
        return kinds.pop() if len(kinds) == 1 else "unknown"
    if mode in ("raw_logits", "processed_logits"):
        return "raw"  # logits, not logprobs
    covered = _COVERED.get((engine, mode))
    if covered is None:
        return "unknown"
    fields = sampling or {}
    temperature = fields.get("temperature", _MISSING)
    if _is_number(temperature) and float(temperature) < 1e-5:
        return "raw"  # greedy: no distribution was sampled from
    left_to_server = False
    for name in (*_TEMPERATURE, *_FILTERS, *_PENALTIES):
        if name in covered:
            continue
        value = fields.get(name, _MISSING)
        if value is _MISSING or value is None:
            left_to_server = left_to_server or name in MODEL_DEFAULTS[engine]
        elif not _neutral(name, value):
            return "raw"
    return "unknown" if left_to_server else "sampling"


def explain(engine: str, sampling: Mapping[str, Any] | None, mode: str | None = None) -> str:
    """Why ``engine``'s logprobs are not sampling logprobs for this request, and what to change."""
    fields = sampling or {}
    kind = logprobs_kind(engine, fields, mode)
    if kind == "sampling":
        return "they are sampling logprobs"
    if kind == "constrained":
        return (
            f"the request constrains decoding ({constraint(fields)}): the engine's logprobs are the "
            "grammar-masked distribution's, not the model's; train such turns without rollout logprobs"
        )
    if engine not in ENGINES:
        if kind == "unknown":
            return f"the engine is not named and vLLM and SGLang differ here: {FIXES['auto']}"
        return "; ".join(f"{name}: {explain(name, fields, mode)}" for name in ENGINES)
    if mode in ("raw_logits", "processed_logits"):
        return f"--logprobs-mode {mode} returns logits, not logprobs: {FIXES[engine]}"
    covered = _COVERED.get((engine, mode), ())
    changed = [
        f"{name} {fields[name]!r}"
        for name in (*_TEMPERATURE, *_FILTERS, *_PENALTIES)
        if name not in covered and fields.get(name) is not None and not _neutral(name, fields[name])
    ]
    if kind == "raw":
        what = ", ".join(changed) if changed else "temperature 0 (greedy)"
        return f"{engine} takes its logprobs before what this request sets ({what}): {FIXES[engine]}"
    unset = sorted(name for name in MODEL_DEFAULTS[engine] - set(covered) if fields.get(name) is None)
    return (
        f"the request leaves {', '.join(unset)} to {engine}, which takes them from the model's "
        "generation_config by default: set them in sampling_params"
        + (f", or {FIXES['vllm']}" if engine == "vllm" else "")
    )


def constraint(sampling: Mapping[str, Any] | None) -> str | None:
    """The request field that constrains decoding to a grammar, if one does."""
    fields = sampling or {}
    for name in _CONSTRAINTS:
        if fields.get(name):
            return name
    response_format = fields.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") in ("json_schema", "json_object"):
        return "response_format"
    tool_choice = fields.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        return "tool_choice"
    return None


#: What a trajectory's logprobs are, from its turns': the first of these any turn has (a turn
#: the trainer cannot have makes the whole trajectory one it cannot have as a whole).
_WORST_FIRST: tuple[LogprobsKind, ...] = ("raw", "constrained", "unknown", "sampling")


def trajectory_kind(turns: Iterable[Mapping[str, Any]]) -> LogprobsKind | None:
    """What a trajectory's logprobs are (``_WORST_FIRST`` of its turns' kinds); None when no turn
    has logprobs."""
    kinds = {turn_kind(turn) for turn in turns}
    return next((kind for kind in _WORST_FIRST if kind in kinds), None)


def turn_kind(turn: Mapping[str, Any]) -> LogprobsKind | None:
    """What a token record's logprobs are, as it says (``turn["logprobs"]``): None when it has no
    logprobs, ``"unknown"`` when its writer did not say."""
    if turn.get("output_logprobs") is None:
        return None
    kind = turn.get("logprobs")
    return kind if kind in KINDS else "unknown"


def _neutral(name: str, value: Any) -> bool:
    """Whether a field's value leaves the distribution as it is."""
    if name in _NEUTRAL_VALUE:
        return _is_number(value) and float(value) == _NEUTRAL_VALUE[name]
    if name == "top_p":
        return _is_number(value) and float(value) >= 1.0
    if name == "top_k":
        return _is_number(value) and int(value) <= 0  # -1 (or 0 in vLLM): no top-k
    return not value  # a bias, a word list, a processor: none given


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
