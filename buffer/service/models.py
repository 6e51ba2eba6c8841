"""The shapes at the HTTP edge: trajectories and request bodies, validated with pydantic.

Validation errors become ``InvalidInput`` naming each field (``messages.2.content``,
``turns.1.output_logprobs``) and the reason; nothing is buffered from a request that fails.

A trajectory may carry the engine's token records (``turns``): what each policy request received and
sampled, in token ids. Their checks that span fields (lengths that agree, a prompt that extends what the
previous turn provides, a turn that points at an assistant message) run after the single pass, only on
trajectories that have turns, and name the field as pydantic would.

The write routes take the quick way first (``read_trajectory``, ``read_trajectories``): orjson parses the
body and a check of the shapes (``is_trajectory``) accepts what the pydantic schema accepts, walking the
messages but reading the token ids a list at a time, in C. Anything it is not sure of (a parse error, an
integer beyond 64 bits, a field of the wrong type) goes through the pydantic schema, which says what is wrong.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, TypeVar, get_args

import orjson
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
from buffer.logprob_kinds import KINDS as LOGPROB_KINDS
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
    messages: Sequence[ChatMessage], turns: Sequence[Turn], *, ids_checked: bool = False
) -> list[tuple[tuple[str | int, ...], str, object]]:
    """What is wrong across the fields of already typed turns: ``(loc, reason, value)`` for each
    (``ids_checked``: the token ids are known to be in range)."""
    errors: list[tuple[tuple[str | int, ...], str, object]] = []
    available = 0  # the previous turn's full prompt plus its output, in tokens
    last_index = -1
    for n, turn in enumerate(turns):
        output_ids = turn["output_ids"]
        for name in () if ids_checked else ("prompt_ids", "output_ids"):
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


# -- the quick way -----------------------------------------------------------------------------

#: orjson reads an integer beyond 64 bits as a float: a float this large may have been one.
_HUGE = float(2**63)
#: The token lists of a turn, checked a list at a time (``_packs``); its other fields are walked.
_TOKEN_LISTS = frozenset(("prompt_ids", "output_ids", "output_logprobs"))
#: The bytes of 0 and 1 as C unsigned ints and of 0.0 and 1.0 as doubles: the values a boolean packs
#: to (``array`` takes ``true`` as 1), looked for before a walk of the list.
_BOOLEAN_IDS = (array("I", [0]).tobytes(), array("I", [1]).tobytes())
_BOOLEAN_FLOATS = (array("d", [0.0]).tobytes(), array("d", [1.0]).tobytes())
_FINISH_REASONS = frozenset(get_args(FinishReason))
_LOGPROB_KINDS = frozenset(LOGPROB_KINDS)


def read_trajectory(body: bytes) -> dict[str, Any]:
    """One trajectory from a request body: parsed once, checked, as the client wrote it."""
    item = _quick(body)
    if item is not None and is_trajectory(item):
        return item  # type: ignore[no-any-return]
    trajectory = parse_json(TRAJECTORY, body)
    refuse_non_finite(body, trajectory)
    return trajectory  # type: ignore[return-value]


def read_trajectories(body: bytes, batch: bool) -> list[dict[str, Any]]:
    """The trajectories of a batch body: ``{"trajectories": [...]}`` (``batch``) or a list."""
    parsed = _quick(body)
    items = parsed.get("trajectories") if batch and isinstance(parsed, dict) else parsed
    if (
        isinstance(items, list)
        and (not batch or len(parsed) == 1)
        and all(is_trajectory(item) for item in items)
    ):
        return items
    if batch:
        wrapped: Any = parse_json(TRAJECTORY_BATCH, body)
        refuse_non_finite(body, wrapped)  # the whole body: a field is named from its root
        return wrapped["trajectories"]  # type: ignore[no-any-return]
    checked: Any = parse_json(TRAJECTORIES, body)
    refuse_non_finite(body, checked)
    return checked  # type: ignore[no-any-return]


def refuse_non_finite(body: bytes, parsed: Any) -> None:
    """Refuse ``Infinity`` and ``NaN`` anywhere in what pydantic parsed (it takes them; the
    store would keep them as null), naming the field. Looked for only when the bytes hold one:
    a scan of the body costs far less than a walk of what it parsed to, and a scan for one
    byte (``memchr``) less again than one for a word, so the words are looked for only after
    their first letters. (orjson, the quick way, refuses them.)"""
    if (b"I" in body and b"Infinity" in body) or (b"N" in body and b"NaN" in body):
        path = storable.non_finite_at(parsed)
        if path is not None:
            raise InvalidInput.one(storable.field_name(path), "must be a finite number")


def _quick(body: bytes) -> Any:
    """The body parsed by orjson, or None where it is no JSON orjson reads (``NaN``, a lone
    surrogate, nothing): the schema's parser then says what is wrong."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def is_trajectory(item: Any) -> bool:
    """Whether ``item`` (orjson's parse) is a trajectory the schema (``CheckedTrajectory``) accepts.

    True only where the schema would take it; False where it would refuse it, or might: so also where a
    number is beyond 64 bits (orjson reads an integer that large as a float, pydantic keeps it to refuse)."""
    if type(item) is not dict:
        return False
    if not all(_fits(value) for key, value in item.items() if key != "turns"):
        return False
    get = item.get
    if not (_is_id(get("instance_id")) and _optional_name(item, "uid") and _optional_name(item, "task_type")):
        return False
    reward = get("reward")
    if type(reward) is dict:
        if not all(type(value) in (int, float) for value in reward.values()):
            return False
    elif type(reward) not in (int, float):
        return False
    if "extra_info" in item and type(item["extra_info"]) is not dict:
        return False
    tools = get("tools")
    if tools is not None and not (type(tools) is list and all(_typed(tool, 1) for tool in tools)):
        return False
    messages = get("messages")
    if not (type(messages) is list and messages and all(map(_is_message, messages))):
        return False
    turns = get("turns")
    if turns is None:
        return True
    return (
        type(turns) is list
        and all(map(_is_turn, turns))
        and not turn_errors(messages, turns, ids_checked=True)
    )


