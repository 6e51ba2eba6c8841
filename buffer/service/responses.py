"""JSON responses, encoded with orjson, in slime's envelope ``{success, message, data}``.

Ready groups are stored already encoded, so a read's response is spliced from their bytes
instead of decoding and re-encoding every trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.responses import Response


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code, headers, media_type="application/json")


def envelope(
    success: bool,
    message: str,
    data: Any = None,
    status_code: int = 200,
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Response:
    return json_response(
        {"success": success, "message": message, "data": data, **extra}, status_code, headers
    )


def items_response(
    success: bool, message: str, items: Sequence[bytes], meta_info: dict[str, Any]
) -> Response:
    """``{"success", "message", "data": {"data": [items], "meta_info"}}`` from encoded items,
    joined in one copy: a read of a thousand groups is some 16 MB."""
    parts = [b'{"success":', b"true" if success else b"false", b',"message":', orjson.dumps(message)]
    parts.append(b',"data":{"data":[')
    for index, item in enumerate(items):
        if index:
            parts.append(b",")
        parts.append(item)
    parts += [b'],"meta_info":', orjson.dumps(meta_info), b"}}"]
    return Response(b"".join(parts), media_type="application/json")
