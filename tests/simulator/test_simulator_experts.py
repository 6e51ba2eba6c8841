"""``--routed-experts LAYERS,TOPK``: SGLang's routed experts on ``/generate`` (issue 24, item 7)."""

from __future__ import annotations

import base64
from array import array

import httpx
import pytest
from pydantic import ValidationError

from buffer.simulator import create_sim_app
from buffer.simulator.cli import parse_config
from buffer.simulator.experts import expert

pytestmark = pytest.mark.anyio


async def generate(flags: list[str], body: dict[str, object]) -> dict[str, object]:
    app = create_sim_app(parse_config([*flags, "--latency-mean-s", "0", "--abort-rate", "0"]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        answer = await client.post("/generate", json=body)
    assert answer.status_code == 200
    meta: dict[str, object] = answer.json()["meta_info"]
    return {**meta, "output_ids": answer.json()["output_ids"]}


async def test_experts_are_answered_per_token_when_asked_and_served() -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True}
    meta = await generate(["--routed-experts", "3,2"], body)
    ids = [5, 6, 7, *meta["output_ids"]]  # type: ignore[misc]
    assert meta["routed_experts_start_len"] == 0
    values = array("i", base64.b64decode(str(meta["routed_experts"]))).tolist()
    assert values == [expert(t, layer, k) for t in ids[:-1] for layer in range(3) for k in range(2)]
    assert "routed_experts" not in await generate(
        ["--routed-experts", "3,2"], {**body, "return_routed_experts": False}
    )
    assert "routed_experts" not in await generate([], body)  # a server run without the flag


def test_a_malformed_shape_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValidationError, match="routed_experts"):
        parse_config(["--routed-experts", "3x2"])
