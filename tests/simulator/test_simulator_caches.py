"""What the simulator keeps of a prompt: a group's samples send the same one, read once, and
a prompt that differs in anything the reply depends on is read again."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import buffer.simulator.prompts as prompts_module
from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.front import SimApp
from buffer.simulator.replies import plan_reply

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]
CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


async def post(app: SimApp, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_a_group_s_prompt_is_read_once_on_each_route(monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[object] = []

    def counted(*args: Any) -> Any:
        plans.append(args)
        return plan_reply(*args)

    monkeypatch.setattr(prompts_module, "plan_reply", counted)
    app = create_sim_app(SimConfig(latency_mean_s=0.0, seed=0))
    body = {"messages": QUESTION, "return_prompt_token_ids": True, "return_token_ids": True}
    answers = [await post(app, "/v1/chat/completions", body) for _ in range(8)]
    assert len(plans) == 1
    prompt_ids = answers[0]["choices"][0]["prompt_token_ids"]
    for _ in range(8):
        await post(app, "/generate", {"input_ids": prompt_ids})
        await post(app, "/v1/completions", {"prompt": prompt_ids})
    assert len(plans) == 2
    # Each sample is still drawn on its own: the answers are not one answer repeated.
    assert len({answer["choices"][0]["message"]["content"] for answer in answers}) > 1


@pytest.mark.parametrize("order", [("none", "auto"), ("auto", "none")])
async def test_the_same_messages_with_another_tool_choice_are_planned_again(order: tuple[str, str]) -> None:
    app = create_sim_app(SimConfig(latency_mean_s=0.0, seed=0, accuracy=1.0))
    calls = {}
    for tool_choice in order:
        body = {"messages": QUESTION, "tools": [CALCULATOR], "tool_choice": tool_choice}
        calls[tool_choice] = (await post(app, "/v1/chat/completions", body))["choices"][0]["message"][
            "tool_calls"
        ]
    assert calls["none"] is None
    assert calls["auto"][0]["function"]["name"] == "calculator"


@pytest.mark.parametrize("order", [(True, False), (False, True)])
async def test_the_same_messages_with_thinking_switched_off_are_rendered_again(
    order: tuple[bool, bool],
) -> None:
    app = create_sim_app(SimConfig(latency_mean_s=0.0, seed=0, chat_template="thinking"))
    reasoning = {}
    for thinking in order:
        body = {
            "messages": QUESTION,
            "chat_template_kwargs": {"enable_thinking": thinking},
            "return_prompt_token_ids": True,
        }
        reasoning[thinking] = (await post(app, "/v1/chat/completions", body))["choices"][0]
    assert reasoning[True]["message"]["reasoning_content"]
    assert reasoning[False]["message"]["reasoning_content"] is None
    assert reasoning[True]["prompt_token_ids"] != reasoning[False]["prompt_token_ids"]
