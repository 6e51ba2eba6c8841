"""The fields a ``/start_rollout`` payload may carry, typed, for the generator it starts.

A payload is the request model's fields (``StartRolloutRequest``: slime's, the task's grouping,
the service's controls), the toolkit's (``RolloutSettings``, ``tokenizer_path`` among them, as
slime sends it), the job's (``JOB_FIELDS``: workers, leases), and the generator's own, as it
declares them in ``START_ROLLOUT_FIELDS`` (``buffer.core.registry``: names, a pydantic model,
or ``"*"``). Anything else is refused with a 422 naming the field, the closest known name
("did you mean num_repeat_per_sample?") and the generator's file: a typo must not run a job
with a default in its place. The toolkit's fields and a generator's model are typed: a value
that breaks them is refused before the job starts, rather than failing it after.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from buffer.core.registry import ANY_FIELDS, FIELDS_ATTRIBUTE, DeclaredFields, Generator
from buffer.errors import InvalidInput
from buffer.service.jobs import JOB_FIELDS
from buffer.service.models import StartRolloutRequest, invalid_input

#: What the service itself puts in a job's data (a client's value is replaced).
SERVICE_SET_FIELDS = frozenset({"generator_task_type", "leases", "worker"})


def check_start_fields(body: StartRolloutRequest, generator: Generator) -> None:
    """Raise ``InvalidInput`` naming each field of ``body`` that ``generator`` does not take,
    and each value that breaks the toolkit's or the generator's types."""
    fields = generator.fields
    problems: list[tuple[str, str]] = []
    try:
        _extras_model(fields).model_validate(body.model_extra or {})
    except ValidationError as exc:
        unknown = [error for error in exc.errors() if error["type"] == "extra_forbidden"]
        problems += [_unknown(str(error["loc"][0]), generator) for error in unknown]
        wrong = [error for error in exc.errors() if error["type"] != "extra_forbidden"]
        problems += [(error["field"], error["reason"]) for error in invalid_input(wrong).errors if wrong]
    if fields.model is not None:
        sent = body.model_dump(exclude_unset=True)
        try:
            fields.model.model_validate({name: sent[name] for name in fields.names if name in sent})
        except ValidationError as exc:
            problems += [(error["field"], error["reason"]) for error in invalid_input(exc.errors()).errors]
    if problems:
        raise InvalidInput(problems)


def known_fields(fields: DeclaredFields) -> frozenset[str]:
    """Every field a payload for a generator declaring ``fields`` may carry (but any, with ``"*"``)."""
    return frozenset(StartRolloutRequest.model_fields) | frozenset(_extras_model(fields).model_fields)


def _unknown(name: str, generator: Generator) -> tuple[str, str]:
    candidates = sorted(known_fields(generator.fields) - SERVICE_SET_FIELDS)
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        name,
        f"unknown field: {hint}{generator.file_name} takes slime's and the toolkit's fields and those "
        f"its {FIELDS_ATTRIBUTE} lists ({ANY_FIELDS!r}: any field)",
    )


@functools.lru_cache(maxsize=256)
def _extras_model(fields: DeclaredFields) -> type[BaseModel]:
    """The fields beyond the request model's: the toolkit's typed, the others any value."""
    definitions: dict[str, Any] = dict(_toolkit_fields())
    for name in JOB_FIELDS | SERVICE_SET_FIELDS | fields.names:
        definitions.setdefault(name, (Any, None))
    for name in StartRolloutRequest.model_fields:
        definitions.pop(name, None)  # typed by the request model
    config = ConfigDict(extra="allow" if fields.any else "forbid")
    model: type[BaseModel] = create_model("StartRolloutExtras", __config__=config, **definitions)
    return model


@functools.cache
def _toolkit_fields() -> dict[str, Any]:
    from buffer.toolkit.runner import RolloutSettings  # the toolkit is loaded with the first job

    return {name: (info.annotation, info) for name, info in RolloutSettings.model_fields.items()}