def _fits(value: Any) -> bool:
    """No integer beyond 64 bits in ``value``, nor a float that may have been one."""
    kind = type(value)
    if kind is str:
        return True
    if kind is dict:
        return all(map(_fits, value.values()))
    if kind is list:
        return all(map(_fits, value))
    if kind is int:
        return bool(INT64_MIN <= value <= INT64_MAX)
    return kind is not float or bool(-_HUGE < value < _HUGE)


def _is_id(value: Any) -> bool:
    if type(value) is str:
        return bool(value)
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def _optional_name(item: dict[str, Any], key: str) -> bool:
    value = item.get(key)
    return value is None or (type(value) is str and bool(value))


def _typed(value: Any, min_length: int) -> bool:
    """A dict with a string ``type`` of at least ``min_length`` characters (a tool, a content part)."""
    return type(value) is dict and type(kind := value.get("type")) is str and len(kind) >= min_length


def _is_message(message: Any) -> bool:
    if type(message) is not dict:
        return False
    get = message.get
    role, content, tool_calls = get("role"), get("content"), get("tool_calls")
    if type(role) is not str or not role:
        return False
    if content is None:
        if not (role == "assistant" and tool_calls):
            return False
    elif type(content) is list:
        if not all(_typed(part, 0) for part in content):
            return False
    elif type(content) is not str:
        return False
    if tool_calls is not None and not (type(tool_calls) is list and all(type(c) is dict for c in tool_calls)):
        return False
    reasoning = get("reasoning_content")
    if reasoning is not None and type(reasoning) is not str:
        return False
    return "generated" not in message or type(message["generated"]) is bool


def _is_turn(turn: Any) -> bool:
    if type(turn) is not dict:
        return False
    get = turn.get
    if not (_are_ids(get("prompt_ids")) and _are_ids(get("output_ids"))):
        return False
    logprobs = get("output_logprobs")
    if logprobs is not None and not _packs(logprobs, "d", _BOOLEAN_FLOATS):
        return False
    return turn_fields_ok(turn)


def turn_fields_ok(turn: dict[str, Any]) -> bool:
    """Whether a turn's fields but its token lists (``_TOKEN_LISTS``) are as the schema takes them."""
    if not all(_fits(v) for k, v in turn.items() if k not in _TOKEN_LISTS):
        return False
    get = turn.get
    if "prompt_offset" in turn and not _is_count(turn["prompt_offset"]):
        return False
    kind, version, sampling = get("logprobs"), get("weight_version"), get("sampling")
    return (
        get("finish_reason") in _FINISH_REASONS
        and type(get("finish_reason")) is str
        and _is_count(get("message_index"))
        and (kind is None or (type(kind) is str and kind in _LOGPROB_KINDS))
        and (version is None or type(version) is str or _is_id(version))
        and (sampling is None or type(sampling) is dict)
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= INT64_MAX


def _are_ids(values: Any) -> bool:
    """Whether ``values`` is a list of token ids, each in [0, 2**31), none a boolean."""
    packed = _packed(values, "I", _BOOLEAN_IDS) if _BOOLEAN_IDS[0] == bytes(4) else None  # 4-byte ints
    return packed is not None and not packed[_HIGH_BYTE::4].translate(None, _BELOW_128)


def _packs(values: Any, code: str, booleans: tuple[bytes, bytes]) -> bool:
    return _packed(values, code, booleans) is not None


def _packed(values: Any, code: str, booleans: tuple[bytes, bytes]) -> bytes | None:
    """``values`` packed as ``code`` (``I``: integers in [0, 2**32), ``d``: numbers) if it is a list of
    such, none a boolean: packed in C at once; walked only where a 0 or 1 (what a boolean packs to) is."""
    if type(values) is not list:
        return None
    try:
        packed = array(code, values).tobytes()
    except (TypeError, OverflowError):
        return None
    if _holds(packed, booleans[0]) or _holds(packed, booleans[1]):
        return packed if all(map(_is_int if code == "I" else _is_number, values)) else None
    return packed


def _holds(packed: bytes, value: bytes) -> bool:
    """Whether one of the values ``packed`` holds is ``value`` (found where a value starts, not
    across two)."""
    at = packed.find(value)
    while at >= 0:
        if at % len(value) == 0:
            return True
        at = packed.find(value, at + 1)
    return False


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


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
    rollout_batch_size: Int64 | None = Field(
        None,
        ge=1,
        description="the groups the trainer reads a step (slime's --rollout-batch-size): with max_staleness, "
        "what admission sizes generation by (absent: the trainer's largest read)",
    )
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
    replay_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="the share of the groups returned that may be served again from the replay pool "
        "(--replay-capacity), marked extra_info.replay; 0: fresh groups only",
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
