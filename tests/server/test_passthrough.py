"""Governed pass-through over real HTTP: every call is one turn of its run, booked exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.providers.scenarios import PLAN_ANSWER
from gateway.tokens import get_counter
from gateway.tools.catalog import FILE_TOOLS
from gateway.tools.files import Sandbox, fresh_sandbox
from tests.server.conftest import (
    KEY,
    PLAN_USER,
    FixedUpstream,
    Gateway,
    MakeGateway,
    fixed_config,
    plan_start,
    run_tools_locally,
)

TOOLS = [t.openai() for t in FILE_TOOLS]
PRICE = Price(2.0, 12.0)


async def test_plan_task_in_the_clients_loop_books_every_turn(gw: Gateway, tmp_path: Path) -> None:
    sandbox = Sandbox(fresh_sandbox(tmp_path / "sandbox"))
    messages = plan_start()
    turns_seen, costs_seen, usages = [], [], []
    for _ in range(6):
        status, headers, body = await gw.chat({"model": "scripted-plan", "messages": messages, "tools": TOOLS},
                                              run_id="plan-1")
        assert status == 200, body
        turns_seen.append(int(headers["X-Run-Turns"]))
        costs_seen.append(float(headers["X-Run-Cost-Usd"]))
        usages.append(Usage.from_json(body["usage"]))
        assert body["run"]["id"] == "plan-1" and body["run"]["turns"] == turns_seen[-1]
        message = body["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None or k == "content"})
        if not message.get("tool_calls"):
            break
        messages.extend(await run_tools_locally(sandbox, message))
    assert messages[-1]["content"] == PLAN_ANSWER
    assert turns_seen == [1, 2, 3]
    assert costs_seen == sorted(costs_seen) and costs_seen[0] > 0
    expected = sum(PRICE.cost(u) for u in usages)
    run = await gw.store.load_run(scoped_run_id("t", "plan-1"))
    assert run is not None
    assert run.turns == 3 and run.status == "completed" and run.team == "t" and run.policy == "passthrough"
    assert run.per_turn == usages
    assert abs(run.cost_usd - expected) < 1e-12
    assert abs(costs_seen[-1] - expected) < 1e-9
    assert run.messages == messages  # the last transcript, answer included
    # The trace: one `turn` line per call (cumulative cost), then the completion.
    events = [e for _, e in await gw.store.events(scoped_run_id("t", "plan-1"))]
    turns = [e for e in events if e["type"] == "turn"]
    assert [e["turn"] for e in turns] == [1, 2, 3]
    assert [e["prompt_tokens"] for e in turns] == [u.prompt_tokens for u in usages]
    assert all(e["runId"] == "t/plan-1" and e["total_tokens"] == e["prompt_tokens"] + e["completion_tokens"]
               for e in turns)
    assert abs(turns[-1]["costUsd"] - expected) < 1e-9
    assert [e["finish"] for e in turns] == ["tool_calls", "tool_calls", "stop"]
    assert events[-1]["type"] == "run_stopped" and events[-1]["status"] == "completed"
    # ... and the same lines in the trace file.
    assert gw.config.trace_file is not None
    lines = [orjson.loads(line) for line in gw.config.trace_file.read_bytes().splitlines()]
    assert [e["type"] for e in lines if e["runId"] == "t/plan-1"] == [e["type"] for e in events]


async def test_without_a_run_id_each_call_is_a_new_run(gw: Gateway) -> None:
    ids = set()
    for _ in range(2):
        status, headers, body = await gw.chat({"model": "scripted-plan", "messages": [PLAN_USER]})
        assert status == 200
        assert headers["X-Run-Id"] == body["run"]["id"]
        assert headers["X-Run-Turns"] == "1"
        ids.add(headers["X-Run-Id"])
    assert len(ids) == 2
    assert {r.public_id for r in await gw.store.list_runs()} == ids


async def test_x_policy_picks_the_policy_of_a_new_run_and_must_match_later(gw: Gateway) -> None:
    status, headers, _ = await gw.chat({"model": "scripted-plan", "messages": [PLAN_USER]}, run_id="pol-1",
                                       headers={"X-Policy": "capped"})
    assert status == 200
    run = await gw.store.load_run(scoped_run_id("t", "pol-1"))
    assert run is not None and run.policy == "capped" and run.limits.max_turns == 3
    status, _, _ = await gw.chat({"model": "scripted-plan", "messages": [PLAN_USER]}, run_id="pol-1",
                                 headers={"X-Policy": "capped"})
    assert status == 200
    status, _, _ = await gw.chat({"model": "scripted-plan", "messages": [PLAN_USER]}, run_id="pol-1")
    assert status == 200  # absent: the run's own policy


async def test_non_streamed_body_is_the_upstreams_bytes_plus_run(make_gateway: MakeGateway,
                                                                 fixed_upstream: FixedUpstream) -> None:
    fixed_upstream.json_body = (
        b'{"id": "cmpl-1",  "object":"chat.completion", "choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"caf\\u00e9 \xc3\xa9t\xc3\xa9"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":11,"completion_tokens":4,"total_tokens":15}, "x_vendor": [1,2.50]}  \n'
    )
    gw = await make_gateway(**fixed_config(fixed_upstream))
    async with gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": "m", "messages": [PLAN_USER]}) as resp:
        raw = await resp.read()
    head = fixed_upstream.json_body.rstrip()[:-1]
    assert raw.startswith(head + b',"run":')
    body = orjson.loads(raw)
    assert body["x_vendor"] == [1, 2.5] and body["choices"][0]["message"]["content"] == "café été"
    assert body["run"]["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    assert abs(body["run"]["cost_usd"] - PRICE.cost(Usage(11, 4))) < 1e-12
    # nothing changed: the client's bytes went upstream as they were (no stream options added)
    assert fixed_upstream.requests == [{"model": "m", "messages": [PLAN_USER]}]


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


# Deliberately odd but valid bytes: spaces, escapes, key order. They must reach the client as they are.
TOOL_STREAM = [
    _sse(b'{"id":"s1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant",'
         b'"content":null,"tool_calls":[{"index":0,"id":"call_A","type":"function","function":{"name":"read_file",'
         b'"arguments":""}}]},"finish_reason":null}]}'),
    _sse(b'{"choices": [ {"delta": {"tool_calls": [{"function": {"arguments": "{\\"pa"}, "index": 0}]},'
         b' "index": 0, "finish_reason": null}], "id": "s1"}'),
    _sse(b'{"id":"s1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":'
         b'"th\\": \\"\\u00e9.log\\"}"}}]},"finish_reason":null}]}'),
    _sse(b'{"id":"s1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}'),
]
USAGE_CHUNK = _sse(b'{"id":"s1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}')
DONE = b"data: [DONE]\n\n"


async def _stream(gw: Gateway, body: dict[str, Any], run_id: str) -> tuple[dict[str, str], bytes]:
    async with gw.client.post("/v1/chat/completions", data=orjson.dumps(body),
                              headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), await resp.read()


async def test_stream_passes_tool_call_deltas_byte_exact_and_strips_unasked_usage(
        make_gateway: MakeGateway, fixed_upstream: FixedUpstream) -> None:
    fixed_upstream.stream_events = [*TOOL_STREAM, USAGE_CHUNK, DONE]
    gw = await make_gateway(**fixed_config(fixed_upstream))
    headers, raw = await _stream(gw, {"model": "m", "messages": [PLAN_USER], "stream": True}, "s-1")
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["X-Run-Id"] == "s-1" and headers["X-Run-Turns"] == "0"
    assert raw.startswith(b"".join(TOOL_STREAM))  # byte for byte, in order
    assert USAGE_CHUNK not in raw  # the client did not ask for usage
    assert raw.endswith(DONE)
    comment = next(line for line in raw.split(b"\n") if line.startswith(b": run "))
    assert orjson.loads(comment[len(b": run "):])["turns"] == 1
    # usage was asked for upstream all the same, and booked from the upstream's figures
    assert fixed_upstream.requests[0]["stream_options"] == {"include_usage": True}
    run = await gw.store.load_run(scoped_run_id("t", "s-1"))
    assert run is not None and run.per_turn == [Usage(9, 7)]
    assert run.messages[-1]["tool_calls"] == [
        {"id": "call_A", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "é.log"}'}}]


async def test_stream_keeps_the_usage_chunk_when_the_client_asks(make_gateway: MakeGateway,
                                                                 fixed_upstream: FixedUpstream) -> None:
    fixed_upstream.stream_events = [*TOOL_STREAM, USAGE_CHUNK, DONE]
    gw = await make_gateway(**fixed_config(fixed_upstream))
    body = {"model": "m", "messages": [PLAN_USER], "stream": True, "stream_options": {"include_usage": True}}
    _, raw = await _stream(gw, body, "s-2")
    assert raw.startswith(b"".join(TOOL_STREAM) + USAGE_CHUNK)


async def test_stream_without_upstream_usage_is_counted_with_o200k(make_gateway: MakeGateway,
                                                                   fixed_upstream: FixedUpstream) -> None:
    text = ["The file ", "errors.log", " mentions a timeout", "."]
    fixed_upstream.stream_events = [
        _sse({"id": "s", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        *[_sse({"id": "s", "choices": [{"index": 0, "delta": {"content": t}}]}) for t in text],
        _sse({"id": "s", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        DONE,
    ]
    gw = await make_gateway(**fixed_config(fixed_upstream))
    messages = plan_start()
    await _stream(gw, {"model": "m", "messages": messages, "tools": TOOLS, "stream": True}, "s-3")
    counter = get_counter()
    expected = Usage(counter.count_request(messages, TOOLS),
                     counter.count_completion({"role": "assistant", "content": "".join(text)}))
    run = await gw.store.load_run(scoped_run_id("t", "s-3"))
    assert run is not None and run.per_turn == [expected] and run.status == "completed"
    assert abs(run.cost_usd - PRICE.cost(expected)) < 1e-12


async def test_non_streamed_answer_without_usage_is_counted(make_gateway: MakeGateway,
                                                           fixed_upstream: FixedUpstream) -> None:
    answer = {"role": "assistant", "content": "errors.log mentions a timeout."}
    fixed_upstream.json_body = orjson.dumps({"id": "x", "choices": [{"index": 0, "message": answer,
                                                                     "finish_reason": "stop"}]})
    gw = await make_gateway(**fixed_config(fixed_upstream))
    status, _, body = await gw.chat({"model": "m", "messages": [PLAN_USER]}, run_id="n-1")
    assert status == 200
    counter = get_counter()
    expected = Usage(counter.count_request([PLAN_USER]), counter.count_completion(answer))
    assert body["run"]["usage"] == expected.to_json()
