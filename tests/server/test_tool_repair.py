"""Tool-call repair and guarded calls of a `local` upstream, through a real gateway process.

A real HTTP upstream served by this test plays back replies recorded from the real local
model (tests/fixtures/local_replies): llama.cpp's 500 when it cannot parse a tool call,
then, asked again without tool parsing, the call written as JSON in the content. The
gateway in front has one upstream of kind `local` (repair on, `max_tokens: 64`) and the
same server again as kind `openai` (nothing repaired), so each test shows both sides.
One gateway and one upstream serve the module's tests (on the module's event loop); each test
sees only the upstream calls and metric increments made while it ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.tools.catalog import FILE_TOOLS, SYSTEM_PROMPT
from tests.server.test_admission import serving, write_policies
from tests.support.procs import Proc, free_port, serving_config

KEY = "sk-repair"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "local_replies"
CAP = 64
TOOLS = [t.openai() for t in FILE_TOOLS]
pytestmark = pytest.mark.asyncio(loop_scope="module")
TASK = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Read notes.txt and tell me what it says."}]
ANSWER = {"id": "chatcmpl-a", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "notes.txt is the team's runbook."}}],
          "usage": {"prompt_tokens": 300, "completion_tokens": 9, "total_tokens": 309}}


def recorded(name: str) -> Any:
    return orjson.loads((FIXTURES / name).read_bytes())


@dataclass
class LlamaLike:
    """Answers like the recorded llama.cpp: a 500 for a tool call it cannot parse, the call as text
    when asked with `tool_choice: "none"`, and a plain answer once a tool result is in the prompt."""

    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body.get("stream"):  # as llama.cpp streams a call it cannot parse: the text, then its error event
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write((FIXTURES / "gemma_stream_parse_error.sse").read_bytes())
            await resp.write_eof()
            return resp
        if any(m.get("role") == "tool" for m in body["messages"]):
            return web.json_response(ANSWER)
        if body.get("tool_choice") != "none":
            error = recorded("tool_parse_500.json")
            return web.json_response(error["reply"], status=error["status"])
        reply = recorded("call_in_content.json")["reply"]
        reply["usage"] = {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 320}
        return web.json_response(reply)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream() -> AsyncIterator[tuple[LlamaLike, str]]:
    state = LlamaLike()
    async with serving(state.handle) as url:
        yield state, url


@pytest.fixture
def llama(upstream: tuple[LlamaLike, str]) -> tuple[LlamaLike, str]:
    """The module's upstream, its calls forgotten: the test sees only its own."""
    upstream[0].bodies.clear()
    return upstream


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstream: tuple[LlamaLike, str]) -> Iterator[Proc]:
    tmp_path = tmp_path_factory.mktemp("repair")
    llama = upstream
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": str(write_policies(tmp_path)),
        "upstreams": [{"name": "small", "kind": "local", "base_url": llama[1], "max_tokens": CAP},
                      {"name": "plain", "base_url": llama[1]}],
        "models": [{"match": "plain-*", "upstream": "plain", "price_in": 1.0, "price_out": 1.0},
                   {"match": "*", "upstream": "small", "price_in": 1.0, "price_out": 1.0}],
        "teams": [{"name": "t", "keys": [KEY], "budget_usd": None, "policies": ["passthrough", "files"]}],
    }
    with serving_config(tmp_path, config) as proc:
        yield proc


