"""Executors over real things: python functions (sync and async), a real HTTP tool server,
sub-runs; timeouts, cancellation mid-call and invalid arguments are tool errors or stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.harness.execute import CancelScope
from gateway.harness.loop import run
from gateway.harness.model import ModelRequest
from gateway.harness.state import Message
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from tests.policy.conftest import Events, FnModel, WriteFile, answer, new_state, tool_call, tool_messages, turns
from tests.support.upstreams import never_answering

TOOLS = """
name: py
tools:
  - name: echo_sync
    description: Echo, synchronously.
    parameters: {type: object, properties: {text: {type: string}}, required: [text], additionalProperties: false}
    executor: {python: "tests.policy.sample_tools:echo_sync"}
  - name: echo_async
    description: Echo, asynchronously.
    parameters: {type: object, properties: {text: {type: string}}, required: [text]}
    executor: {python: "tests.policy.sample_tools:echo_async"}
  - name: hang
    description: Never answers.
    timeout_s: 0.2
    executor: {python: "tests.policy.sample_tools:hang"}
  - name: slow
    description: Works until stopped.
    executor: {python: "tests.policy.sample_tools:wait_for_stop"}
  - name: slow_sync
    description: Works until stopped, in a thread.
    executor: {python: "tests.policy.sample_tools:sync_wait_for_stop"}
"""

Script = Callable[[ModelRequest], Message]
TOOLS_WORK_S = 10.0
"""How long `slow` and `slow_sync` work unless stopped (tests/policy/sample_tools.py)."""


def scripted(*steps: Message) -> Script:
    """Turn i answers steps[i]; after the last step, a final answer."""
    return lambda req: steps[turns(req)] if turns(req) < len(steps) else answer("done")


@pytest.fixture
def registry(policy_dir: Path, write: WriteFile) -> PolicyRegistry:
    write("py.yaml", TOOLS)
    reg = PolicyRegistry(policy_dir)
    reg.load()
    return reg


async def run_policy(registry: PolicyRegistry, name: str, script: Script, **env: Any) -> tuple[Any, Events]:
    events = Events()
    policy = registry.get(name)
    assert policy is not None
    options = compile_options(policy, ToolEnv(registry=registry, on_event=events, **env))
    out = await run(new_state(), FnModel(script), options)
    return out, events


async def test_python_sync_runs_in_a_thread_and_async_is_awaited(registry: PolicyRegistry) -> None:
    out, events = await run_policy(registry, "py", scripted(
        tool_call("c1", "echo_sync", {"text": "hi"}), tool_call("c2", "echo_async", {"text": "yo"})))
    state = out.state
    assert state.status == "completed"
    assert tool_messages(state) == [
        f"echo hi main_thread=False key={state.run_id}:c1",
        f"async yo run={state.run_id} call=c2",
    ]
    assert [e["label"] for e in events.of("tool_progress")] == ["echoing"]


async def test_invalid_arguments_are_tool_errors_the_model_reads(registry: PolicyRegistry) -> None:
    out, events = await run_policy(registry, "py", scripted(
        tool_call("c1", "echo_sync", "{not json"),
        tool_call("c2", "echo_sync", {"text": 3}),
        tool_call("c3", "echo_sync", {}),
        tool_call("c4", "echo_sync", {"text": "a", "extra": 1}),
        tool_call("c5", "echo_sync", {"text": "ok"}),
    ))
    state = out.state
    assert state.status == "completed" and state.turns == 6
    msgs = tool_messages(state)
    assert msgs[0].startswith("Error: the arguments of echo_sync are not a valid JSON object")
    assert msgs[1] == ("Error: invalid arguments for echo_sync (argument 'text'): 3 is not of type 'string'. "
                       "Call it again with arguments matching its parameters.")
    assert msgs[2].startswith("Error: invalid arguments for echo_sync: 'text' is a required property")
    assert "Additional properties are not allowed ('extra' was unexpected)" in msgs[3]
    assert msgs[4].startswith("echo ok")  # the model recovered; only this call ran
    # the bad JSON never reached a tool; the schema mismatches were refused before the function ran
    assert [e["ok"] for e in events.of("tool_result")] == [False, False, False, True]
    assert sum(m.startswith("echo") for m in msgs) == 1


async def test_a_hanging_tool_times_out_as_a_tool_error(registry: PolicyRegistry) -> None:
    started = time.perf_counter()
    out, _ = await run_policy(registry, "py", scripted(tool_call("c1", "hang", {})))
    elapsed = time.perf_counter() - started
    assert out.state.status == "completed"
    assert tool_messages(out.state) == ["Error: hang timed out after 0.2 s"]
    assert elapsed >= 0.2  # it waited out its timeout; that it came back at all shows the hang was cut


@pytest.mark.parametrize("tool", ["slow", "slow_sync"])
async def test_a_tool_cancelled_mid_run_sees_the_stop_and_the_run_ends(registry: PolicyRegistry, tool: str) -> None:
    events = Events()
    policy = registry.get("py")
    assert policy is not None
    options = compile_options(policy, ToolEnv(registry=registry, on_event=events))
    scope = CancelScope()
    task = asyncio.create_task(run(new_state(), FnModel(scripted(tool_call("c1", tool, {}))), options, scope))
    await events.wait(lambda e: e["type"] == "tool_progress")
    stopped_at = time.perf_counter()
    scope.cancel("user pressed Stop")
    out = await task
    returned = time.perf_counter() - stopped_at
    stopping = await events.wait(lambda e: e.get("label") == "stopping", timeout=TOOLS_WORK_S)  # the tool saw it
    assert out.state.status == "interrupted" and out.state.interruption is not None
    assert out.state.interruption.reason == "user pressed Stop"
    # Both tools would work 10 s; how soon the run and the tool stop is benchmarks/stop_latency.py's figure.
    assert returned < TOOLS_WORK_S / 2 and stopping["at"] - stopped_at < TOOLS_WORK_S / 2


# --- http executor over a real server -------------------------------------------------------

@pytest.fixture
async def tool_server(aiohttp_server: Callable[..., Any]) -> AsyncIterator[tuple[TestServer, list[Any]]]:
    seen: list[Any] = []
    release = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((dict(request.headers), body))
        return web.Response(text=f"remote says {body['arguments']['text']}")

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom: the database is down " + "x" * 400)

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/fail", fail)
    app.router.add_post("/hang", never_answering(seen, release))
    server = await aiohttp_server(app)
    yield server, seen
    release.set()


def http_policy(server: TestServer, closed_port: int) -> str:
    base = f"http://127.0.0.1:{server.port}"
    return f"""
