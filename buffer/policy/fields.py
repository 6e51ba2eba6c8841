"""Which fields a ``/start_rollout`` payload may carry beyond the request model's own.

The payload is passed whole to the generator, so the buffer cannot know every field a
generator reads. It accepts the toolkit's (``RolloutSettings``: what ``run_rollouts`` reads,
``tokenizer_path`` among them, as slime sends it) and the ones a generator lists in
``START_ROLLOUT_FIELDS``. A generator that lists nothing is taken to read fields of its own,
as generators written before the list did; one that lists them (the project's generators do,
with an empty tuple when they read no others) gets a 422 naming any other field.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from buffer.errors import InvalidInput

#: The module attribute a generator lists the extra ``/start_rollout`` fields it reads in.
FIELDS_ATTRIBUTE = "START_ROLLOUT_FIELDS"


def check_start_fields(extra: Iterable[str], module: ModuleType, toolkit_fields: Iterable[str]) -> None:
    """Raise ``InvalidInput`` naming each field of ``extra`` neither the toolkit nor the
    generator (if it declares its fields) reads."""
    declared = getattr(module, FIELDS_ATTRIBUTE, None)
    if declared is None:
        return
    known = set(toolkit_fields) | set(declared)
    unknown = sorted(name for name in extra if name not in known)
    if unknown:
        raise InvalidInput(
            (name, f"is not a field of /start_rollout nor one generator {module.__name__!r} reads")
            for name in unknown
        )
