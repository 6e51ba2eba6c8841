"""Image content parts kept on the trajectory: inline when small, by reference when large.

The engine always gets the agent's message as sent. What the trajectory keeps is a copy in
which a ``data:`` image larger than ``inline_limit_bytes`` is stored once, by content hash,
under the data folder (``images/<sha256>``) and replaced by the URL that serves it
(``/images/<sha256>``); an image URL stays the URL. An image larger than ``max_image_bytes``
is refused (413) before anything is sent. Without a data folder images stay inline. A disk too
full to keep an image answers 507 (``ImageStorageFull``), before anything is sent, and leaves
no partial file behind.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffer.errors import RolloutBufferError


class ImageTooLarge(RolloutBufferError):
    status_code = 413


class ImageStorageFull(RolloutBufferError):
    """The disk under the data folder is full (or over quota): the image cannot be kept."""

    status_code = 507


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    directory: Path | None
    url_prefix: str  # "<service>/images/"
    inline_limit_bytes: int = 64 * 1024
    max_image_bytes: int = 16 * 1024 * 1024

    def keep(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[Path, bytes]]:
        """The messages as the trajectory keeps them, and the image files to write first."""
        files: dict[Path, bytes] = {}
        kept = [self._message(message, files) for message in messages]
        return kept, files

    def _message(self, message: dict[str, Any], files: dict[Path, bytes]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        parts = [self._part(part, files) if isinstance(part, dict) else part for part in content]
        changed = any(a is not b for a, b in zip(parts, content, strict=True))
        return {**message, "content": parts} if changed else message

    def _part(self, part: dict[str, Any], files: dict[Path, bytes]) -> dict[str, Any]:
        if part.get("type") != "image_url":
            return part
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url.startswith("data:"):
            return part
        _, _, encoded = url.partition(",")
        size = len(encoded) * 3 // 4
        if size > self.max_image_bytes:
            raise ImageTooLarge(
                f"an image of {size} bytes is larger than the gateway keeps ({self.max_image_bytes})"
            )
        if size <= self.inline_limit_bytes or self.directory is None:
            return part
        try:
            data = base64.b64decode(encoded, validate=False)
        except (binascii.Error, ValueError):
            return part  # not base64: the engine says so; kept as sent
        digest = hashlib.sha256(data).hexdigest()
        files[self.directory / digest] = data
        reference = {**(image if isinstance(image, dict) else {}), "url": self.url_prefix + digest}
        return {**part, "image_url": reference}


#: What a full disk (or a user's quota) raises.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def write_files(files: dict[Path, bytes]) -> None:
    """Write each image once (content-addressed: an existing file is the same image), through
    a partial file of its own (two calls with the same image do not share one), removed when
    the write fails. Blocking."""
    for path, data in files.items():
        if path.exists():
            continue
        partial = path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(data)
            partial.replace(path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            if exc.errno in _NO_SPACE:
                raise ImageStorageFull(
                    f"no space left under {path.parent} to keep an image of {len(data)} bytes: "
                    "the disk of the service's data folder is full"
                ) from exc
            raise


_MAGIC = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
)


def media_type(data: bytes) -> str:
    """The image type of a stored image, from its first bytes."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    return "application/octet-stream"
