"""What the simulated model says: arithmetic, cut replies, tools, seeds, stops and reasoning.

Token ids are checked against the simulator's own tokenizer, built here as a client would build it
(``build_tokenizer()``, or saved with ``python -m buffer.simulator.tokenizer DIR`` and loaded)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from buffer.simulator.arithmetic import solve
from tests.simulator.helpers import (
    CALCULATOR,
    EOS_ID,
    THINK_ID,
    THINKER,
    TOKENIZER,
    boxed,
    chat,
    encode,
    openai_for,
    render,
    sim_app,
    stats_of,
    token_generate,
)

pytestmark = pytest.mark.anyio


# The arithmetic


def test_solve_shows_steps_innermost_first() -> None:
    solution = solve("3 * (4 + 5)")
    assert solution is not None
    assert solution.steps == ("4 + 5 = 9", "3 * 9 = 27")


@pytest.mark.parametrize(
    "expression", ["2 ** 10", "__import__('os').system('true')", "1 / 0", "2.5 + 1", "x + 1", "42", "-7"]
)
def test_solve_refuses_what_is_not_integer_arithmetic_with_an_operation(expression: str) -> None:
    assert solve(expression) is None


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is 17 + 25?", "42"),
        ("Compute 3 * (4 + 5).", "27"),
        ("Question 3: what is 100 - 58 * 2?", "-16"),
        ("What is 7 / 2?", "7/2"),
        ("What is 6 × 7?", "42"),
    ],
)
async def test_arithmetic_is_answered_right_with_accuracy_one(question: str, answer: str) -> None:
    reply = await chat(sim_app(accuracy=1.0), question)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert boxed(choice["message"]["content"]) == answer


async def test_arithmetic_is_answered_wrong_by_a_little_with_accuracy_zero() -> None:
    app = sim_app(accuracy=0.0)
    for seed in range(20):
        content = (await chat(app, "What is 17 + 25?", seed=seed))["choices"][0]["message"]["content"]
        answer = boxed(content)
        assert answer is not None
        assert answer != "42"
        assert 1 <= abs(int(answer) - 42) <= 3
        assert f"17 + 25 = {answer}" in content


async def test_the_question_is_read_from_the_last_user_message_and_text_parts() -> None:
    messages = [
        {"role": "system", "content": "You are a calculator. 1 + 1 is not the question."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "Now compute 9 * 9."}]},
    ]
    reply = await chat(sim_app(accuracy=1.0), messages=messages)
    assert boxed(reply["choices"][0]["message"]["content"]) == "81"


async def test_a_prompt_without_arithmetic_gets_a_generic_text() -> None:
    for question in ["What is the capital of France?", "What is 2 ** 100?"]:
        choice = (await chat(sim_app(accuracy=1.0), question))["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"]
        assert boxed(choice["message"]["content"]) is None


async def test_usage_counts_the_tokenizer_s_tokens_of_the_prompt_and_of_the_reply() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?")
    content = reply["choices"][0]["message"]["content"]
    prompt_tokens = len(render([{"role": "user", "content": "What is 17 + 25?"}]))
    completion_tokens = len(encode(content)) + 1  # and the end-of-turn token
    assert reply["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "sim-model"
    assert reply["id"].startswith("chatcmpl-")
    assert isinstance(reply["created"], int)


# Cut replies: max_tokens, aborts, continuation


async def test_max_tokens_truncates_at_a_token_with_finish_reason_length() -> None:
    app = sim_app(accuracy=1.0)
    full = (await chat(app, "Compute 3 * (4 + 5).", seed=1))["choices"][0]["message"]["content"]
    for limit_field in ["max_tokens", "max_completion_tokens"]:
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=1, return_token_ids=True, **{limit_field: 5})
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == encode(full)[:5]
        assert choice["message"]["content"] == TOKENIZER.decode(encode(full)[:5])
        assert reply["usage"]["completion_tokens"] == 5


async def test_a_reply_within_max_tokens_is_not_cut() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?", max_tokens=1000)
    assert reply["choices"][0]["finish_reason"] == "stop"


async def test_abort_rate_one_aborts_with_partial_content_and_usage() -> None:
    full = (await chat(sim_app(accuracy=1.0), "Compute 3 * (4 + 5).", seed=4))["choices"][0]["message"][
        "content"
    ]
    app = sim_app(accuracy=1.0, abort_rate=1.0)
    cuts = set()
    for _ in range(10):
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=4, return_token_ids=True)
        choice = reply["choices"][0]
        partial, ids = choice["message"]["content"], choice["token_ids"]
        assert choice["finish_reason"] == "abort"
        assert partial
        assert ids == encode(full)[: len(ids)]  # a prefix of the reply, no end-of-turn token
        assert partial == TOKENIZER.decode(ids)
        assert len(partial) < len(full)
        assert reply["usage"]["completion_tokens"] == len(ids)
        cuts.add(len(ids))
    assert len(cuts) > 1  # at a random token
    assert (await stats_of(app))["by_finish_reason"] == {"abort": 10}


async def test_continue_final_message_returns_only_the_continuation() -> None:
    app = sim_app(accuracy=1.0)
    question = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    full = (await chat(app, messages=question))["choices"][0]["message"]["content"]
    prefix = TOKENIZER.decode(encode(full)[:6])
    messages = [*question, {"role": "assistant", "content": prefix}]
    reply = await chat(app, messages=messages, continue_final_message=True, return_token_ids=True)
    continuation = reply["choices"][0]["message"]["content"]
    assert prefix + continuation == full
    assert reply["choices"][0]["token_ids"] == [*encode(full)[6:], EOS_ID]
    assert reply["usage"]["completion_tokens"] == len(encode(full)) + 1 - 6

    # Without the flag the final assistant message is history and the reply starts afresh.
    fresh = (await chat(app, messages=messages))["choices"][0]["message"]["content"]
    assert fresh == full


async def test_an_aborted_reply_is_completed_by_continue_final_message_through_extra_body() -> None:
    """The partial-rollout path: abort around a weight update, then continue where it stopped."""
    question: list[Any] = [{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}]
    full = (await chat(sim_app(accuracy=1.0), messages=question))["choices"][0]["message"]["content"]
    aborted = (await chat(sim_app(accuracy=1.0, abort_rate=1.0), messages=question))["choices"][0]
    assert aborted["finish_reason"] == "abort"
    async with openai_for(sim_app(accuracy=1.0)) as client:
        reply = await client.chat.completions.create(
            model="sim-model",
            messages=[*question, {"role": "assistant", "content": aborted["message"]["content"]}],
            extra_body={"continue_final_message": True},
        )
    assert reply.choices[0].finish_reason == "stop"
    assert aborted["message"]["content"] + reply.choices[0].message.content == full


# Tools


async def test_tool_call_round_trip_with_the_openai_client() -> None:
    question: list[Any] = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    async with openai_for(sim_app(accuracy=0.0)) as client:
        first = await client.chat.completions.create(model="sim-model", messages=question, tools=[CALCULATOR])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls is not None
        [call] = choice.message.tool_calls
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name == "calculator"
        expression = json.loads(call.function.arguments)["expression"]
        assert expression == "3 * (4 + 5)"

        result = solve(expression)
        assert result is not None
        messages = [
            *question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": str(result.value)},
        ]
        second = await client.chat.completions.create(
            model="sim-model", messages=messages, tools=[CALCULATOR]
        )
    # The tool's result is taken as it is, whatever --accuracy says.
    assert second.choices[0].finish_reason == "stop"
    assert boxed(second.choices[0].message.content) == "27"


async def test_any_function_with_a_single_string_parameter_is_used_as_the_tool() -> None:
    not_usable = {"type": "function", "function": {"name": "search", "parameters": {"properties": {}}}}
    evaluator = {
        "type": "function",
        "function": {"name": "eval_math", "parameters": {"properties": {"expr": {"type": "string"}}}},
    }
    reply = await chat(sim_app(), "What is 6 * 7?", tools=[not_usable, evaluator])
    [call] = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "eval_math"
    assert json.loads(call["function"]["arguments"]) == {"expr": "6 * 7"}


async def test_a_tool_error_rate_mistypes_tool_calls_so_tool_tasks_have_reward_variance() -> None:
    """Issue 21, item 11: with the right tool result every time, every calculator group has equal
    rewards, which training drops. ``tool_error_rate`` mistypes the call's expression (its value
    off by 1 to 3): the tool then returns, and the model answers, a wrong number."""
    app = sim_app(tool_error_rate=0.5, seed=7)
    values = []
    for _ in range(40):
        reply = await chat(app, "What is 3 * (4 + 5)?", tools=[CALCULATOR])
        [call] = reply["choices"][0]["message"]["tool_calls"]
        result = solve(json.loads(call["function"]["arguments"])["expression"])
        assert result is not None
        values.append(result.value)
    assert 27 in values
    wrong = {value - 27 for value in values if value != 27}
    assert wrong, "no call was mistyped"
    assert wrong <= {-3, -2, -1, 1, 2, 3}


async def test_without_a_tool_error_rate_every_tool_call_is_right() -> None:
    app = sim_app(seed=7)
    for _ in range(10):
        reply = await chat(app, "What is 3 * (4 + 5)?", tools=[CALCULATOR])
        [call] = reply["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["expression"] == "3 * (4 + 5)"


async def test_no_tool_call_without_a_usable_tool_or_with_tool_choice_none() -> None:
    two_params = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}},
        },
    }
    extras: list[dict[str, Any]] = [{"tools": [two_params]}, {"tools": [CALCULATOR], "tool_choice": "none"}]
    for extra in extras:
        choice = (await chat(sim_app(accuracy=1.0), "What is 6 * 7?", **extra))["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert not choice["message"]["tool_calls"]  # SGLang's null
        assert boxed(choice["message"]["content"]) == "42"


# Seeds, logprobs, n


async def test_the_same_request_seed_gives_the_same_reply() -> None:
    def request(seed: int) -> dict[str, Any]:
        return {"content": "What is 123 + 456?", "seed": seed, "logprobs": True, "top_logprobs": 2, "n": 3}

    first_app, second_app = sim_app(accuracy=0.5), sim_app(accuracy=0.5)
    await chat(second_app, "What is 1 + 1?")  # moves the server's generator: must not matter
    first = await chat(first_app, **request(7))
    second = await chat(second_app, **request(7))
    assert first["choices"] == second["choices"]

    answers = {
        boxed((await chat(first_app, **request(seed)))["choices"][0]["message"]["content"])
        for seed in range(30)
    }
    assert "579" in answers
    assert len(answers) > 1  # with accuracy 0.5, other seeds give other replies


async def test_the_server_seed_makes_a_sequence_of_replies_reproducible() -> None:
    async def replies(seed: int) -> list[tuple[str, str]]:
        app = sim_app(seed=seed, accuracy=0.5, abort_rate=0.5)
        result = []
        for _ in range(10):
            choice = (await chat(app, "What is 40 + 2?"))["choices"][0]
            result.append((choice["message"]["content"], choice["finish_reason"]))
        return result

    first = await replies(seed=3)
    assert await replies(seed=3) == first
    assert await replies(seed=4) != first


async def test_logprobs_have_one_entry_per_completion_token() -> None:
    async with openai_for(sim_app(accuracy=1.0)) as client:
        reply = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "What is 17 + 25?"}],
            logprobs=True,
            top_logprobs=3,
            n=2,
        )
    assert reply.usage is not None
    total = 0
    for choice in reply.choices:
        assert choice.logprobs is not None
        entries = choice.logprobs.content or []
        # One entry per output id: the end-of-turn token has one too.
        assert "".join(entry.token for entry in entries) == f"{choice.message.content}<|im_end|>"
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 3 for entry in entries)
        assert all(entry.top_logprobs[0].token == entry.token for entry in entries)
        total += len(entries)
    assert reply.usage.completion_tokens == total


# Stop strings, reasoning


async def test_a_stop_string_ends_the_reply_with_the_token_that_completed_it() -> None:
    first_line = "Let me work this out step by step."
    for engine, field in [("sglang", "matched_stop"), ("vllm", "stop_reason")]:
        reply = await chat(
            sim_app(engine=engine, accuracy=1.0), "What is 6 * 7?", stop=["\n"], return_token_ids=True
        )
        [choice] = reply["choices"]
        assert (choice["message"]["content"], choice["finish_reason"], choice[field]) == (
            first_line,
            "stop",
            "\n",
        )
        assert TOKENIZER.decode(choice["token_ids"]) == first_line + "\n"
    prompt = render([{"role": "user", "content": "What is 6 * 7?"}])
    _, finish_reason, text = await token_generate(
        sim_app(accuracy=1.0), "sglang", prompt, stop=["\n"], no_stop_trim=True
    )
    assert (finish_reason, text) == ("stop", first_line + "\n")
    _, _, trimmed = await token_generate(sim_app(engine="vllm", accuracy=1.0), "vllm", prompt, stop=["\n"])
    assert trimmed == first_line


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_thinking_template_puts_the_reasoning_before_the_answer(engine: str) -> None:
    app = sim_app(engine=engine, chat_template="thinking", accuracy=1.0)
    [choice] = (await chat(app, "What is 6 * 7?", return_token_ids=True))["choices"]
    message = choice["message"]
    assert "6 * 7 = 42" in message["reasoning_content"]
    assert boxed(message["content"]) == "42"
    assert "<think>" not in message["content"]
    if engine == "vllm":
        assert message["reasoning"] == message["reasoning_content"]
    assert choice["token_ids"][0] == THINK_ID
    raw = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    assert THINKER.decode(choice["token_ids"], skip_special_tokens=True) == raw

    off = await chat(
        app, "What is 6 * 7?", return_token_ids=True, chat_template_kwargs={"enable_thinking": False}
    )
    [choice] = off["choices"]
    assert choice["message"]["reasoning_content"] is None
    assert boxed(choice["message"]["content"]) == "42"
    assert THINK_ID not in choice["token_ids"]


async def test_generate_reasons_after_a_thinking_prompt_and_not_after_an_empty_think_block() -> None:
    app = sim_app(chat_template="thinking", accuracy=1.0)
    question = [{"role": "user", "content": "What is 6 * 7?"}]
    for enable_thinking, starts_thinking in [(True, True), (False, False)]:
        prompt = THINKER.apply_chat_template(
            question,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        assert isinstance(prompt, list)
        ids, _, text = await token_generate(app, "sglang", prompt)
        assert (ids[0] == THINK_ID) is starts_thinking
        assert text.startswith("<think>\n") is starts_thinking
        assert boxed(text) == "42"
