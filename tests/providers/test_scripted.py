"""The scripted provider over real HTTP: scripts, usage, streaming, limits, failures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.harness.tools import ToolContext
from gateway.providers.scripted import FailCalls, scripted_app, standalone_app
from gateway.tokens import get_counter
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, file_tools
from tests.support.procs import free_port, start_gateway

URL = "/v1/chat/completions"
TOOLS = [t.openai() for t in FILE_TOOLS]
CHAPTER_PLAN_PROMPTS = [204, 269, 342]


def start() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]


async def drive(client: TestClient, model: str, sandbox: Sandbox, max_turns: int = 20,
                error_text: str = "Error: {message}") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A minimal client-side agent loop: real tool runs, tool errors as text. Returns (usages, messages)."""
    tools = file_tools(sandbox)
    messages = start()
    usages = []
    for _ in range(max_turns):
        resp = await client.post(URL, json={"model": model, "messages": messages, "tools": TOOLS})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        usages.append(body["usage"])
        message = body["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            ctx = ToolContext("run", call["id"], name, asyncio.Event())
            try:
                result = str(await tools[name].run(json.loads(call["function"]["arguments"]), ctx))
            except Exception as exc:
                result = error_text.format(message=exc)
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
        if not message.get("tool_calls"):
            break
    return usages, messages


async def test_plan_per_turn_prompt_tokens_match_the_chapter(client: TestClient, sandbox: Sandbox) -> None:
    usages, messages = await drive(client, "scripted-plan", sandbox)
    prompts = [u["prompt_tokens"] for u in usages]
    assert len(prompts) == 3
    for ours, chapter in zip(prompts, CHAPTER_PLAN_PROMPTS):
        assert abs(ours - chapter) <= 0.10 * chapter, (prompts, CHAPTER_PLAN_PROMPTS)
    assert prompts[0] < prompts[1] < prompts[2]
    assert messages[-1]["content"] == "errors.log mentions a timeout: worker 7 timed out after 30000 ms."
    assert [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")] == ["c1", "c2"]
    # The cost line of the chapter: in=815 out=70 cost=$0.002470 (within 10%).
    spent_in = sum(prompts)
    spent_out = sum(u["completion_tokens"] for u in usages)
    assert abs(spent_in - 815) <= 81.5 and abs(spent_out - 70) <= 7
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # Usage is the counter's arithmetic on exactly what was sent and received.
    assert usages[-1]["prompt_tokens"] == get_counter().count_request(messages[:-1], TOOLS)
    assert usages[-1]["completion_tokens"] == get_counter().count_completion(messages[-1])


async def test_runaway_grows_by_about_64_tokens_a_turn(client: TestClient, sandbox: Sandbox) -> None:
    usages, messages = await drive(client, "scripted-runaway", sandbox, max_turns=8)
    prompts = [u["prompt_tokens"] for u in usages]
    growth = {b - a for a, b in zip(prompts, prompts[1:])}
    assert len(prompts) == 8 and all(abs(g - 64) <= 3 for g in growth), prompts
    assert abs(sum(prompts) - 3431) <= 0.05 * 3431, sum(prompts)
    assert [m["tool_calls"][0]["id"] for m in messages if m.get("role") == "assistant"] == [f"c{i}" for i in range(1, 9)]


async def test_recover_depends_on_what_the_error_says(client: TestClient, sandbox: Sandbox) -> None:
    _, actionable = await drive(client, "scripted-recover", sandbox)
    assert actionable[-1]["content"] == "errors.log mentions a timeout."
    assert sum(1 for m in actionable if m["role"] == "assistant") == 4
    _, vague = await drive(client, "scripted-recover", sandbox, error_text="Error")
    assert vague[-1]["content"] == "I could not read the file, so I do not know."


async def test_forbidden_keeps_asking_for_the_same_refused_read(client: TestClient, sandbox: Sandbox) -> None:
    _, messages = await drive(client, "scripted-forbidden", sandbox, max_turns=3)
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == ["Error: permission denied: /etc/shadow is outside the working folder"] * 3


async def _reply(client: TestClient, model: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    resp = await client.post(URL, json={"model": model, "messages": messages, **extra})
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


def _transcript(*tool_results: str) -> list[dict[str, Any]]:
    """A transcript in which the script already asked len(tool_results) times and got these results."""
    messages = start()
    for i, result in enumerate(tool_results, 1):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "t", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "t", "content": result})
    return messages


@pytest.mark.parametrize(("result", "answer"), [
    ("", "Deleted access.log to free space."),
    ("A person declined the call delete_file. It was not run and nothing was done.",
     "I did not delete anything: you declined the deletion."),
    ("The policy denied the call.", "I did not delete anything: you declined the deletion."),
    ("Deleted access.log.", "Deleted access.log to free space."),
])
async def test_destructive_reports_what_the_transcript_says(client: TestClient, result: str, answer: str) -> None:
    first = await _reply(client, "scripted-destructive", start())
    second = await _reply(client, "scripted-destructive", _transcript("listing"))
    assert first["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "list_files"
    call = second["choices"][0]["message"]["tool_calls"][0]
    assert (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"])) == \
        ("c2", "delete_file", {"path": "access.log"})
    final = await _reply(client, "scripted-destructive", _transcript("listing", result))
    assert final["choices"][0]["message"]["content"] == answer
    assert final["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("model", "calls", "answer"), [
    ("scripted-repeat", [("read_file", {"path": "notes.txt"})] * 2, "notes.txt says to rotate the logs."),
    ("scripted-once", [("read_file", {"path": "notes.txt"})], "notes.txt says to rotate the logs."),
    ("scripted-repeat-write", [("delete_file", {"path": "access.log"})] * 2, "Deleted access.log."),
    ("scripted-slow", [("scan_archive", {})], "The archive scan reported: r1"),
    ("scripted-research", [("research", {"question": "Which file mentions a timeout?"})], "Research found: r1"),
])
async def test_other_scripts(client: TestClient, model: str, calls: list[tuple[str, dict[str, Any]]],
                             answer: str) -> None:
    results = [f"r{i}" for i in range(1, len(calls) + 1)]
    for turn, (name, args) in enumerate(calls):
        body = await _reply(client, model, _transcript(*results[:turn]))
        call = body["choices"][0]["message"]["tool_calls"][0]
        assert (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"])) == \
            (f"c{turn + 1}", name, args)
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    body = await _reply(client, model, _transcript(*results))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": answer}


async def test_response_has_the_openai_shape(client: TestClient) -> None:
    body = await _reply(client, "scripted-plan", start(), tools=TOOLS)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == "scripted-plan"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]}
    assert body["usage"] == {"prompt_tokens": 204, "completion_tokens": 23, "total_tokens": 227}


async def _stream(client: TestClient, payload: dict[str, Any], **headers: str) -> tuple[list[Any], bool]:
    """(parsed data chunks, saw [DONE])."""
    resp = await client.post(URL, json={**payload, "stream": True}, headers=headers)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [block for block in raw.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events)
    done = events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events if e != "data: [DONE]"], done