async def post(session: aiohttp.ClientSession, gw: Proc, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with session.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {KEY}", **headers}) as resp:
        return resp.status, orjson.loads(await resp.read())


async def events(session: aiohttp.ClientSession, gw: Proc, run_id: str) -> list[dict[str, Any]]:
    async with session.get(f"{gw.url}/v1/runs/{run_id}/events", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return [orjson.loads(line) for line in (await resp.read()).splitlines() if line.strip()]


async def repairs(session: aiohttp.ClientSession, gw: Proc) -> dict[str, float]:
    """gateway_tool_call_repairs_total by its labels (`{kind="...",upstream="..."}`)."""
    async with session.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    prefix = "gateway_tool_call_repairs_total"
    return {line[len(prefix):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix + "{")}


async def test_a_pass_through_call_gets_the_repaired_call_not_the_500(gateway: Proc,
                                                                      llama: tuple[LlamaLike, str]) -> None:
    upstream, _ = llama
    async with aiohttp.ClientSession() as session:
        before = await repairs(session, gateway)
        status, reply = await post(session, gateway, {"model": "qwen", "messages": TASK, "tools": TOOLS,
                                                      "max_tokens": 4000}, **{"X-Run-Id": "pt-1"})
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == [("read_file", {"path": "notes.txt"})]
        # the first ask was capped and parsed; the one retry asked for no parsing, capped too
        assert [(b.get("tool_choice"), b["max_tokens"]) for b in upstream.bodies] == [(None, CAP), ("none", CAP)]
        traced = [e for e in await events(session, gateway, "pt-1") if e["type"] == "tool_call_repaired"]
        assert [(e["repair"], e["tool"], e["upstream"]) for e in traced] == [
            ("retried_without_tool_parsing", "", "small"), ("call_from_text", "read_file", "small")]
        assert "peg-native format" in traced[0]["detail"]
        after = await repairs(session, gateway)
        grown = {labels: after[labels] - before.get(labels, 0.0) for labels in after}
        assert grown['{kind="call_from_text",upstream="small"}'] == 1.0
        assert grown['{kind="retried_without_tool_parsing",upstream="small"}'] == 1.0
        assert grown['{kind="call_from_text",upstream="plain"}'] == 0.0  # the series exists, unmoved


async def test_with_repair_off_the_500_reaches_the_client_and_max_tokens_is_not_capped(
        gateway: Proc, llama: tuple[LlamaLike, str]) -> None:
    upstream, _ = llama
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, gateway, {"model": "plain-qwen", "messages": TASK, "tools": TOOLS,
                                                      "max_tokens": 4000})
    assert status == 502
    assert reply["error"]["code"] == "upstream_status" and "answered 500" in reply["error"]["message"]
    assert [(b.get("tool_choice"), b["max_tokens"]) for b in upstream.bodies] == [(None, 4000)]


async def test_a_server_side_run_runs_the_repaired_call(gateway: Proc, llama: tuple[LlamaLike, str]) -> None:
    upstream, _ = llama
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, gateway, {"model": "qwen", "messages": TASK},
                                   **{"X-Policy": "files", "X-Run-Id": "ss-1"})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == "notes.txt is the team's runbook."
        trace = await events(session, gateway, "ss-1")
    kinds = [e["type"] for e in trace]
    assert kinds.count("tool_call_repaired") == 2
    started = [e for e in trace if e["type"] == "tool_start"]
    assert [(e["toolName"], orjson.loads(e["args"])) for e in started] == [("read_file", {"path": "notes.txt"})]
    assert kinds.index("tool_call_repaired") < kinds.index("turn") < kinds.index("tool_start")
    assert all(b["max_tokens"] <= CAP for b in upstream.bodies)


async def test_a_stream_ending_in_the_parse_error_reaches_the_client_whole_without_it(
        gateway: Proc, llama: tuple[LlamaLike, str]) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0,
                                default_headers={"X-Run-Id": "stream-500"})
    chunks = [c async for c in await client.chat.completions.create(
        model="qwen", messages=TASK, tools=TOOLS, stream=True)]  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    recorded_text = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                            for e in (FIXTURES / "gemma_stream_parse_error.sse").read_bytes().split(b"\n\n")
                            if e.startswith(b"data: {\"choices\""))
    assert text == recorded_text and "XML tags" in text  # what the model wrote, whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    async with aiohttp.ClientSession() as session:
        traced = [e for e in await events(session, gateway, "stream-500") if e["type"] == "tool_call_repaired"]
    assert [e["repair"] for e in traced] == ["parse_error_dropped"] and "peg-native" in traced[0]["detail"]
    with pytest.raises(openai.APIError, match="peg-native format"):  # without repair, llama.cpp's error arrives
        async for _ in await client.chat.completions.create(model="plain-qwen", messages=TASK, tools=TOOLS,  # type: ignore[arg-type]
                                                            stream=True):
            pass
