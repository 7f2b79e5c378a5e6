"""The one parser of a chat.completion reply: what it keeps, and the field it names when it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.harness.usage import Usage
from gateway.providers.reply import MalformedReply, parse_completion


def body(message: Any = None, **extra: Any) -> dict[str, Any]:
    msg = {"role": "assistant", "content": "hi"} if message is None else message
    return {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}], **extra}


def test_a_plain_reply_is_kept_as_the_transcript_keeps_it() -> None:
    parsed = parse_completion(body(usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    assert parsed.message == {"role": "assistant", "content": "hi"}
    assert parsed.usage == Usage(3, 2) and parsed.finish_reason == "stop"


def test_tool_calls_keep_their_ids_and_a_missing_or_odd_id_is_left_to_the_harness() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
             {"function": {"name": "b", "arguments": "{}"}},
             {"id": 7, "function": {"name": "c", "arguments": None}}]
    parsed = parse_completion({"choices": [{"message": {"content": None, "tool_calls": calls}}]})
    out = parsed.message["tool_calls"]
    assert [c.get("id") for c in out] == ["c1", None, None]
    assert [c["function"]["arguments"] for c in out] == ["{}", "{}", ""]
    assert parsed.usage is None and parsed.finish_reason == "stop"


def test_text_parts_are_joined() -> None:
    parsed = parse_completion(body({"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}))
    assert parsed.message["content"] == "ab"


@pytest.mark.parametrize(("data", "where"), [
    ([], "the body is not a JSON object"),
    ({"choices": "x"}, "choices is not a list"),
    ({"choices": []}, "choices is empty"),
    ({"choices": [1]}, "choices[0] is not an object"),
    ({"choices": [{"message": "hi"}]}, "choices[0].message is not an object"),
    ({"choices": [{"message": {"content": "x"}, "finish_reason": 3}]}, "choices[0].finish_reason is not a string"),
    (body({"role": "user", "content": "x"}), "choices[0].message.role is 'user'"),
    (body({"content": 5}), "choices[0].message.content is a number"),
    (body({"content": [{"type": "image"}]}), "choices[0].message.content[0] is not a text part"),
    (body({"content": None, "tool_calls": "abc"}), "choices[0].message.tool_calls is a string, not a list"),
    (body({"content": None, "tool_calls": {"a": 1}}), "choices[0].message.tool_calls is an object, not a list"),
    (body({"content": None, "tool_calls": [1]}), "choices[0].message.tool_calls[0] is not an object"),
    (body({"content": None, "tool_calls": [{"function": "f"}]}),
     "choices[0].message.tool_calls[0].function is not an object"),
    (body({"content": None, "tool_calls": [{"type": "function"}]}),
     "choices[0].message.tool_calls[0].function is not an object"),
    (body({"content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}),
     "choices[0].message.tool_calls[0].function.name is not a non-empty string"),
    (body({"content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}),
     "choices[0].message.tool_calls[0].function.arguments is an object, not a string"),
    (body({"content": None, "tool_calls": [{"type": "web", "function": {"name": "f", "arguments": ""}}]}),
     "choices[0].message.tool_calls[0].type is 'web'"),
    (body(usage="lots"), "usage is a string, not an object"),
    (body(usage={"prompt_tokens": -1, "completion_tokens": 2}), "usage.prompt_tokens is -1"),
    (body(usage={"prompt_tokens": 1, "completion_tokens": 2.5}), "usage.completion_tokens is 2.5"),
    (body(usage={"prompt_tokens": True, "completion_tokens": 2}), "usage.prompt_tokens is True"),
    (body(usage={"total_tokens": 3}), "usage.prompt_tokens is None"),
])
def test_malformed_replies_name_the_field(data: Any, where: str) -> None:
    with pytest.raises(MalformedReply) as info:
        parse_completion(data)
    assert str(info.value).startswith(where)