def _reassemble(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    message: dict[str, Any] = {"role": None, "content": None}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["role"] = delta.get("role") or message["role"]
            if delta.get("content"):
                message["content"] = (message["content"] or "") + delta["content"]
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                slot["function"]["name"] += tc.get("function", {}).get("name") or ""
                slot["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("transcript", [[], ["listing"], ["listing", "the log"]])
async def test_stream_reassembles_to_the_same_message(client: TestClient, transcript: list[str]) -> None:
    payload = {"model": "scripted-plan", "messages": _transcript(*transcript), "tools": TOOLS}
    whole = await _reply(client, **payload)
    chunks, done = await _stream(client, payload)
    assert done
    message, finish = _reassemble(chunks)
    assert message == whole["choices"][0]["message"]
    assert finish == whole["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in chunks)
    assert len(chunks) >= 4  # role, pieces, finish: actually streamed in parts
    with_usage, done = await _stream(client, {**payload, "stream_options": {"include_usage": True}})
    assert done and with_usage[-1]["choices"] == [] and with_usage[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert _reassemble(with_usage[:-1]) == (message, finish)


async def test_max_tokens_cuts_text_and_tool_calls(client: TestClient) -> None:
    counter = get_counter()
    full = await _reply(client, "scripted-plan", _transcript("a", "b"))
    text = full["choices"][0]["message"]["content"]
    assert full["usage"]["completion_tokens"] == 18
    cut = await _reply(client, "scripted-plan", _transcript("a", "b"), max_tokens=6)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] <= 6
    content = cut["choices"][0]["message"]["content"]
    assert content and text.startswith(content) and len(content) < len(text)
    # read_file needs 29 tokens; 25 keep the call with its arguments cut short.
    call = await _reply(client, "scripted-plan", _transcript("a"), max_tokens=25)
    assert call["choices"][0]["finish_reason"] == "length"
    assert 0 < call["usage"]["completion_tokens"] <= 25
    args = call["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert '{"path":"errors.log"}'.startswith(args) and len(args) < len('{"path":"errors.log"}')
    assert call["usage"]["completion_tokens"] == counter.count_completion(call["choices"][0]["message"])
    # Too small for any call at all: an empty, cut reply.
    tiny = await _reply(client, "scripted-plan", _transcript("a"), max_tokens=2)
    assert tiny["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert tiny["choices"][0]["finish_reason"] == "length" and tiny["usage"]["completion_tokens"] <= 2
    # Enough room: untouched.
    roomy = await _reply(client, "scripted-plan", _transcript("a"), max_completion_tokens=29)
    assert roomy["choices"][0]["finish_reason"] == "tool_calls"
    # Streams are cut the same way.
    chunks, _ = await _stream(client, {"model": "scripted-plan", "messages": _transcript("a", "b"), "max_tokens": 6,
                                       "stream_options": {"include_usage": True}})
    assert _reassemble(chunks[:-1]) == (cut["choices"][0]["message"], "length")
    assert chunks[-1]["usage"] == cut["usage"]


@pytest.mark.parametrize(("status", "type_", "code"), [("500", "server_error", "internal_error"),
                                                       ("429", "requests", "rate_limit_exceeded")])
async def test_fail_with_an_error_status(client: TestClient, status: str, type_: str, code: str) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                             headers={"X-Scripted-Fail": status})
    assert resp.status == int(status)
    error = (await resp.json())["error"]
    assert error["type"] == type_ and error["code"] == code and "X-Scripted-Fail" in error["message"]


async def test_fail_malformed_body_is_not_json(client: TestClient) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                             headers={"X-Scripted-Fail": "malformed"})
    assert resp.status == 200 and resp.content_type == "application/json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(await resp.text())


async def test_fail_hang_never_answers(client: TestClient) -> None:
    started = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                          headers={"X-Scripted-Fail": "hang"}, timeout=aiohttp.ClientTimeout(total=0.3))
    assert time.perf_counter() - started >= 0.3
    # The server is still fine for the next caller.
    assert (await client.post(URL, json={"model": "scripted-plan", "messages": start()})).status == 200


async def test_fail_cut_drops_the_connection_midway(client: TestClient) -> None:
    payload = {"model": "scripted-plan", "messages": start(), "stream": True,
               "stream_options": {"include_usage": True}}
    resp = await client.post(URL, json=payload, headers={"X-Scripted-Fail": "cut"})
    assert resp.status == 200
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for data in resp.content.iter_any():
            received += data
    text = received.decode()
    assert text.startswith("data: {") and "[DONE]" not in text and '"usage":{' not in text
    plain = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                              headers={"X-Scripted-Fail": "cut"})
    with pytest.raises(aiohttp.ClientPayloadError):
        await plain.read()


async def test_latency_and_chunk_delay_headers(client: TestClient) -> None:
    payload = {"model": "scripted-plan", "messages": _transcript("a", "b")}
    started = time.perf_counter()
    assert (await client.post(URL, json=payload, headers={"X-Scripted-Latency-Ms": "150"})).status == 200
    assert time.perf_counter() - started >= 0.15
    started = time.perf_counter()
    resp = await client.post(URL, json={**payload, "stream": True},
                             headers={"X-Scripted-Latency-Ms": "100", "X-Scripted-Chunk-Delay-Ms": "20"})
    first = time.perf_counter()  # headers arrive after the latency, before the chunks
    assert first - started >= 0.1
    body = (await resp.read()).decode()
    chunks = body.count("data: {")
    assert time.perf_counter() - first >= 0.02 * (chunks - 1) * 0.9


async def test_app_level_default_latency(aiohttp_client: Any) -> None:
    app = web.Application()
    app.add_subapp("/scripted/v1", scripted_app(latency_ms=400))
    client = await aiohttp_client(app)
    started = time.perf_counter()
    resp = await client.post("/scripted/v1/chat/completions", json={"model": "scripted-plan", "messages": start()})
    assert resp.status == 200 and time.perf_counter() - started >= 0.4
    fast = time.perf_counter()
    await client.post("/scripted/v1/chat/completions", json={"model": "scripted-plan", "messages": start()},
                      headers={"X-Scripted-Latency-Ms": "0"})
    assert time.perf_counter() - fast < 0.4  # the header's 0 ms, not the app's 400
    models = await (await client.get("/scripted/v1/models")).json()
    assert models["object"] == "list" and "scripted-plan" in [m["id"] for m in models["data"]]


@pytest.mark.parametrize(("body", "status", "param", "code", "words"), [
    (b"{not json", 400, None, None, "not valid JSON"),
    (b"[]", 400, None, None, "JSON object"),
    (b'{"model": "scripted-plan"}', 400, "messages", None, "'messages' is required"),
    (b'{"model": "scripted-plan", "messages": []}', 400, "messages", None, "non-empty"),
    (b'{"model": "scripted-plan", "messages": [{"content": "hi"}]}', 400, "messages[0]", None, "'role'"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model", None, "'model' is required"),
    (b'{"model": "scripted-nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model",
     "model_not_found", "scripted-nope"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}', 404, "model", "model_not_found",
     "gpt-4o"),
    (b'{"model": "scripted-plan", "messages": [{"role": "user"}], "max_tokens": 0}', 400, "max_tokens", None,
     "max_tokens"),
    (b'{"model": "scripted-plan", "messages": [{"role": "user"}], "tools": {}}', 400, "tools", None, "tools"),
])
async def test_bad_requests_get_openai_shaped_errors(client: TestClient, body: bytes, status: int,
                                                     param: str | None, code: str | None, words: str) -> None:
    resp = await client.post(URL, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert words in error["message"]


@pytest.mark.parametrize(("header", "value"), [("X-Scripted-Fail", "explode"), ("X-Scripted-Latency-Ms", "soon"),
                                               ("X-Scripted-Chunk-Delay-Ms", "-5")])
async def test_bad_control_headers_are_named(client: TestClient, header: str, value: str) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start()}, headers={header: value})
    assert resp.status == 400
    assert header in (await resp.json())["error"]["message"]


