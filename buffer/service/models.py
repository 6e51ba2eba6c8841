"""The shapes at the HTTP edge: trajectories and request bodies, validated with pydantic.

Validation errors become ``InvalidInput`` naming each field (``messages.2.content``,
``turns.1.output_logprobs``) and the reason; nothing is buffered from a request that fails.

A trajectory may carry the engine's token records (``turns``): what each policy request received and
sampled, in token ids. Their checks that span fields (lengths that agree, a prompt that extends what the
previous turn provides, a turn that points at an assistant message) run after the single pass, only on
trajectories that have turns, and name the field as pydantic would.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from typing_extensions import TypedDict

from buffer import storable
from buffer.core.task import TaskSettings
from buffer.encoding import INT64_MAX, INT64_MIN
from buffer.errors import InvalidInput
from buffer.logprob_kinds import LogprobsKind, LogprobsMode

_T = TypeVar("_T")
_N = TypeVar("_N", int, int | None)

#: The integers the buffer takes: signed 64-bit, which orjson (and most JSON readers) can carry.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

FiniteNumber = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: A number in a request's settings: finite (``Infinity`` and ``NaN`` would reach the journal as null).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
InstanceId = Annotated[StrictStr, Field(min_length=1)] | Annotated[Int64, Strict()]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
#: A token id as engines use them: a non-negative 32-bit integer (the trainer's tensors are int32 or int64).
#: The range is checked after the single pass, a list at a time (`_first_bad_id`): pydantic's per-item
#: bounds cost more than parsing the ids (60 us against 23 us for 1,200 ids).
TokenId = Annotated[int, Strict(), Field(json_schema_extra={"minimum": 0, "exclusiveMaximum": 2**31})]
TOKEN_ID_LIMIT = 2**31
_HIGH_BYTE = 3 if sys.byteorder == "little" else 0
_BELOW_128 = bytes(range(128))
Count = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]

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
    #: The model's reasoning, as vLLM and SGLang return it beside the content.
    reasoning_content: NotRequired[StrictStr | None]
    #: True on each assistant message the policy produced in this trajectory (absent on all messages:
    #: the assistant messages after the last user message count as generated).
    generated: NotRequired[StrictBool]


def _content_or_tool_calls(message: ChatMessage) -> ChatMessage:
    if message.get("content") is None and not (message["role"] == "assistant" and message.get("tool_calls")):
        raise ValueError("content may be null only on an assistant message with tool_calls")
    return message


CheckedMessage = Annotated[ChatMessage, AfterValidator(_content_or_tool_calls)]


class Tool(TypedDict):
    """A tool the model was given, in OpenAI's form: ``{"type": "function", "function": {...}}``."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    type: Annotated[StrictStr, Field(min_length=1)]


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Turn(TypedDict):
    """One policy request of the trajectory, in the engine's token ids.

    The turn's full prompt is ``(full prompt + output_ids of the previous turn)[:prompt_offset] +
    prompt_ids``; ``prompt_offset`` 0 means ``prompt_ids`` is the whole prompt. A reply the engine
    aborted and the generator continued stays one turn: its output ids and logprobs are concatenated.
    """

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    prompt_ids: list[TokenId]
    prompt_offset: NotRequired[Count]
    output_ids: list[TokenId]
    #: The engine's logprob of each output id, or null when the engine gave none.
    output_logprobs: NotRequired[list[FiniteNumber] | None]
    #: What ``output_logprobs`` are: the sampling distribution's, known not to be (``raw``: before
    #: the temperature or filters the request set), or ``unknown`` (absent: unknown). Only sampling
    #: logprobs are handed to a trainer as rollout logprobs (``buffer.logprob_kinds``).
    logprobs: NotRequired[LogprobsKind | None]
    finish_reason: FinishReason
    #: The index in ``messages`` of the assistant message this turn produced.
    message_index: Count
    weight_version: NotRequired[StrictStr | Annotated[Int64, Strict()] | None]
    sampling: NotRequired[dict[str, Any] | None]


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
    #: The tools the model was given (absent: none).
    tools: NotRequired[list[Tool] | None]
    #: The engine's token records, one per assistant message the policy generated, in order.
    turns: NotRequired[list[Turn] | None]


