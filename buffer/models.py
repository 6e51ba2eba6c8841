"""The shapes at the HTTP edge: trajectories and request bodies, validated with pydantic.

Validation errors become ``InvalidInput`` naming each field (``messages.2.content``) and the
reason; nothing is buffered from a request that fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, NotRequired, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from typing_extensions import TypedDict

from buffer.encoding import INT64_MAX, INT64_MIN
from buffer.errors import InvalidInput

_T = TypeVar("_T")
_N = TypeVar("_N", int, int | None)

#: The integers the buffer takes: signed 64-bit, which orjson (and most JSON readers) can carry.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

FiniteNumber = Annotated[float, Strict(), Field(allow_inf_nan=False)]
InstanceId = Annotated[StrictStr, Field(min_length=1)] | Annotated[Int64, Strict()]
Ratio = Annotated[float, Field(ge=0, le=1)]

# Trajectories are TypedDicts, not models: pydantic validates them straight from the request
# bytes into plain dicts (extra keys kept), the form the buffer stores, in one pass.


class ContentPart(TypedDict):
    """One part of a multimodal message: ``{"type": "text", "text": ...}``, an image, ..."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    type: StrictStr


class ChatMessage(TypedDict):
    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    role: Annotated[StrictStr, Field(min_length=1)]
    content: NotRequired[StrictStr | list[ContentPart] | None]
    tool_calls: NotRequired[list[dict[str, Any]] | None]


def _content_or_tool_calls(message: ChatMessage) -> ChatMessage:
    if message.get("content") is None and not (message["role"] == "assistant" and message.get("tool_calls")):
        raise ValueError("content may be null only on an assistant message with tool_calls")
    return message


CheckedMessage = Annotated[ChatMessage, AfterValidator(_content_or_tool_calls)]


class Trajectory(TypedDict):
    """One trajectory as generators write it; keys beyond these are kept as they are."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    instance_id: InstanceId
    uid: NotRequired[Annotated[StrictStr, Field(min_length=1)] | None]
    messages: Annotated[list[CheckedMessage], Field(min_length=1)]
    #: A finite number, or named rewards (the task's ``reward_key`` picks the one trained on).
    reward: FiniteNumber | dict[str, FiniteNumber]
    extra_info: NotRequired[dict[str, Any]]
    task_type: NotRequired[Annotated[StrictStr, Field(min_length=1)] | None]


class TrajectoryBatch(TypedDict):
    trajectories: list[Trajectory]


TRAJECTORY = TypeAdapter(Trajectory)
TRAJECTORIES = TypeAdapter(list[Trajectory])
TRAJECTORY_BATCH = TypeAdapter(TrajectoryBatch)


def parse_json(adapter: TypeAdapter[_T], body: bytes) -> _T:
    """Parse and validate a request body; errors become ``InvalidInput`` naming each field."""
    if not body.strip():
        raise InvalidInput.one("body", "is empty; expected JSON")
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        raise invalid_input(exc.errors(include_url=False, include_input=False)) from None


class StartRolloutRequest(BaseModel):
    """The trainer's ``/start_rollout`` payload. slime sends numbers as strings: accepted."""

    model_config = ConfigDict(extra="allow")

    task_type: Annotated[StrictStr, Field(min_length=1)]
    num_repeat_per_sample: Int64 | None = Field(None, ge=1, description="the group size")
    num_process: Int64 | None = Field(None, ge=1, description="trajectories in flight")
    num_epoch: Int64 | None = Field(None, ge=1)
    max_tokens: Int64 | None = Field(None, ge=1)
    group_timeout_seconds: float | None = Field(None, gt=0)
    min_valid_group_size_ratio: Ratio = 1.0
    min_valid_item_size_ratio: Ratio = 0.7
    min_timeout_group_size_ratio: Ratio = 0.7
    skip_instance_ids: list[InstanceId] | None = None
    remote_engine_url: str | None = None
    remote_buffer_url: str | None = None
    input_file: str | None = None
    sampling_params: dict[str, Any] | None = None
    reward_key: str | None = None
    restart: bool = Field(False, description="cancel the task's running job and start a new one")
    rollout_name: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None,
        description="the buffer task and job this run writes to (default: task_type); one generator can "
        "run under several names at once, e.g. for evaluation beside training",
    )
    evaluation: bool = Field(
        False, description="keep every finished group as written: no filter, normalisation or padding"
    )


class GetRolloutDataRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    batch_size: int | None = Field(
        None, ge=-1, description="at most this many items, in whole groups; -1: all"
    )
    task_type: str | None = Field(
        None, description="only this task's groups; default all tasks, oldest first"
    )
    wait_s: float = Field(0.0, ge=0, le=300, description="wait up to this long for a group to be ready")

    @field_validator("batch_size")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        return _batch_size(value)


class ReadRequest(BaseModel):
    """slime's older ``/buffer/read``: wait up to ``timeout`` for ``batch_size`` items."""

    model_config = ConfigDict(extra="allow")

    batch_size: int = Field(-1, ge=-1)
    timeout: float = Field(0.0, ge=0, le=300)
    wait: bool = False
    task_type: str | None = None

    @field_validator("batch_size")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        return _batch_size(value)


def _batch_size(value: _N) -> _N:
    if value == 0:
        raise ValueError("must be -1 (everything ready) or at least 1")
    return value


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def invalid_input(errors: Sequence[Any]) -> InvalidInput:
    """Turn pydantic's errors (``ValidationError.errors()``) into ``InvalidInput``, one entry
    per field.

    Union members add a segment naming the type (``content.str``); those are dropped and
    the reasons for one field joined, so the field reads as the user wrote it.
    """
    reasons: dict[str, list[str]] = {}
    for error in errors:
        parts = [
            str(part)
            for part in error["loc"]
            if not (isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part))
        ]
        field = ".".join(parts) or "body"
        message = error["msg"].removeprefix("Value error, ")
        if message not in reasons.setdefault(field, []):
            reasons[field].append(message)
    return InvalidInput((field, " or ".join(messages)) for field, messages in reasons.items())