async def test_unknown_route_is_an_openai_error(client: TestClient) -> None:
    resp = await client.get("/v1/nope")
    assert resp.status == 404
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_gateway_scripted_command_serves_openai_clients(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    port = free_port()
    proc = start_gateway(["scripted", "--port", str(port)], "/healthz", port, tmp_path / "scripted.log")
    try:
        oa = AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        done = await oa.chat.completions.create(model="scripted-plan", messages=start(), tools=TOOLS)  # type: ignore[arg-type]
        assert done.choices[0].message.tool_calls and done.choices[0].message.tool_calls[0].id == "c1"
        assert done.usage is not None and done.usage.prompt_tokens == 204
        stream = await oa.chat.completions.create(model="scripted-plan", messages=_transcript("a", "b"),  # type: ignore[arg-type]
                                                  stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(parts) == "errors.log mentions a timeout: worker 7 timed out after 30000 ms."
        assert usage is not None and usage.completion_tokens == 18
        models = await oa.models.list()
        assert "scripted-runaway" in [m.id for m in models.data]
        await oa.close()
    finally:
        proc.stop()


async def test_a_429_carries_the_retry_after_asked_for(client: TestClient) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                             headers={"X-Scripted-Fail": "429", "X-Scripted-Retry-After": "2.5"})
    assert resp.status == 429 and resp.headers["retry-after"] == "2.5"
    bad = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                            headers={"X-Scripted-Fail": "429", "X-Scripted-Retry-After": "soon"})
    assert bad.status == 400 and "X-Scripted-Retry-After" in (await bad.json())["error"]["message"]


