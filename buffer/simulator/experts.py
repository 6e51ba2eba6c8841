"""SGLang's routed experts (``--enable-return-routed-experts``), made up deterministically.

For a request with ``return_routed_experts``, SGLang answers ``meta_info.routed_experts``: the
experts each of the sequence's tokens but the last was routed to, in every MoE layer, as base64
of int32 in shape ``(tokens - 1 - routed_experts_start_len, layers, topk)``, with
``routed_experts_start_len`` (0 here: every row, from the prompt's first token). Here the experts
of a token depend on that token id alone (and the layer), so a test can compute them.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Sequence
from typing import Any

#: Experts per layer of the simulated model.
NUM_EXPERTS = 64


def expert(token: int, layer: int, k: int) -> int:
    """The ``k``-th expert ``token`` is routed to in ``layer``: never 0 for k=0, distinct over k."""
    return (token * 7 + layer * 13 + k * 17 + 1) % NUM_EXPERTS


def routed_experts(shape: str, ids: Sequence[int]) -> dict[str, Any]:
    """``meta_info``'s fields for a sequence of ``ids`` (prompt and output), ``shape`` "LAYERS,TOPK"."""
    layers, topk = (int(part) for part in shape.split(","))
    values = array(
        "i", (expert(token, layer, k) for token in ids[:-1] for layer in range(layers) for k in range(topk))
    )
    return {
        "routed_experts": base64.b64encode(values.tobytes()).decode("ascii"),
        "routed_experts_start_len": 0,
    }
