"""The gateway's pure parts: the session events and their replay, the call tree, the stream the
agent gets, and images kept by reference."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.service.gateway.assembly import assemble
from buffer.service.gateway.calls import Call
from buffer.service.gateway.images import ImagePolicy, ImageTooLarge
from buffer.service.gateway.proxy import for_agent, stream_chunks
from buffer.service.gateway.sessions import EVENT_KIND, SessionStore
from buffer.service.gateway.tree import continued, parent_of, path_to
from buffer.store.sqlite import Journal

USER = {"role": "user", "content": "Compute 2 + 3."}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
}
REPLY = {"role": "assistant", "content": None, "tool_calls": [CALL]}


def call(messages: list[dict[str, Any]], reply: dict[str, Any], parent: int | None, first_id: int) -> Call:
    tokens = {"prompt_ids": [first_id, 1], "output_ids": [first_id + 1], "output_logprobs": [-0.5]}
    return Call(messages, None, {}, reply, "stop", tokens, parent, 0.0)


def test_an_sdk_resending_a_reply_with_its_own_fields_still_continues_it() -> None:
    sent_back = {**REPLY, "tool_calls": [{**CALL, "id": "renumbered"}], "refusal": None, "content": ""}
    calls = {continued(call([USER], REPLY, None, 10), 0): 0}
    assert parent_of(calls, [USER, sent_back, {"role": "tool", "content": "5"}]) == (0, 2)
    assert parent_of(calls, [USER]) == (None, 0)  # a retry: a sibling, not a child
    other = {**REPLY, "tool_calls": [{**CALL, "function": {"name": "calculator", "arguments": "{}"}}]}
    assert parent_of(calls, [USER, other, {"role": "tool", "content": "5"}]) == (None, 0)


def test_the_trajectory_follows_the_path_that_ended() -> None:
    from buffer.service.gateway.sessions import Session

    session = Session("s", "agent", "q", ["http://e"], "k", 60.0, "discard", 0.0, 0.0)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    answer = {"role": "assistant", "content": "5", "reasoning_content": "easy"}
    session.calls = [
        call([USER], REPLY, None, 10),
        call([USER], REPLY, None, 20),
        call([tool], answer, 1, 30),  # the messages after its parent's messages and reply
    ]
    assert path_to(session.calls, 2) == [1, 2]
    trajectory = assemble(session, 1.0)
    assert [turn["prompt_ids"][0] for turn in trajectory["turns"]] == [20, 30]
    assert [turn["message_index"] for turn in trajectory["turns"]] == [1, 3]
    assert trajectory["messages"][3]["reasoning_content"] == "easy"
    assert trajectory["extra_info"]["gateway"] == {
        "session_id": "s",
        "calls": 3,
        "parents": [None, None, 1],
        "path": [1, 2],
    }
    first = assemble(session, 1.0, end=0)
    assert [turn["prompt_ids"][0] for turn in first["turns"]] == [10]


def test_sessions_come_back_from_the_journal_and_from_a_snapshot(tmp_path: Path) -> None:
    def started() -> tuple[RolloutBuffer, SessionStore, Journal]:
        buffer, store = RolloutBuffer(), SessionStore()
        buffer.add_extension(EVENT_KIND, store)
        journal = Journal(tmp_path, sync=False)
        buffer.restore(journal.recover())
        buffer.attach(journal)
        return buffer, store, journal

    buffer, _store, journal = started()
    header = {
        "e": EVENT_KIND,
        "op": "open",
        "id": "s",
        "t": "agent",
        "i": 7,
        "engine": "http://e",
        "key": "k",
    }
    buffer.log_event({**header, "timeout_s": 60.0, "on_timeout": "write", "at": 1.0, "meta": {"m": 1}})
    buffer.log_event({"e": EVENT_KIND, "op": "call", "id": "s"}, [call([USER], REPLY, None, 10).to_json()])
    buffer.log_event({"e": EVENT_KIND, "op": "reward", "id": "s", "reward": 0.5, "at": 2.0})
    journal.wait_durable_blocking()
    journal.compact()
    buffer.log_event({"e": EVENT_KIND, "op": "call", "id": "s"}, [call([USER], REPLY, None, 20).to_json()])
    journal.wait_durable_blocking()
    journal.close()

    _, restored, journal = started()
    session = restored.sessions["s"]
    assert (session.instance_id, session.reward, session.metadata, session.on_timeout) == (
        7,
        0.5,
        {"m": 1},
        "write",
    )
    assert [c.tokens["prompt_ids"][0] for c in session.calls if c.tokens] == [10, 20]
    journal.close()


def test_a_whole_answer_streams_as_openai_chunks() -> None:
    answer = {
        "id": "x",
        "created": 1,
        "model": "m",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "message": REPLY, "finish_reason": "tool_calls", "token_ids": [3]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    body = {"stream": True, "stream_options": {"include_usage": True}}
    lines = [
        line for chunk in stream_chunks(for_agent(answer, body), body) for line in chunk.split(b"\n") if line
    ]
    assert lines[-1] == b"data: [DONE]"
    events = [orjson.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[1]["choices"][0]["delta"]["tool_calls"][0]["function"] == CALL["function"]
    assert events[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[3]["usage"] == answer["usage"]
    assert "token_ids" not in orjson.dumps(events).decode()  # the capture's fields stay with the gateway


def test_a_large_image_is_kept_by_reference_and_a_huge_one_refused(tmp_path: Path) -> None:
    policy = ImagePolicy(tmp_path, "http://buffer/images/", inline_limit_bytes=10, max_image_bytes=100)
    image = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"x" * 40).decode()
    message = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": image, "detail": "low"}}],
    }
    (kept,), files = policy.keep([message])
    reference = kept["content"][0]["image_url"]
    assert reference["url"].startswith("http://buffer/images/")
    assert reference["detail"] == "low"
    assert list(files.values()) == [b"\x89PNG" + b"x" * 40]
    assert message["content"][0]["image_url"]["url"] == image  # the engine gets it as sent
    huge = "data:image/png;base64," + base64.b64encode(b"x" * 200).decode()
    with pytest.raises(ImageTooLarge):
        policy.keep([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": huge}}]}])


def test_an_engine_without_token_ids_leaves_the_trajectory_text_only() -> None:
    from buffer.service.gateway.sessions import Session

    session = Session("s", "agent", "q", ["http://e"], "k", 60.0, "discard", 0.0, 0.0)
    session.calls = [Call([USER], None, {}, {"role": "assistant", "content": "5"}, "stop", None, None, 0.0)]
    trajectory = assemble(session, 1.0)
    assert "turns" not in trajectory
    assert trajectory["messages"][-1] == {"role": "assistant", "content": "5", "generated": True}


def test_a_replay_without_the_gateway_keeps_its_sessions_through_a_compaction(tmp_path: Path) -> None:
    buffer, store = RolloutBuffer(), SessionStore()
    buffer.add_extension(EVENT_KIND, store)
    journal = Journal(tmp_path, sync=False)
    buffer.restore(journal.recover())
    buffer.attach(journal)
    header = {"e": EVENT_KIND, "op": "open", "id": "s", "t": "agent", "i": 7, "engine": "http://e"}
    buffer.log_event({**header, "key": "k", "timeout_s": 60.0, "on_timeout": "write", "at": 1.0})
    journal.wait_durable_blocking()
    journal.close()

    bare = RolloutBuffer()  # a tool that replays the journal knowing nothing of the gateway
    journal = Journal(tmp_path, sync=False)
    bare.restore(journal.recover())
    bare.attach(journal)
    journal.compact()
    journal.close()

    buffer, store = RolloutBuffer(), SessionStore()
    buffer.add_extension(EVENT_KIND, store)
    journal = Journal(tmp_path, sync=False)
    buffer.restore(journal.recover())
    journal.close()
    assert store.sessions["s"].instance_id == 7