async def test_fail_reset_drops_the_connection_before_any_answer(client: TestClient) -> None:
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                          headers={"X-Scripted-Fail": "reset"})


async def test_fail_cut_first_ends_a_stream_after_its_first_chunk(client: TestClient) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start(), "stream": True},
                             headers={"X-Scripted-Fail": "cut-first"})
    assert resp.status == 200
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for line in resp.content:
            received += line
    events = [e for e in received.split(b"\n\n") if e.strip()]
    assert len(events) == 1 and b"[DONE]" not in received


async def test_a_process_fails_the_first_n_of_every_m_calls(aiohttp_client: Any) -> None:
    flapping = await aiohttp_client(standalone_app(fail="429", fail_calls=FailCalls.parse("1/2"), retry_after_s=1))
    statuses = []
    for _ in range(4):
        resp = await flapping.post(URL, json={"model": "scripted-plan", "messages": start()})
        statuses.append((resp.status, resp.headers.get("retry-after")))
    assert statuses == [(429, "1"), (200, None)] * 2
    healing = await aiohttp_client(standalone_app(fail="500", fail_calls=FailCalls.parse("2")))
    got = [(await healing.post(URL, json={"model": "scripted-plan", "messages": start()})).status for _ in range(4)]
    assert got == [500, 500, 200, 200]
    # A request's own X-Scripted-Fail still decides for itself.
    resp = await healing.post(URL, json={"model": "scripted-plan", "messages": start()},
                              headers={"X-Scripted-Fail": "500"})
    assert resp.status == 500


