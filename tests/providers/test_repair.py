"""Tool-call repair on replies recorded from the real local model (tests/fixtures/local_replies).

Each fixture is a reply `gateway local` (Qwen2.5-Coder-0.5B, xllamacpp) really gave to the
chapter's tools; its `note` says which task and turn. The repaired reply must be one the
harness runs as intended: the right tool, the arguments the model meant, nothing invented.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.providers.repair import (
    calls_in_text,
    is_tool_parse_failure,
    repair_completion,
    split_undeclared,
    tool_schemas,
    without_tool_parsing,
)
from gateway.providers.reply import parse_completion
from gateway.tools.catalog import FILE_TOOLS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "local_replies"
TOOLS = tool_schemas([t.openai() for t in FILE_TOOLS])


def recorded(name: str) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((FIXTURES / name).read_bytes())
    return data


def args_of(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    calls = data["choices"][0]["message"]["tool_calls"]
    return [(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in calls]


def test_the_schemas_required_list_passed_as_an_argument_is_dropped() -> None:
    reply = recorded("schema_required_in_arguments.json")["reply"]
    before = copy.deepcopy(reply)
    fixed = repair_completion(reply, TOOLS)
    assert args_of(fixed.data) == [("read_file", {"path": "C:\\path\\to\\log.txt"})]  # the path is the model's own
    assert [(r.kind, r.tool) for r in fixed.repairs] == [("undeclared_keys_dropped", "read_file")]
    assert "required" in fixed.repairs[0].detail
    assert reply == before  # the caller's reply is not changed in place
    assert fixed.data["choices"][0]["message"]["tool_calls"][0]["id"] == before["choices"][0]["message"]["tool_calls"][0]["id"]


def test_a_schema_passed_as_the_arguments_leaves_the_arguments_the_tool_declares() -> None:
    fixed = repair_completion(recorded("schema_as_arguments.json")["reply"], TOOLS)
    assert args_of(fixed.data) == [("list_files", {})]
    assert fixed.repairs[0].detail.endswith("properties, type")


def test_a_call_written_as_json_in_the_content_becomes_a_tool_call() -> None:
    fixed = repair_completion(recorded("call_in_content.json")["reply"], TOOLS)
    message = fixed.data["choices"][0]["message"]
    assert message["content"] is None
    assert args_of(fixed.data) == [("read_file", {"path": "notes.txt"})]
    assert fixed.data["choices"][0]["finish_reason"] == "tool_calls"
    assert [r.kind for r in fixed.repairs] == ["call_from_text"]
    parsed = parse_completion(fixed.data)  # the one reply parser accepts what repair made
    assert parsed.message["tool_calls"][0]["id"].startswith("call_")


def test_a_fenced_call_becomes_a_tool_call() -> None:
    fixed = repair_completion(recorded("fenced_call.json")["reply"], TOOLS)
    assert args_of(fixed.data) == [("read_file", {"path": "C:\\Users\\YourUsername\\Desktop\\log.txt"})]
    assert [r.kind for r in fixed.repairs] == ["call_from_text"]


def test_two_calls_in_the_content_after_a_retry_become_two_calls_with_their_schemas_dropped() -> None:
    fixed = repair_completion(recorded("retry_two_calls_in_content.json")["reply"], TOOLS)
    assert args_of(fixed.data) == [("list_files", {}), ("read_file", {})]
    assert [r.kind for r in fixed.repairs] == ["call_from_text", "call_from_text", "undeclared_keys_dropped",
                                               "undeclared_keys_dropped"]
    ids = [c["id"] for c in fixed.data["choices"][0]["message"]["tool_calls"]]
    assert len(set(ids)) == 2


def test_trailing_prose_after_a_call_in_the_content_is_dropped() -> None:
    # The recorded call, with the kind of sentence the 1.5B adds after it (issue 17).
    reply = recorded("call_in_content.json")["reply"]
    reply["choices"][0]["message"]["content"] += "\nThis will show me what notes.txt contains."
    fixed = repair_completion(reply, TOOLS)
    assert args_of(fixed.data) == [("read_file", {"path": "notes.txt"})]
    assert fixed.data["choices"][0]["message"]["content"] is None


def test_trailing_prose_inside_the_arguments_string_is_trimmed() -> None:
    reply = recorded("schema_required_in_arguments.json")["reply"]
    call = reply["choices"][0]["message"]["tool_calls"][0]["function"]
    call["arguments"] = '{"path": "notes.txt"} and then I will read it'
    fixed = repair_completion(reply, TOOLS)
    assert args_of(fixed.data) == [("read_file", {"path": "notes.txt"})]
    assert [r.kind for r in fixed.repairs] == ["arguments_trimmed"]
    assert "and then I will read it" in fixed.repairs[0].detail


def test_llama_cpps_parse_failure_is_recognised_and_other_500s_are_not() -> None:
    error = recorded("tool_parse_500.json")
    assert error["status"] == 500
    assert is_tool_parse_failure(500, error["reply"]["error"]["message"])
    assert not is_tool_parse_failure(500, "failed to allocate the KV cache")
    assert not is_tool_parse_failure(400, error["reply"]["error"]["message"])
    body = {"model": "m", "messages": [], "tools": [1], "tool_choice": "auto"}
    assert without_tool_parsing(body) == {**body, "tool_choice": "none"}


@pytest.mark.parametrize("content", [
    '{"name": "search_web", "arguments": {"q": "timeouts"}}',  # a tool the request does not offer
    '{"answer": "errors.log"}',
    "The largest file is access.log.",
    '{"name": "read_file", "arguments": ["notes.txt"]}',  # recorded: arguments as a list, not guessed at
    None,
])
def test_what_is_not_a_call_of_a_known_tool_is_left_as_the_answer(content: str | None) -> None:
    reply = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    fixed = repair_completion(reply, TOOLS)
    assert fixed.data is reply and fixed.repairs == ()


def test_a_clean_call_is_passed_on_untouched() -> None:
    reply = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}]}}]}
    fixed = repair_completion(reply, TOOLS)
    assert fixed.data is reply and fixed.repairs == ()
    assert repair_completion(reply, {}).repairs == ()  # no tools offered: nothing to repair against


def test_undeclared_keys_go_only_when_the_schema_forbids_them_or_they_are_schema_words() -> None:
    open_schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    closed = {**open_schema, "additionalProperties": False}
    assert split_undeclared({"path": "a", "mode": "r"}, open_schema) == ({"path": "a", "mode": "r"}, [])
    assert split_undeclared({"path": "a", "mode": "r"}, closed) == ({"path": "a"}, ["mode"])
    assert split_undeclared({"properties": {"path": "notes.txt"}}, open_schema) == ({"path": "notes.txt"},
                                                                                   ["properties"])


def test_calls_in_text_are_bounded() -> None:
    many = "\n".join('{"name": "list_files", "arguments": {}}' for _ in range(50))
    assert len(calls_in_text(many, TOOLS)) == 8
