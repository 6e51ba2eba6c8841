"""The plan a job's data defines: what two jobs must share for one to continue the other
(``JobManager.start``: a job that did not finish is continued by the next start of the same
generator with the same plan)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class _PlanFields(BaseModel):
    """The /start_rollout fields that define a toolkit job's plan (``buffer.toolkit.dataset.Plan``),
    with the toolkit's defaults: what two jobs must share for one to continue the other."""

    model_config = ConfigDict(extra="ignore")

    input_file: str | None = None
    num_repeat_per_sample: int = 1
    num_epoch: int = 1
    seed: int = 0
    shuffle: bool = True
    input_key: str = "prompt"
    label_key: str = "label"
    skip_instance_ids: list[str | int] = []


def plan_of(data: dict[str, Any]) -> str | None:
    """A fingerprint of the plan ``data`` defines (``_PlanFields``, the numbers slime sends as
    strings read as numbers, the skips in any order); None when they cannot be read."""
    try:
        fields = _PlanFields.model_validate(data).model_dump()
    except ValidationError:
        return None
    fields["skip_instance_ids"] = sorted(str(instance_id) for instance_id in fields["skip_instance_ids"])
    canonical = json.dumps(fields, sort_keys=True).encode()
    return hashlib.blake2b(canonical, digest_size=12).hexdigest()
