"""Server-side runs through POST /v1/chat/completions of a real gateway process.

One client call runs the whole loop; every exit is stated honestly; streaming sends
progress comments then standard chunks; a client that goes away cancels the run (which
stays resumable); a client-supplied tool comes back as tool_calls and the follow-up call
continues the same run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.served import (
    DEMO,
    PLAN_ANSWER,
    POOR,
    TASK,
    Served,
    auth,
    chat_body,
    events,
    get_run,
    poll,
    request,
    wait_event,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("harness") / "gw")
    yield gateway
    gateway.proc.stop()


async def test_plan_completes_server_side_in_one_call(served: Served, session: aiohttp.ClientSession) -> None:
    client = served.openai(**{"X-Policy": "files"})
    raw = await client.chat.completions.with_raw_response.create(model="scripted-plan", messages=TASK)  # type: ignore[arg-type]
    completion = raw.parse()
    assert completion.choices[0].message.content == PLAN_ANSWER
    assert completion.choices[0].finish_reason == "stop"
    run_id = raw.headers["X-Run-Id"]
    assert raw.headers["X-Run-Status"] == "completed"
    assert raw.headers["X-Run-Turns"] == "3"
    assert float(raw.headers["X-Run-Cost-Usd"]) > 0
    assert float(raw.headers["X-Run-Budget-Remaining-Usd"]) == pytest.approx(0.5 - float(raw.headers["X-Run-Cost-Usd"]))
    assert "X-Team-Budget-Remaining-Usd" in raw.headers
    run = (completion.model_extra or {})["run"]
    assert run["id"] == run_id and run["status"] == "completed" and run["turns"] == 3
    assert completion.usage is not None and completion.usage.prompt_tokens == run["usage"]["prompt_tokens"]

    stored = await get_run(session, served.url, run_id)
    tools = [m for m in stored["transcript"] if m["role"] == "tool"]
    assert [m["name"] for m in tools] == ["list_files", "read_file"]
    assert "timed out" in tools[1]["content"]  # the real file of the run's sandbox was read
    trace = await events(session, served.url, run_id)
    assert all(e["runId"] == run_id for e in trace)
    assert [e["toolName"] for e in trace if e["type"] == "tool_start"] == ["list_files", "read_file"]
    assert [e["turn"] for e in trace if e["type"] == "turn"] == [1, 2, 3]

    async with session.get(f"{served.url}/metrics") as resp:
        metrics = await resp.text()
    assert 'gateway_tool_calls_total{outcome="ok",policy="files",tool="read_file"}' in metrics
    assert 'gateway_runs_stopped_total{policy="files",reason="completed",status="completed",team="demo"}' in metrics


async def test_every_other_exit_is_one_honest_sentence(served: Served) -> None:
    client = served.openai(**{"X-Policy": "files"})
    raw = await client.chat.completions.with_raw_response.create(model="scripted-destructive", messages=TASK)  # type: ignore[arg-type]
    completion = raw.parse()
    assert completion.choices[0].message.content == (
        'The run is waiting for a person to approve delete_file({"path": "access.log"}).')
    assert raw.headers["X-Run-Status"] == "interrupted"
    assert raw.headers["X-Run-Turns"] == "2"
    run = (completion.model_extra or {})["run"]
    assert run["interruption"] == {"type": "approval", "call_id": "c2", "tool_name": "delete_file",
                                   "args": {"path": "access.log"}, "waiting_for": "decision"}
    assert (served.sandbox(run["id"]) / "access.log").exists()

    # runaway asks for list_files every turn: the policy's repeated_call stop ends it
    raw = await client.chat.completions.with_raw_response.create(model="scripted-runaway", messages=TASK)  # type: ignore[arg-type]
    assert raw.headers["X-Run-Status"] == "failed" and raw.headers["X-Run-Turns"] == "3"
    assert raw.parse().choices[0].message.content == (
        "The run failed: the model asked for list_files({}) 3 times in a row.")


async def test_a_team_budget_that_cannot_pay_a_turn_stops_the_run_in_words(served: Served,
                                                                          session: aiohttp.ClientSession) -> None:
    client = served.openai(POOR, **{"X-Policy": "files"})
    raw = await client.chat.completions.with_raw_response.create(model="scripted-plan", messages=TASK)  # type: ignore[arg-type]
    assert raw.parse().choices[0].message.content == "The run stopped: its team's budget cannot pay for another turn."
    assert raw.headers["X-Run-Status"] == "budget_exceeded" and raw.headers["X-Run-Turns"] == "0"
    assert float(raw.headers["X-Team-Budget-Remaining-Usd"]) == pytest.approx(0.001)  # nothing was spent
    run = await get_run(session, served.url, raw.headers["X-Run-Id"], key=POOR)
    assert run["reason"] == "team_budget" and "team 'poor'" in run["error"]


async def test_streaming_sends_progress_comments_then_chunks(served: Served, session: aiohttp.ClientSession) -> None:
    body = chat_body("scripted-plan", stream=True)
    async with session.post(f"{served.url}/v1/chat/completions", data=orjson.dumps(body),
                            headers=auth(DEMO, **{"X-Policy": "files"})) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        run_id = resp.headers["X-Run-Id"]
        lines = [line.decode().rstrip("\n") async for line in resp.content if line.strip()]
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data: ")]
    assert lines.index(data[0]) > lines.index(comments[-1])  # progress first, then the answer
    for expected in (": turn 1", ": tool_start list_files", ": tool_start read_file", ": turn 3"):
        assert expected in comments
    assert data[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == PLAN_ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["run"]["id"] == run_id and chunks[-1]["run"]["status"] == "completed"

    client = served.openai(**{"X-Policy": "files"})
    stream = await client.chat.completions.create(model="scripted-plan", messages=TASK, stream=True,  # type: ignore[arg-type]
                                                  stream_options={"include_usage": True})
    got = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == PLAN_ANSWER
    assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "stop"
    assert got[-1].usage is not None and got[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_interrupts_the_run_and_it_can_resume(
        served: Served, session: aiohttp.ClientSession, stream: bool) -> None:
    run_id = f"disconnect-{stream}"

    async def call() -> None:
        async with aiohttp.ClientSession() as own:
            async with own.post(f"{served.url}/v1/chat/completions",
                                data=orjson.dumps(chat_body("scripted-slow", stream=stream)),
                                headers=auth(DEMO, **{"X-Policy": "files", "X-Run-Id": run_id})) as resp:
                await resp.read()

    task = asyncio.ensure_future(call())
    await wait_event(session, served.url, run_id, "tool_progress")
    task.cancel()  # closes the connection mid-run
    with pytest.raises(asyncio.CancelledError):
        await task

    async def interrupted() -> dict[str, Any] | None:
        run = await get_run(session, served.url, run_id)
        return run if run["status"] != "running" else None

    run = await poll(interrupted)
    assert run["status"] == "interrupted" and run["reason"] == "cancelled"
    assert run["interruption"] == {"type": "cancelled", "reason": "client disconnected", "waiting_for": "resume"}
    trace = await events(session, served.url, run_id)
    asked = next(e for e in trace if e["type"] == "cancel_requested")
    stopped = next(e for e in trace if e["type"] == "run_stopped")
    assert asked["reason"] == "client disconnected"
    result = next(e for e in trace if e["type"] == "tool_result")
    # The scan stopped mid-work, not after its 3 s: its line says cancelled.
    assert result["outcome"] == "cancelled" and result["ms"] < 3000 and stopped["ts"] >= asked["ts"]

    status, headers, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200, body
    assert body["run"]["status"] == "completed" and headers["X-Run-Status"] == "completed"
    assert body["choices"][0]["message"]["content"].startswith("The archive scan reported: Scanned 1200")


async def test_a_client_tool_comes_back_as_tool_calls_and_the_follow_up_continues(
        served: Served, session: aiohttp.ClientSession) -> None:
    read_file = {"type": "function", "function": {
        "name": "read_file", "description": "Read a file on the client's machine.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    client = served.openai(**{"X-Policy": "hybrid"})
    raw = await client.chat.completions.with_raw_response.create(model="scripted-plan", messages=TASK,  # type: ignore[arg-type]
                                                                 tools=[read_file])  # type: ignore[list-item]
    first = raw.parse()
    run_id = raw.headers["X-Run-Id"]
    assert raw.headers["X-Run-Status"] == "running" and raw.headers["X-Run-Turns"] == "2"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, orjson.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("c2", "read_file", {"path": "errors.log"})]
    trace = await events(session, served.url, run_id)
    assert [e["toolName"] for e in trace if e["type"] == "tool_start"] == ["list_files"]  # ran server-side

    client_result = "12:00:03 worker 7 timed out after 30000 ms (read on the client)"
    follow_up = [*TASK, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "c2", "content": client_result}]
    raw = await client.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
        model="scripted-plan", messages=follow_up, tools=[read_file], extra_headers={"X-Run-Id": run_id})
    final = raw.parse()
    assert raw.headers["X-Run-Id"] == run_id
    assert final.choices[0].message.content == PLAN_ANSWER
    assert raw.headers["X-Run-Status"] == "completed" and raw.headers["X-Run-Turns"] == "3"
    stored = await get_run(session, served.url, run_id)
    tool_messages = [m for m in stored["transcript"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages][-1] == ("c2", client_result)
    assert len(tool_messages) == 2  # list_files (server) and read_file (client), each once


async def test_client_tool_named_like_a_policy_tool_is_refused(served: Served) -> None:
    client = served.openai(**{"X-Policy": "files"})
    tool = {"type": "function", "function": {"name": "delete_file", "parameters": {"type": "object"}}}
    with pytest.raises(Exception) as info:
        await client.chat.completions.create(model="scripted-plan", messages=TASK, tools=[tool])  # type: ignore[arg-type, list-item]
    assert getattr(info.value, "status_code", None) == 400
    assert "delete_file" in str(info.value) and "tools[0]" in str(info.value)

