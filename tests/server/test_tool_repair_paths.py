"""Tool-call repair on every path a reply takes, through real processes and real clients.

One real gateway (module-scoped) routes `small-*` to its own scripted mount with
`tool_repair: true`, and `scripted-*` to the same mount without it. The scripted provider
replays a reply recorded from the real local model (`X-Scripted-Reply`), so each test sees
what the small model really wrote, repaired or not:
- a streamed pass-through chat call (the openai SDK assembling the stream);
- the Responses API, streamed and not;
- the demo's `HTTPChatModel` (against a `gateway scripted` process) under the harness loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gateway.harness.loop import run
from gateway.harness.model import ModelRequest
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, RunState
from gateway.harness.trace import EventList
from gateway.providers.http_model import HTTPChatModel
from gateway.tools.catalog import FILE_TOOLS, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, file_tools, fresh_sandbox
from tests.server.conftest import KEY, config_data, write_config
from tests.support.procs import Proc, free_port, start_gateway, start_scripted

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "local_replies"
TOOLS = [t.openai() for t in FILE_TOOLS]
RESPONSES_TOOLS: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
TASK = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Read notes.txt and tell me what it says."}]


def replayed(name: str) -> str:
    """The recorded reply's message as the X-Scripted-Reply header (ASCII JSON)."""
    message = orjson.loads((FIXTURES / name).read_bytes())["reply"]["choices"][0]["message"]
    return json.dumps(message)


CALL_IN_CONTENT = replayed("call_in_content.json")
SCHEMA_IN_ARGUMENTS = replayed("schema_required_in_arguments.json")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder = tmp_path_factory.mktemp("repair-paths")
    port = free_port()
    data = config_data(
        server={"port": port},
        upstreams=[{"name": "small", "kind": "scripted", "tool_repair": True},
                   {"name": "scripted", "kind": "scripted"}],
        models=[{"match": "small-*", "deployments": [{"upstream": "small", "model": "scripted-once"}],
                 "price_in": 2.0, "price_out": 12.0},
                {"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}])
    path = write_config(folder, data)
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log")
    yield proc
    proc.stop()


def sdk(proc: Proc, reply: str, run_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0,
                              default_headers={"X-Scripted-Reply": reply, "X-Run-Id": run_id})


async def trace(proc: Proc, run_id: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(
            f"{proc.url}/v1/runs/{run_id}/events", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return [orjson.loads(line) for line in (await resp.read()).splitlines() if line.strip()]


async def run_of(proc: Proc, run_id: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(
            f"{proc.url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return orjson.loads(await resp.read())


async def repairs_metric(proc: Proc, kind: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{proc.url}/metrics") as resp:
        text = await resp.text()
    line = f'gateway_tool_call_repairs_total{{kind="{kind}",upstream="small"}} '
    return sum(float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line))


async def test_a_streamed_chat_call_gets_the_repaired_tool_call_in_the_stream(gateway: Proc) -> None:
    before = await repairs_metric(gateway, "call_from_text")
    stream = await sdk(gateway, CALL_IN_CONTENT, "stream-1").chat.completions.create(
        model="small-local", messages=TASK, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or "" if part.function else ""
                call["arguments"] += part.function.arguments or "" if part.function else ""
            finish = choice.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("read_file", {"path": "notes.txt"})]
    traced = await trace(gateway, "stream-1")
    assert [(e["repair"], e["tool"], e["upstream"]) for e in traced if e["type"] == "tool_call_repaired"] == [
        ("call_from_text", "read_file", "small")]
    assert next(e for e in traced if e["type"] == "turn")["finish"] == "tool_calls"
    booked = (await run_of(gateway, "stream-1"))["transcript"][-1]  # booked as the client saw it
    assert booked["content"] is None and booked["tool_calls"][0]["function"]["name"] == "read_file"
    assert await repairs_metric(gateway, "call_from_text") == before + 1


async def test_without_tool_repair_the_stream_passes_the_json_text_on(gateway: Proc) -> None:
    stream = await sdk(gateway, CALL_IN_CONTENT, "stream-plain").chat.completions.create(
        model="scripted-once", messages=TASK, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(content)["name"] == "read_file"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert not [e for e in await trace(gateway, "stream-plain") if e["type"] == "tool_call_repaired"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_call_gets_the_repaired_function_call(gateway: Proc, stream: bool) -> None:
    run_id = f"responses-{stream}"
    client = sdk(gateway, SCHEMA_IN_ARGUMENTS, run_id)
    kwargs: dict[str, Any] = {"model": "small-local", "instructions": SYSTEM_PROMPT, "tools": RESPONSES_TOOLS,
                              "input": "Which file mentions a timeout?"}
    if stream:
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(deltas) == {"path": "C:\\path\\to\\log.txt"}
        response = events[-1].response
    else:
        response = await client.responses.create(**kwargs)
    calls = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
    assert calls == [("read_file", {"path": "C:\\path\\to\\log.txt"})]  # the schema's "required" dropped
    traced = [e for e in await trace(gateway, run_id) if e["type"] == "tool_call_repaired"]
    assert [(e["repair"], e["tool"]) for e in traced] == [("undeclared_keys_dropped", "read_file")]
    assert "required" in traced[0]["detail"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_scripted(tmp_path_factory.mktemp("scripted"))
    yield proc
    proc.stop()


async def test_the_demos_http_model_repairs_and_the_loop_traces_it(scripted: Proc, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        headers = {"X-Scripted-Reply": CALL_IN_CONTENT}
        plain = HTTPChatModel(session, scripted.url + "/v1", headers=headers)
        request = ModelRequest("scripted-once", list(TASK), TOOLS)  # type: ignore[arg-type]
        unrepaired = await plain.complete(request)
        assert "tool_calls" not in unrepaired.message and unrepaired.repairs == ()
        model = HTTPChatModel(session, scripted.url + "/v1", headers=headers, tool_repair=True)
        reply = await model.complete(request)
        assert reply.finish_reason == "tool_calls" and reply.message["content"] is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in reply.message["tool_calls"]] == [("read_file", {"path": "notes.txt"})]
        assert [(r["repair"], r["tool"]) for r in reply.repairs] == [("call_from_text", "read_file")]
        # the same model under the harness loop: the repaired call runs, and the loop traces the repair
        box = Sandbox(fresh_sandbox(tmp_path / "sandbox"))
        events = EventList()
        state = RunState.new("scripted-once", list(TASK), limits=Limits(max_turns=2))  # type: ignore[arg-type]
        await run(state, model, RunOptions(tools=file_tools(box), on_event=events))
    kinds = [e["type"] for e in events.events]
    assert kinds.index("tool_call_repaired") < kinds.index("tool_start")
    started = events.of("tool_start")[0]
    assert (started["toolName"], json.loads(started["args"])) == ("read_file", {"path": "notes.txt"})
