"""slime's processor helpers (slime/utils/processing_utils.py): the two a rollout function meets.

``load_processor`` gives None here, as slime's does for a text-only checkpoint (its
``AutoProcessor`` answers with a tokenizer, which it discards); a test that needs a processor
replaces it. ``build_processor_kwargs`` is restated: the modality outputs as tensors, the text's
ids as lists, no ``mm_token_type_ids``.
"""

from __future__ import annotations

from typing import Any


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    return None


def build_processor_kwargs(multimodal_inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    modality_forced = {"return_tensors": "pt"}
    result = dict(multimodal_inputs) if multimodal_inputs else {}
    result["text_kwargs"] = {
        **result.get("text_kwargs", {}),
        "return_tensors": None,
        "return_mm_token_type_ids": False,
    }
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        result[key] = {**result[key], **modality_forced} if key in result else dict(modality_forced)
    return result