def _turns_agree(trajectory: Trajectory) -> Trajectory:
    """The checks on ``turns`` that span fields; a no-op without turns, so text-only writes pay nothing."""
    turns = trajectory.get("turns")
    if turns:
        errors = list(turn_errors(trajectory["messages"], turns))
        if errors:
            raise ValidationError.from_exception_data(
                "Trajectory",
                [
                    InitErrorDetails(
                        type=PydanticCustomError("turns", "{reason}", {"reason": reason}),
                        loc=loc,
                        input=value,
                    )
                    for loc, reason, value in errors
                ],
            )
    return trajectory


def turn_errors(
    messages: Sequence[ChatMessage], turns: Sequence[Turn]
) -> list[tuple[tuple[str | int, ...], str, object]]:
    """What is wrong across the fields of already typed turns: ``(loc, reason, value)`` for each."""
    errors: list[tuple[tuple[str | int, ...], str, object]] = []
    available = 0  # the previous turn's full prompt plus its output, in tokens
    last_index = -1
    for n, turn in enumerate(turns):
        output_ids = turn["output_ids"]
        for name in ("prompt_ids", "output_ids"):
            ids = turn[name]
            at = _first_bad_id(ids)
            if at is not None:
                errors.append((("turns", n, name, at), f"is {ids[at]}: a token id is in [0, 2**31)", ids[at]))
        logprobs = turn.get("output_logprobs")
        if logprobs is not None and len(logprobs) != len(output_ids):
            errors.append(
                (
                    ("turns", n, "output_logprobs"),
                    f"{len(logprobs)} logprobs for {len(output_ids)} output_ids; expected one per id",
                    len(logprobs),
                )
            )
        offset = turn.get("prompt_offset", 0)
        if offset > available:
            where = (
                "the first turn has no previous tokens" if n == 0 else f"turn {n - 1} provides {available}"
            )
            errors.append(
                (
                    ("turns", n, "prompt_offset"),
                    f"is {offset}, past the tokens available ({where})",
                    offset,
                )
            )
        index = turn["message_index"]
        if index >= len(messages):
            errors.append(
                (
                    ("turns", n, "message_index"),
                    f"is {index}, out of range for {len(messages)} messages",
                    index,
                )
            )
        elif messages[index]["role"] != "assistant":
            errors.append(
                (
                    ("turns", n, "message_index"),
                    f"points at a {messages[index]['role']!r} message, not an assistant one",
                    index,
                )
            )
        elif index <= last_index:
            errors.append(
                (
                    ("turns", n, "message_index"),
                    f"is {index}, not after the previous turn's {last_index}: turns go in order, "
                    "one per assistant message",
                    index,
                )
            )
        last_index = max(last_index, index)
        available = min(offset, available) + len(turn["prompt_ids"]) + len(output_ids)
    return errors


def _first_bad_id(ids: list[int]) -> int | None:
    """The index of the first id outside [0, 2**31), if any.

    Packed as C unsigned ints (which refuses negative and too large values), then the high byte of each
    read at once: a tenth of the time of ``min``/``max`` over the list, which matters at thousands of ids.
    """
    try:
        packed = array("I", ids)
    except OverflowError:  # a negative id, or one of 2**32 or more
        pass
    else:
        if packed.itemsize == 4 and not packed.tobytes()[_HIGH_BYTE::4].translate(None, _BELOW_128):
            return None  # no high byte of 128 or more: every id is below 2**31
    return next((i for i, value in enumerate(ids) if not 0 <= value < TOKEN_ID_LIMIT), None)


CheckedTrajectory = Annotated[Trajectory, AfterValidator(_turns_agree)]


class TrajectoryBatch(TypedDict):
    trajectories: list[CheckedTrajectory]


TRAJECTORY = TypeAdapter(CheckedTrajectory)
TRAJECTORIES = TypeAdapter(list[CheckedTrajectory])
TRAJECTORY_BATCH = TypeAdapter(TrajectoryBatch)


def parse_json(adapter: TypeAdapter[_T], body: bytes) -> _T:
    """Parse and validate a request body; errors become ``InvalidInput`` naming each field."""
    if not body.strip():
        raise InvalidInput.one("body", "is empty; expected JSON")
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        raise invalid_input(exc.errors(include_url=False, include_input=False)) from None