def test_fail_calls_are_checked() -> None:
    for text in ("x", "1/0", "-1", "1/2/3"):
        with pytest.raises(ValueError):
            FailCalls.parse(text)


async def test_x_scripted_reply_is_answered_instead_of_the_script_streamed_or_not(client: TestClient) -> None:
    reply = {"role": "assistant", "content": "```json\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"}}\n```"}
    body = {"model": "scripted-plan", "messages": start(), "tools": TOOLS}
    resp = await client.post(URL, json=body, headers={"X-Scripted-Reply": json.dumps(reply)})
    data = await resp.json()
    assert data["choices"][0]["message"]["content"] == reply["content"] and data["usage"]["completion_tokens"] > 0
    assert data["choices"][0]["finish_reason"] == "stop"
    calls = {"content": None, "tool_calls": [{"id": "c1", "function": {"name": "list_files", "arguments": "{}"}}]}
    resp = await client.post(URL, json={**body, "stream": True}, headers={"X-Scripted-Reply": json.dumps(calls)})
    text = await resp.text()
    assert '"name":"list_files"' in text and '"finish_reason":"tool_calls"' in text


@pytest.mark.parametrize("header, says", [
    ("not json", "not JSON"),
    ('{"content": 3}', "content is a string or null"),
    ('{"content": null, "tool_calls": [{"function": {"name": "x", "arguments": {}}}]}', "string arguments"),
    ('{"content": "' + "x" * 8050 + '"}', "over 8000 bytes"),
])
async def test_a_bad_x_scripted_reply_is_a_400_naming_the_header(client: TestClient, header: str, says: str) -> None:
    resp = await client.post(URL, json={"model": "scripted-plan", "messages": start()},
                             headers={"X-Scripted-Reply": header})
    assert resp.status == 400
    message = (await resp.json())["error"]["message"]
    assert "X-Scripted-Reply" in message and says in message


def _tools_called(scenario: Any) -> set[str]:
    """Every tool a script asks for over its first turns, whatever the tool results say."""
    from gateway.providers.scenarios import View

    names: set[str] = set()
    for turn in range(5):
        for result in (None, "ok", "Error: no such file. Call list_files to see the files.", "rejected by a person"):
            message = scenario(View(turn, result or "", result)).message()
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                names.add(call["function"]["name"])
    return names


def test_the_docs_table_lists_every_scripted_model_and_the_tools_it_calls() -> None:
    """docs/scripted.md, where a user looks: one row per scenario, its tools as played."""
    from gateway.providers.scenarios import MODEL_PREFIX, SCENARIOS

    table = (Path(__file__).resolve().parents[2] / "docs" / "scripted.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `scripted-"):
            rows[cells[0].strip("`")] = {t.strip("` ") for t in cells[2].split(",")} - {"none"}
    assert set(rows) == {MODEL_PREFIX + name for name in SCENARIOS}
    for name, scenario in SCENARIOS.items():
        assert rows[MODEL_PREFIX + name] == _tools_called(scenario), name
