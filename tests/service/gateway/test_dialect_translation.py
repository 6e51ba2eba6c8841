"""The dialect translators as pure functions: Anthropic Messages and OpenAI Responses requests
into the chat body the gateway records, chat answers back, and their server-sent events."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from buffer.errors import InvalidInput
from buffer.service.gateway import anthropic, responses
from buffer.service.gateway.translation import MAX_MESSAGES, tool_arguments

ARGUMENTS = '{"expression":"3 * (4 + 5)"}'  # as the engine wrote it: no spaces


def chat_answer(message: dict[str, Any], finish_reason: str = "stop", **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "policy",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, **choice}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7},
    }


def events(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    for frame in stream.split(b"\n\n"):
        if frame:
            name, data = frame.split(b"\n")
            parsed.append(
                (name.removeprefix(b"event: ").decode(), orjson.loads(data.removeprefix(b"data: ")))
            )
    return parsed


def field_of(error: pytest.ExceptionInfo[InvalidInput]) -> str:
    field: str = error.value.errors[0]["field"]
    return field


# -- Anthropic ---------------------------------------------------------------------------------


def test_an_anthropic_conversation_becomes_the_engine_s_messages() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    body = {
        "model": "policy",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Compute 3 * (4 + 5)."}, image]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": anthropic.SIGNATURE},
                    {
                        "type": "tool_use",
                        "id": "call_0",
                        "name": "calculator",
                        "input": {"expression": "3 * (4 + 5)"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_0", "content": "27"},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        "tools": [{"name": "calculator", "description": "math", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 20,
        "metadata": {"user_id": "u1"},
        "thinking": {"type": "enabled", "budget_tokens": 50},
        "anything_else": "ignored",
    }
    assert anthropic.tool_use_ids(body) == {"call_0"}
    chat = anthropic.to_chat(body, {"call_0": ARGUMENTS})
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compute 3 * (4 + 5)."},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "27"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "calculator", "description": "math", "parameters": {"type": "object"}},
        }
    ]
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"]
    assert chat["max_tokens"] == 100
    assert chat["temperature"] == 0.5
    assert chat["top_k"] == 20
    assert chat["user"] == "u1"
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert "anything_else" not in chat


def test_a_tool_input_the_agent_changed_is_sent_as_it_changed_it() -> None:
    use = {"type": "tool_use", "id": "call_0", "name": "calculator", "input": {"expression": "1 + 1"}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [use]}]}
    (message,) = anthropic.to_chat(body, {"call_0": ARGUMENTS})["messages"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"expression": "1 + 1"}'


def test_the_recorded_arguments_are_the_latest_reply_s() -> None:
    def reply(arguments: str) -> dict[str, Any]:
        return {"tool_calls": [{"id": "call_0", "function": {"name": "f", "arguments": arguments}}]}

    assert tool_arguments([reply("new"), reply("old")], {"call_0", "call_9"}) == {"call_0": "new"}
    assert tool_arguments([reply("new")], set()) == {}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"temperature": "hot"}, "temperature"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ],
)
def test_an_anthropic_request_that_cannot_be_translated_names_its_field(
    change: dict[str, Any], field: str
) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(InvalidInput) as refused:
        anthropic.to_chat(body)
    assert field_of(refused) == field


@pytest.mark.parametrize(
    ("finish_reason", "choice", "expected"),
    [
        ("stop", {}, ("end_turn", None)),
        ("length", {}, ("max_tokens", None)),
        ("stop", {"stop_reason": "END"}, ("stop_sequence", "END")),  # vLLM
        ("stop", {"matched_stop": "END"}, ("stop_sequence", "END")),  # SGLang
        ("stop", {"stop_reason": 151645}, ("end_turn", None)),  # a stop token, not a sequence
    ],
)
def test_the_stop_reason_says_why_the_engine_stopped(
    finish_reason: str, choice: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    answer = chat_answer({"role": "assistant", "content": "x"}, finish_reason, **choice)
    message = anthropic.from_chat(answer, {"stop_sequences": ["END"]})
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_an_answer_with_reasoning_and_a_tool_call_is_an_anthropic_message_and_its_stream() -> None:
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": ARGUMENTS}}
    answer = chat_answer(
        {"role": "assistant", "reasoning_content": "Use it.", "content": "Let me see.", "tool_calls": [call]},
        "tool_calls",
    )
    message = anthropic.from_chat(answer, {"model": "policy"})
    assert message["content"] == [
        {"type": "thinking", "thinking": "Use it.", "signature": anthropic.SIGNATURE},
        {"type": "text", "text": "Let me see."},
        {"type": "tool_use", "id": "call_0", "name": "calculator", "input": {"expression": "3 * (4 + 5)"}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 11, "output_tokens": 7}
    stream = events(b"".join(anthropic.stream_events(message)))
    assert [name for name, _ in stream] == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in stream)
    deltas = [data["delta"] for name, data in stream if name == "content_block_delta"]
    assert [delta["type"] for delta in deltas] == [
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "input_json_delta",
    ]
    assert orjson.loads(deltas[-1]["partial_json"]) == {"expression": "3 * (4 + 5)"}
    assert stream[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_arguments_that_are_not_json_reach_the_agent_as_an_empty_input() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    message = anthropic.from_chat(chat_answer({"role": "assistant", "tool_calls": [call]}), {})
    assert message["content"][0]["input"] == {}
    _, delta = events(b"".join(anthropic.stream_events(message)))[2]
    assert delta["delta"]["partial_json"] == "{}"
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": message["content"]}]}
    (sent,) = anthropic.to_chat(body, {"c": "not json"})["messages"]
    assert sent["tool_calls"][0]["function"]["arguments"] == "not json"  # as sampled


def test_an_anthropic_error_has_anthropic_s_shape() -> None:
    assert anthropic.error_body(401, "wrong key") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "wrong key"},
    }
    assert anthropic.error_body(503, "paused")["error"]["type"] == "overloaded_error"
    assert anthropic.error_body(502, "engine")["error"]["type"] == "api_error"


# -- OpenAI Responses --------------------------------------------------------------------------


def test_responses_items_become_the_engine_s_messages() -> None:
    body = {
        "model": "policy",
        "instructions": "Use the calculator.",
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Compute."}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Hm."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "call_0", "name": "calculator", "arguments": ARGUMENTS},
            {"type": "function_call_output", "call_id": "call_0", "output": "27"},
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}],
            },
        ],
        "tools": [
            {"type": "function", "name": "calculator", "parameters": {"type": "object"}, "strict": True}
        ],
        "tool_choice": {"type": "function", "name": "calculator"},
        "max_output_tokens": 64,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
    }
    chat, conversation = responses.to_chat(body)
    assert chat["messages"][0] == {"role": "system", "content": "Use the calculator."}
    assert conversation == chat["messages"][1:]
    assert conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compute."}]},
        {
            "role": "assistant",
            "content": "Let me see.",
            "reasoning_content": "Hm.",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "27"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}],
        },
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "calculator", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    assert chat["max_tokens"] == 64
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }


def test_a_previous_response_comes_first_without_its_instructions() -> None:
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "function": {"arguments": ARGUMENTS}}],
    }
    previous = responses.Stored("s1", [{"role": "user", "content": "Compute."}], reply)
    body = {
        "model": "policy",
        "instructions": "Now this.",
        "input": [{"type": "function_call_output", "call_id": "call_0", "output": "27"}],
    }
    chat, conversation = responses.to_chat(body, previous)
    assert chat["messages"] == [
        {"role": "system", "content": "Now this."},
        {"role": "user", "content": "Compute."},
        reply,  # the engine's own message: its arguments text as sampled
        {"role": "tool", "tool_call_id": "call_0", "content": "27"},
    ]
    assert conversation == chat["messages"][1:]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.image_url",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
    ],
)
def test_a_responses_request_that_cannot_be_translated_names_its_field(
    change: dict[str, Any], field: str
) -> None:
    body = {"model": "m", "input": "hi", **change}
    with pytest.raises(InvalidInput) as refused:
        responses.to_chat(body)
    assert field_of(refused) == field


def test_an_answer_is_a_response_and_its_stream() -> None:
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": ARGUMENTS}}
    answer = chat_answer(
        {"role": "assistant", "reasoning": "Hm.", "content": "Sure.", "tool_calls": [call]}, "tool_calls"
    )
    response = responses.from_chat(answer, {"model": "policy", "input": "x"}, "resp_abc", 1.0)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert response["output"][1]["content"][0]["text"] == "Sure."
    assert response["output"][2]["call_id"] == "call_0"
    assert response["output"][2]["arguments"] == ARGUMENTS
    assert response["status"] == "completed"
    assert response["incomplete_details"] is None
    assert response["usage"]["total_tokens"] == 18
    stream = events(b"".join(responses.stream_events(response)))
    assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
    names = [name for name, _ in stream]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    assert stream[-1][1]["response"] == response
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 3
    for name in (
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
    ):
        assert name in names
    assert stream[0][1]["response"]["output"] == []
    assert stream[0][1]["response"]["status"] == "in_progress"


def test_an_answer_cut_at_its_limit_is_incomplete() -> None:
    response = responses.from_chat(
        chat_answer({"role": "assistant", "content": "x"}, "length"), {}, "resp_1", 0.0
    )
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events(b"".join(responses.stream_events(response)))[-1][0] == "response.incomplete"


def test_the_response_store_is_bounded_and_per_session() -> None:
    store = responses.ResponseStore(limit=2)
    stored = responses.Stored("s1", [], {"role": "assistant", "content": "x"})
    store.put("resp_1", stored)
    store.put("resp_2", stored)
    assert store.get("s2", "resp_1") is None  # another session's
    assert store.get("s1", "resp_1") is stored  # now the most recently used
    store.put("resp_3", stored)
    assert len(store) == 2
    assert store.get("s1", "resp_2") is None  # the least recently used, dropped
    assert store.get("s1", "resp_1") is stored
