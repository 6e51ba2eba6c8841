"""The sampling parameters a session pins: what training assumes, whatever the agent sends.

A harness that sets its own temperature or top-p makes logprobs of another distribution than
the one the trainer computes. A session (``POST /sessions`` ``sampling``) or its task
(``/start_rollout`` ``session_sampling``) names the parameters training assumes; each call is
sent with them, the agent's own values overwritten, and ``max_tokens`` (with
``max_completion_tokens``) capped rather than overwritten. The call records what the engine was
sent and, apart, what the agent asked (``Call.asked``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from buffer.errors import InvalidInput

_Number = Annotated[float, Field(allow_inf_nan=False)]


class PinnedSampling(BaseModel):
    """The sampling fields a session may pin, in OpenAI's names (both engines take them in a
    chat completion, and the token routes map them)."""

    model_config = ConfigDict(extra="forbid")
    temperature: Annotated[_Number, Field(ge=0)] | None = None
    top_p: Annotated[_Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[_Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[_Number, Field(gt=0)] | None = None
    frequency_penalty: Annotated[_Number, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[_Number, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="a cap on the agent's")


#: The fields that cap the agent's budget rather than replace it.
_BUDGETS = ("max_tokens", "max_completion_tokens")


def pinned(value: Any, field: str) -> dict[str, Any]:
    """``value`` (a mapping, or slime's JSON string of one) as the fields to pin; ``InvalidInput``
    naming ``field`` and the reason."""
    if value is None:
        return {}
    try:
        if isinstance(value, str):
            checked = PinnedSampling.model_validate_json(value)
        else:
            checked = PinnedSampling.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in (field, *error["loc"]))
        raise InvalidInput.one(where, error["msg"]) from None
    return checked.model_dump(exclude_none=True)


def pin(body: dict[str, Any], pins: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The body the engine is sent, and the agent's own values of the pinned fields (None: no
    pins). ``max_tokens`` caps the agent's ``max_tokens`` or ``max_completion_tokens``."""
    if not pins:
        return body, None
    sent = dict(body)
    asked = {key: body.get(key) for key in pins if key != "max_tokens"}
    for key, value in pins.items():
        if key != "max_tokens":
            sent[key] = value
    cap = pins.get("max_tokens")
    if cap is not None:
        named = [key for key in _BUDGETS if isinstance(body.get(key), int)]
        for key in _BUDGETS:
            if key in body:
                asked[key] = body[key]
        for key in named:
            sent[key] = min(body[key], cap)
        if not named:
            sent["max_tokens"] = cap
    return sent, asked
