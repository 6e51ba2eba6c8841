"""A trajectory's images, as the trainer takes them (slime's ``Sample.multimodal_inputs``).

The images are the ``image_url`` content parts of the messages, in order: a URL, a ``data:``
URL (base64), or the rollout buffer's own ``/images/<sha256>`` URL where the gateway kept a
large image by reference. They are returned as those strings, ``{"images": [...]}``; loading
them (PIL, a processor) is the trainer's, which has the libraries. The image tokens are in the
prompts the engine received (``turns``), so the loss mask is 0 on them, as on any prompt token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def image_urls(messages: object) -> list[str]:
    """Every image of the messages, in order."""
    urls: list[str] = []
    if not isinstance(messages, list):
        return urls
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            if isinstance(url, str):
                urls.append(url)
    return urls


def multimodal_inputs(trajectory: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"images": [...]}``, or None for a text-only trajectory."""
    images = image_urls(trajectory.get("messages"))
    return {"images": images} if images else None
