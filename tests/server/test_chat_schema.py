"""Properties of the request schema's two paths and of what it lets through.

The schema recognises the usual messages on a fast path; whatever the fast path accepts,
the full check accepts too. And the token counter never fails on messages or replies the
schema accepts (it also counts stored runs and upstream replies).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.server.http.chat_schema import (
    _message,
    _plain,
    check_messages,
    check_tools,
)
from gateway.server.http.errors import InvalidField
from gateway.tokens import get_counter

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=400)

LEAF = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4)
VALUE = st.recursive(LEAF, lambda c: st.lists(c, max_size=2) | st.dictionaries(st.text(max_size=3), c, max_size=2),
                     max_leaves=4)
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "robot"])
CALL = st.fixed_dictionaries({"id": st.sampled_from(["c1", ""]), "type": st.sampled_from(["function", "custom"]),
                              "function": st.fixed_dictionaries({"name": st.sampled_from(["f", ""]),
                                                                 "arguments": st.sampled_from(["{}", 1])})})
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "refusal", "image_url"]), "text": st.text(max_size=3)})


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    m: dict[str, Any] = {"role": draw(ROLE | VALUE)}
    if draw(st.booleans()):
        m["content"] = draw(st.text(max_size=5) | st.none() | st.lists(PART, max_size=2) | VALUE)
    if draw(st.booleans()):
        m["tool_calls"] = draw(st.lists(CALL, max_size=2) | VALUE)
    if draw(st.integers(0, 3)) == 0:
        m["tool_call_id"] = draw(st.sampled_from(["c1", ""]) | VALUE)
    if draw(st.integers(0, 5)) == 0:
        m["name"] = draw(st.text(max_size=3) | VALUE)
    return m


@SETTINGS
@given(messages())
def test_the_fast_path_accepts_only_what_the_full_check_accepts(message: dict[str, Any]) -> None:
    if _plain(message):
        _message(message, "messages[0]")


@SETTINGS
@given(st.lists(messages(), min_size=1, max_size=4), st.lists(st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g_1"])},
                                                                   optional={"parameters": st.dictionaries(
                                                                       st.text(max_size=3), VALUE, max_size=2)})}),
    max_size=2))
def test_the_token_counter_counts_whatever_the_schema_accepts(batch: list[dict[str, Any]],
                                                             tools: list[dict[str, Any]]) -> None:
    try:
        check_messages(batch)
        check_tools(tools)
    except InvalidField:
        return
    counter = get_counter()
    assert counter.count_request(batch, tools) > 0
    for m in batch:
        if m["role"] == "assistant":
            assert counter.count_completion(m) >= 0


@pytest.mark.parametrize("calls", ["abc", [1], {"a": 1}, [{"function": "f"}], [{"id": 3, "function": None}]])
def test_the_token_counter_survives_calls_that_are_not_calls(calls: Any) -> None:
    """Upstream replies and stored runs are not checked by the schema: counting them must not fail."""
    counter = get_counter()
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    assert counter.count_completion(message) >= 0
    assert counter.count_request([{"role": "user", "content": "x"}, message]) > 0