name: web
tools:
  - name: remote
    description: Echo remotely.
    parameters: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
    executor: {{http: {{url: "{base}/echo", headers: {{X-Token: secret}}}}}}
  - name: broken
    description: Always fails.
    executor: {{http: "{base}/fail"}}
  - name: stuck
    description: Never answers in time.
    executor: {{http: {{url: "{base}/hang", timeout_s: 0.2}}}}
  - name: stuck_long
    description: Never answers.
    executor: {{http: {{url: "{base}/hang"}}}}
  - name: gone
    description: Nobody listens.
    executor: {{http: "http://127.0.0.1:{closed_port}/x"}}
"""


async def test_http_tools_post_the_call_and_return_the_body(
    tool_server: tuple[TestServer, list[Any]], policy_dir: Path, write: WriteFile
) -> None:
    from tests.support.procs import free_port

    server, seen = tool_server
    write("web.yaml", http_policy(server, free_port()))
    reg = PolicyRegistry(policy_dir)
    reg.load()
    async with aiohttp.ClientSession() as session:
        out, _ = await run_policy(reg, "web", scripted(
            tool_call("c1", "remote", {"text": "hello"}),
            tool_call("c2", "broken", {}),
            tool_call("c3", "stuck", {}),
            tool_call("c4", "gone", {}),
            tool_call("c5", "remote", {"text": 42}),
        ), session=session)
    state = out.state
    msgs = tool_messages(state)
    assert state.status == "completed"
    assert msgs[0] == "remote says hello"
    headers, body = seen[0]
    assert body == {"tool": "remote", "arguments": {"text": "hello"}, "run_id": state.run_id, "call_id": "c1",
                    "idempotency_key": f"{state.run_id}:c1"}
    assert headers["X-Token"] == "secret" and headers["Idempotency-Key"] == f"{state.run_id}:c1"
    assert msgs[1].startswith("Error: the broken server answered HTTP 500: boom: the database is down")
    assert msgs[1].endswith("...") and len(msgs[1]) < 400
    assert msgs[2] == "Error: stuck did not answer within 0.2 s"
    assert msgs[3].startswith("Error: cannot reach the gone server at http://127.0.0.1:")
    assert "is not of type 'string'" in msgs[4]
    assert len([s for s in seen if isinstance(s, tuple)]) == 1  # the invalid call never reached the server


async def test_an_http_call_is_cancelled_by_the_stop(
    tool_server: tuple[TestServer, list[Any]], policy_dir: Path, write: WriteFile
) -> None:
    server, seen = tool_server
    write("web.yaml", http_policy(server, 9))
    reg = PolicyRegistry(policy_dir)
    reg.load()
    policy = reg.get("web")
    assert policy is not None
    events = Events()
    scope = CancelScope()
    async with aiohttp.ClientSession() as session:
        options = compile_options(policy, ToolEnv(session=session, on_event=events))
        task = asyncio.create_task(run(new_state(), FnModel(scripted(tool_call("c1", "stuck_long", {}))),
                                       options, scope))
        await events.wait(lambda e: e["type"] == "tool_start")
        while "hang started" not in seen:  # the request reached the server
            await asyncio.sleep(0.005)
        stopped_at = time.perf_counter()
        scope.cancel("user pressed Stop")
        out = await task
    assert time.perf_counter() - stopped_at < TOOLS_WORK_S / 2  # the server never answers; the Stop ended the call
    assert out.state.status == "interrupted" and out.state.reason == "cancelled"
