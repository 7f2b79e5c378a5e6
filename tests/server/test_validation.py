"""Malformed input against a real gateway process: a 400 (or 431) naming what is wrong, never a 500.

Each case of finding 7 of issue 9 (and the input half of finding 8) answered 500, or 200
with an exception class name, and several created the run before failing. Here each is
refused up front in the OpenAI error shape, the run is not created, and valid bodies of
every shape the schema allows still go through.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.served import DEMO, OPS, Served, auth, chat_body

URL_CHAT = "/v1/chat/completions"
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("validation") / "gw")
    yield gateway
    gateway.proc.stop()


def assert_refused(status: int, body: Any, param: str | None, *, code: str | None = None, mentions: str = "",
                   expected: int = 400) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and set(body["error"]) == {"message", "type", "code", "param"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert mentions in body["error"]["message"], body
    assert not CLASS_NAME.search(body["error"]["message"]), body


async def assert_no_run(session: aiohttp.ClientSession, served: Served, run_id: str) -> None:
    status, _, body = await request(session, "GET", f"{served.url}/v1/runs/{run_id}")
    assert status == 404, body


async def request(session: aiohttp.ClientSession, method: str, url: str, *, key: str = DEMO,
                  body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """Like served.request, but the body is written by the json module: orjson refuses
    integers past 64 bits and lists nested 400 deep, which is what these tests send."""
    data = json.dumps(body).encode() if body is not None else None
    async with session.request(method, url, data=data, headers=auth(key, **(headers or {}))) as resp:
        raw = await resp.read()
        parsed = orjson.loads(raw) if raw and resp.content_type == "application/json" else raw.decode()
    return resp.status, dict(resp.headers), parsed


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


USER = {"role": "user", "content": "x"}

MALFORMED = [
    # (id, extra headers, body, param, mentions)
    ("tool-calls-number", {}, chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": [1]}]),
     "messages[1].tool_calls[0]", "tool call object"),
    ("tool-calls-string", {}, chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": "abc"}]),
     "messages[1].tool_calls", "array"),
    ("tool-calls-object", {}, chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": {"a": 1}}]),
     "messages[1].tool_calls", "array"),
    ("tool-call-function-string", {},
     chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": "f"}]}]),
     "messages[1].tool_calls[0].function", "object"),
    ("tool-call-without-id", {"X-Policy": "files"},
     chat_body("scripted-plan", [USER, {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "list_files", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0].id", "required"),
    ("files-tool-calls-string", {"X-Policy": "files"},
     chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": "abc"}]),
     "messages[1].tool_calls", "array"),
    ("max-tokens-int64", {}, chat_body("scripted-plan", max_tokens=2**63 - 1), "max_tokens", "<= 1000000"),
    ("max-completion-tokens-2e62", {}, chat_body("scripted-plan", max_completion_tokens=2**62),
     "max_completion_tokens", "<= 1000000"),
    ("list-400-deep", {}, chat_body("scripted-plan", [{**USER, "extra": nested(400)}]),
     "messages[0].extra" + "[0]" * 61, "more than 64 deep"),
    ("files-tool-without-type", {"X-Policy": "files"}, chat_body("scripted-plan", tools=[{"function": "x"}]),
     "tools[0].type", "function"),
    ("tool-message-without-call-id", {}, chat_body("scripted-plan", [USER, {"role": "tool", "content": "r"}]),
     "messages[1].tool_call_id", "required"),
    ("image-part-in-system", {}, chat_body("scripted-plan", [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}, USER]),
     "messages[0].content[0].type", "text"),
    ("tool-name-pattern", {}, chat_body("scripted-plan", tools=[
        {"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "1-64"),
    ("temperature", {}, chat_body("scripted-plan", temperature=2.5), "temperature", "<= 2"),
    ("seed-beyond-int64", {}, chat_body("scripted-plan", seed=2**63), "seed", "integer"),
    ("n", {}, chat_body("scripted-plan", n=129), "n", "<= 128"),
    ("stop-five", {}, chat_body("scripted-plan", stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    ("logit-bias-key", {}, chat_body("scripted-plan", logit_bias={"abc": 1}), "logit_bias.abc", "token ids"),
]


@pytest.mark.parametrize(("run_id", "headers", "body", "param", "mentions"), MALFORMED, ids=[c[0] for c in MALFORMED])
async def test_malformed_chat_body_is_400_before_any_run(served: Served, session: aiohttp.ClientSession, run_id: str,
                                                         headers: dict[str, str], body: dict[str, Any], param: str,
                                                         mentions: str) -> None:
    status, got_headers, answer = await request(session, "POST", served.url + URL_CHAT, body=body,
                                                headers={"X-Run-Id": run_id, **headers})
    assert_refused(status, answer, param, mentions=mentions)
    assert "X-Run-Status" not in got_headers
    await assert_no_run(session, served, run_id)


VALID_BODIES = [
    chat_body("scripted-plan", [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "file", "file": {"file_id": "f1"}}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "Which file mentions a timeout?"}],
        tools=[{"type": "function", "function": {"name": "lookup", "description": "d", "strict": None,
                                                  "parameters": {"type": "object", "properties": {}}}}],
        tool_choice={"type": "function", "function": {"name": "lookup"}}, parallel_tool_calls=True,
        temperature=0, top_p=1, n=1, seed=-(2**63), stop=None, logit_bias={"50256": -100},
        max_completion_tokens=100_000, presence_penalty=-2, frequency_penalty=2, user="u",
        metadata={"k": "v"}, some_future_field={"nested": [1, 2, {"deep": True}]}),
    chat_body("scripted-plan", [USER, {"role": "assistant", "content": "", "function_call": {
        "name": "f", "arguments": "{}"}}, {"role": "function", "name": "f", "content": None}, USER],
        functions=[{"name": "f"}], function_call="auto", stream=True, stream_options={"include_usage": True}),
    chat_body("scripted-plan", [{**USER, "extra": nested(61)}], tool_choice="none"),
]


@pytest.mark.parametrize("body", VALID_BODIES, ids=["every-part-and-field", "legacy-functions-streamed",
                                                    "64-deep"])
async def test_valid_bodies_of_every_shape_go_through(served: Served, session: aiohttp.ClientSession,
                                                      body: dict[str, Any]) -> None:
    status, headers, answer = await request(session, "POST", served.url + URL_CHAT, body=body)
    assert status == 200, answer
    if body.get("stream"):
        assert answer.endswith("data: [DONE]\n\n") and "\"error\":{" not in answer


async def test_files_run_given_odd_history_never_names_an_exception(served: Served,
                                                                   session: aiohttp.ClientSession) -> None:
    """Finding 8, input half: 'tool_calls': 'abc' answered 200 "The run failed: AttributeError ..."."""
    body = chat_body("scripted-plan", [USER, {"role": "assistant", "tool_calls": "abc"}])
    status, _, answer = await request(session, "POST", served.url + URL_CHAT, body=body,
                                      headers={"X-Policy": "files"})
    assert_refused(status, answer, "messages[1].tool_calls")


def make_run(served: Served, run_id: str, policy: str) -> str:
    async def make() -> str:
        async with aiohttp.ClientSession() as session:
            status, headers, body = await request(session, "POST", served.url + URL_CHAT,
                                                  body=chat_body("scripted-plan"),
                                                  headers={"X-Run-Id": run_id, "X-Policy": policy})
            assert status == 200, body
            return headers["X-Run-Id"]

    return asyncio.run(make())


@pytest.fixture(scope="module")
def run_id(served: Served) -> str:
    return make_run(served, "ok-run", "passthrough")


@pytest.fixture(scope="module")
def files_run_id(served: Served) -> str:
    return make_run(served, "ok-files-run", "files")


@pytest.mark.parametrize(("query", "headers", "param"), [
    ("?after=²", {}, "after"),
    ("", {"Last-Event-ID": "³"}, "Last-Event-ID"),
    ("?after=" + "9" * 31, {}, "after"),
    ("?after=-1", {}, "after"),
    ("", {"Last-Event-ID": "-5"}, "Last-Event-ID"),
    ("?follow=maybe", {}, "follow"),
    ("?follow=1&after=1e3", {}, "after"),
])
async def test_bad_trace_parameters_are_400(served: Served, session: aiohttp.ClientSession, run_id: str,
                                            query: str, headers: dict[str, str], param: str) -> None:
    status, _, body = await request(session, "GET", f"{served.url}/v1/runs/{run_id}/events{query}", headers=headers)
    assert_refused(status, body, param)


async def test_good_trace_parameters_still_work(served: Served, session: aiohttp.ClientSession, run_id: str) -> None:
    for query, headers in (("?after=0&follow=0", {}), ("", {"Last-Event-ID": "1"}), ("?follow=false", {})):
        status, _, body = await request(session, "GET", f"{served.url}/v1/runs/{run_id}/events{query}",
                                        headers=headers)
        assert status == 200, body


@pytest.mark.parametrize(("query", "param"), [
    ("?limit=²", "limit"), ("?limit=" + "9" * 31, "limit"), ("?limit=-3", "limit"), ("?limit=0", "limit"),
    ("?status=zz", "status"), ("?team=" + "t" * 200, "team"),
])
async def test_bad_list_parameters_are_400(served: Served, session: aiohttp.ClientSession, query: str,
                                           param: str) -> None:
    status, _, body = await request(session, "GET", f"{served.url}/v1/runs{query}")
    assert_refused(status, body, param)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("resume", {"max_turns": 10**30}, "max_turns"),
    ("resume", {"max_turns": 0}, "max_turns"),
    ("resume", {"max_turns": 2.5}, "max_turns"),
    ("resume", {"max_budget_usd": 1e308}, "max_budget_usd"),
    ("resume", {"max_budget_usd": -1}, "max_budget_usd"),
    ("resume", {"max_budget_usd": "5"}, "max_budget_usd"),
    ("resume", {"max_budget_usd": True}, "max_budget_usd"),
    ("resume", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("cancel", {"reason": 7}, "reason"),
    ("cancel", {"reason": "r" * 5000}, "reason"),
    ("cancel", {"reason": nested(100)}, "reason" + "[0]" * 63),
])
async def test_bad_runs_bodies_are_400(served: Served, session: aiohttp.ClientSession, run_id: str, route: str,
                                       body: dict[str, Any], param: str) -> None:
    status, _, answer = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/{route}", body=body)
    assert_refused(status, answer, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"call_id": 5, "decision": "approve"}, "call_id"),
    ({"call_id": "c" * 300, "decision": "approve"}, "call_id"),
    ({"call_id": "c1", "decision": "maybe"}, "decision"),
    ({"call_id": "c1", "decision": "reject", "reason": ["no"]}, "reason"),
])
async def test_bad_approval_bodies_are_400(served: Served, session: aiohttp.ClientSession, files_run_id: str,
                                           body: dict[str, Any], param: str) -> None:
    # ops is the approver of the files policy
    status, _, answer = await request(session, "POST", f"{served.url}/v1/runs/{files_run_id}/approvals", body=body,
                                      key=OPS)
    assert_refused(status, answer, param)


async def test_a_body_that_does_not_match_its_encoding_is_400(served: Served,
                                                              session: aiohttp.ClientSession) -> None:
    """It answered 500 (aiohttp's decoder raised from request.read())."""
    for encoding in ("gzip", "deflate", "br"):
        async with session.post(served.url + URL_CHAT, data=b'{"model": "scripted-plan"}',
                                headers={**auth(), "Content-Encoding": encoding}) as resp:
            status, body = resp.status, await resp.json()
        assert_refused(status, body, None, code="invalid_body", mentions="Content-Encoding")
    # the connection was closed with the answer, so the session's next call is served as usual
    status, _, body = await request(session, "POST", served.url + URL_CHAT, body=chat_body("scripted-plan"))
    assert status == 200, body


def raw_exchange(served: Served, head: bytes) -> tuple[int, str, bytes]:
    """Send a raw request head; (status, content type, body) of the answer."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_part, _, body = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers.get("content-type", ""), body


@pytest.mark.parametrize("head", [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n",
    b"GET /v1/models?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["header-over-8k", "200-headers", "request-line-over-8k"])
def test_oversized_heads_get_the_openai_shape(served: Served, head: bytes) -> None:
    status, content_type, body = raw_exchange(served, head)
    assert status == 431
    assert content_type.startswith("application/json")
    error = orjson.loads(body)["error"]
    assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error", error
    assert b"aaaa" not in body  # the offending bytes are not echoed


def test_unparsable_request_gets_the_openai_shape(served: Served) -> None:
    status, content_type, body = raw_exchange(served, b"GET /healthz HTTP/1.1\r\nBad Header Line\r\n\r\n")
    assert status == 400 and content_type.startswith("application/json")
    assert orjson.loads(body)["error"]["code"] == "invalid_http_request"


async def test_the_gateway_key_still_matters_with_big_headers(served: Served,
                                                              session: aiohttp.ClientSession) -> None:
    # a head just under the limit is an ordinary request
    status, _, body = await request(session, "GET", served.url + "/v1/models", headers={"X-Pad": "p" * 8000})
    assert status == 200, body
    status, _, body = await request(session, "GET", served.url + "/v1/runs", key="sk-nope")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