class TaskGrouping(BaseModel):
    """How a task groups and judges what is written to it: the fields ``/start_rollout`` and
    ``PUT /tasks/{name}`` share, and the ``TaskSettings`` they make."""

    num_repeat_per_sample: Int64 | None = Field(None, ge=1, description="the group size")
    group_timeout_seconds: FiniteFloat | None = Field(None, gt=0)
    min_valid_group_size_ratio: Ratio = 1.0
    min_valid_item_size_ratio: Ratio = 0.7
    min_timeout_group_size_ratio: Ratio = 0.7
    reward_key: str | None = None
    evaluation: bool = Field(
        False, description="keep every finished group as written: no filter, normalisation or padding"
    )
    max_staleness: Int64 | None = Field(
        None,
        ge=0,
        description="serve no group whose lowest policy version is more than this behind the trainer's; "
        "the generator keeps at most this + 1 reads of groups ahead of the trainer (absent: no bound)",
    )
    weight: FiniteFloat | None = Field(None, gt=0, description="the task's share in mixed reads (default 1)")

    def task_settings(self, defaults: TaskSettings) -> TaskSettings:
        """The task's settings: these fields where given, else ``defaults`` (the service's flags)."""
        return TaskSettings(
            group_size=self.num_repeat_per_sample or defaults.group_size,
            group_timeout_s=self.group_timeout_seconds or defaults.group_timeout_s,
            min_valid_group_size_ratio=self.min_valid_group_size_ratio,
            min_valid_item_size_ratio=self.min_valid_item_size_ratio,
            min_timeout_group_size_ratio=self.min_timeout_group_size_ratio,
            reward_key=self.reward_key,
            max_staleness=self.max_staleness,
            weight=self.weight,
        )


class StartRolloutRequest(TaskGrouping):
    """The trainer's ``/start_rollout`` payload. slime sends numbers as strings: accepted."""

    model_config = ConfigDict(extra="allow")

    task_type: Annotated[StrictStr, Field(min_length=1)]
    num_process: Int64 | None = Field(None, ge=1, description="trajectories in flight")
    num_epoch: Int64 | None = Field(None, ge=1)
    max_tokens: Int64 | None = Field(None, ge=1)
    skip_instance_ids: list[InstanceId] | None = None
    remote_engine_url: str | Annotated[list[StrictStr], Field(min_length=1)] | None = Field(
        None, description="the policy server's URL, or a list of them: a pool the generator spreads load over"
    )
    remote_buffer_url: str | None = None
    input_file: str | None = None
    sampling_params: dict[str, Any] | None = None
    logprobs_mode: LogprobsMode | None = Field(
        None,
        description="the engine's logprobs mode as it was started (vLLM's --logprobs-mode; "
        "raw_logprobs for SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB); null: the engine's default",
    )
    restart: bool = Field(
        False,
        description="cancel the task's running job and start a new one over the whole plan (without it, "
        "a start continues the task's unfinished job of the same plan: only what it did not make)",
    )
    rollout_name: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None,
        description="the buffer task and job this run writes to (default: task_type); one generator can "
        "run under several names at once, e.g. for evaluation beside training",
    )


class GetRolloutDataRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int | None = Field(
        None, ge=-1, description="at most this many items, in whole groups; -1: all"
    )
    task_type: str | None = Field(
        None, description="only this task's groups; default all tasks, oldest first"
    )
    wait_s: FiniteFloat = Field(0.0, ge=0, le=300, description="wait up to this long for a group to be ready")
    mix: (
        dict[Annotated[StrictStr, Field(min_length=1)], Annotated[float, Field(gt=0, allow_inf_nan=False)]]
        | None
    ) = Field(
        None,
        min_length=1,
        description='share the read between these tasks by weight, e.g. {"math": 3, "code": 1}',
    )

    @field_validator("batch_size")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        return _batch_size(value)


class ReadRequest(BaseModel):
    """slime's older ``/buffer/read``: wait up to ``timeout`` for ``batch_size`` items."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(-1, ge=-1)
    timeout: FiniteFloat = Field(0.0, ge=0, le=300)
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


def check_storable(request: BaseModel) -> None:
    """Refuse a request holding a value the journal cannot keep as it is (``Infinity`` in
    ``sampling_params``, an integer beyond 64 bits, a lone surrogate, deep nesting), naming
    the field: extra fields are taken as they come, and start a generator that is journaled."""
    found = storable.problem_at(request.model_dump())
    if found is not None:
        path, reason = found
        raise InvalidInput.one(storable.field_name(path), reason)


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
