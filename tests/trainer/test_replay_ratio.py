"""The trainer side of the replay pool: the clients send ``replay_ratio`` and say how many groups
were replayed; slime's adapter takes ``--rollout-buffer-replay-ratio`` and sends it with each read."""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import respx

from buffer.trainer.client import AsyncRolloutBufferClient, RolloutBufferClient
from tests.support.paths import SLIME_STUB

sys.path.insert(0, str(SLIME_STUB))

from buffer.trainer import slime_rollout

URL = "http://buffer.test"
ITEMS = [{"instance_id": "a", "reward": 1.0, "messages": []}] * 2
ANSWER = {"success": True, "message": "ok", "data": {"data": ITEMS, "meta_info": {"replayed": 1}}}


@respx.mock
def test_the_sync_client_sends_the_ratio_and_reads_the_count() -> None:
    route = respx.post(f"{URL}/get_rollout_data").mock(return_value=httpx.Response(200, json=ANSWER))
    with RolloutBufferClient(URL) as client:
        batch = client.get_rollout_data(4, replay_ratio=0.25)
        client.get_rollout_data(4)
    assert json.loads(route.calls[0].request.content) == {"batch_size": 4, "replay_ratio": 0.25}
    assert json.loads(route.calls[1].request.content) == {"batch_size": 4}  # as before
    assert batch.replayed == 1


@pytest.mark.anyio
@respx.mock
async def test_the_async_client_sends_the_ratio() -> None:
    route = respx.post(f"{URL}/get_rollout_data").mock(return_value=httpx.Response(200, json=ANSWER))
    async with AsyncRolloutBufferClient(URL) as client:
        batch = await client.get_rollout_data(4, replay_ratio=0.5)
    assert json.loads(route.calls[0].request.content) == {"batch_size": 4, "replay_ratio": 0.5}
    assert batch.replayed == 1


def test_the_adapter_takes_the_flag_and_refuses_a_ratio_out_of_range() -> None:
    parser = slime_rollout.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).rollout_buffer_replay_ratio == 0.0
    assert parser.parse_args(["--rollout-buffer-replay-ratio", "0.25"]).rollout_buffer_replay_ratio == 0.25
    for bad in ("1", "-0.5", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--rollout-buffer-replay-ratio", bad])


class Stop(Exception):
    pass


def test_each_read_of_a_step_asks_for_the_ratio() -> None:
    asked: list[dict[str, Any]] = []

    def get_rollout_data(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        raise Stop

    session = SimpleNamespace(
        client=SimpleNamespace(get_rollout_data=get_rollout_data), converter=lambda kwargs: None
    )
    args = SimpleNamespace(
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        rollout_task_type="math",
        rollout_buffer_replay_ratio=0.25,
    )
    data_source = SimpleNamespace(get_buffer_length=lambda: 0)
    with pytest.raises(Stop):
        slime_rollout._fetch(args, 0, data_source, session, None)  # type: ignore[arg-type]
    assert asked[0]["replay_ratio"] == 0.25
