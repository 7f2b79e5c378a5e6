"""Cancellation reaches into running tools and model calls; sub-runs share their parent's Stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest

from gateway.harness.execute import CancelScope
from gateway.harness.loop import run
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, RunState
from gateway.harness.subrun import child_limits, run_subrun
from gateway.harness.tools import Tool, ToolContext, ToolResult, ToolSpec
from gateway.trace_view import timeline
from tests.harness.fakes import Recorder, ScriptModel, call, text


TOOL_WORKS_S = 10.0
"""How long the slow tools work unless stopped."""


def new_state() -> RunState:
    return RunState.new("fake", [{"role": "user", "content": "scan"}], limits=Limits(max_turns=10, max_budget_usd=1.0))


async def test_stop_during_a_slow_tool_ends_the_run_without_waiting_for_it() -> None:
    rec, scope = Recorder(), CancelScope()
    model = ScriptModel(lambda t, _: call("c1", "scan_archive") if t == 0 else text("done"))
    tool = rec.tool("scan_archive", slow=TOOL_WORKS_S)
    events: list[Any] = []
    task = asyncio.create_task(run(new_state(), model, RunOptions(tools={"scan_archive": tool}, on_event=events.append),
                                   scope))
    await rec.started.wait()
    pressed = time.perf_counter()
    scope.cancel("user pressed Stop")
    out = await task
    # The tool would work 10 s; how soon the run ends is benchmarks/stop_latency.py's figure.
    assert time.perf_counter() - pressed < TOOL_WORKS_S / 2
    assert out.state.status == "interrupted" and out.state.interruption is not None
    assert out.state.interruption.reason == "user pressed Stop" and out.state.resumable
    # The trace says the call was cancelled, not failed, and `gateway trace` shows it so.
    result = next(e for e in events if e["type"] == "tool_result")
    assert result["outcome"] == "cancelled" and result["ok"] is False
    lines = timeline(out.state.run_id, events)
    assert any("tool scan_archive(" in line and "-> cancelled in" in line for line in lines), lines


async def test_stop_during_a_model_call_does_not_wait_for_the_reply() -> None:
    scope = CancelScope()
    model = ScriptModel(lambda t, _: text("late"), delay=10)
    task = asyncio.create_task(run(new_state(), model, RunOptions(), scope))
    while not model.requests:
        await asyncio.sleep(0)
    scope.cancel("client disconnected")
    out = await asyncio.wait_for(task, 1)
    assert out.state.status == "interrupted" and out.state.turns == 0


async def test_subrun_budget_is_capped_and_its_cost_rolls_up() -> None:
    assert child_limits(Limits(6, 0.05), 0.01).max_budget_usd == 0.01
    assert child_limits(Limits(6, 0.05), None).max_budget_usd == 0.05
    rec = Recorder()
    child_model = ScriptModel(lambda t, _: call(f"c{t + 1}", "list_files"))  # a runaway child
    child_events: list[dict[str, Any]] = []

    async def research(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        opts = RunOptions(tools={"list_files": rec.tool("list_files")}, dedupe="off", on_event=child_events.append)
        return await run_subrun(ctx, model=child_model, model_name="fake", options=opts, system="research",
                                task=str(args["question"]), limits=Limits(max_turns=6, max_budget_usd=0.05))

    parent = ScriptModel(lambda t, tools: call("r1", "research", {"question": "q"}) if t == 0 else text(tools))
    state = RunState.new("fake", [{"role": "user", "content": "x"}], limits=Limits(max_turns=5, max_budget_usd=0.002))
    out = await run(state, parent, RunOptions(tools={"research": Tool(ToolSpec("research", "r"), research)}))
    child_stop = [e for e in child_events if e["type"] == "run_stopped"][0]
    child_cost = child_stop["costUsd"]
    assert child_stop["status"] == "budget_exceeded"  # capped by the parent's remaining budget, not its own 0.05
    assert child_cost < 0.05
    own = sum(RunOptions().price.cost(u) for u in out.state.per_turn)
    assert abs(out.state.cost_usd - (child_cost + own)) < 1e-9  # the child's spend rolled up
    assert "stopped before answering" in out.state.messages[2]["content"]
    assert out.state.status == "budget_exceeded"  # the roll-up counts against the parent's own budget


async def test_parent_stop_stops_the_child() -> None:
    scope = CancelScope()
    started = asyncio.Event()
    child_model = ScriptModel(lambda t, _: text("never"), delay=10)

    async def research(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        started.set()
        return await run_subrun(ctx, model=child_model, model_name="fake", options=RunOptions(), system="s",
                                task="q", limits=Limits(max_turns=6))

    parent = ScriptModel(lambda t, _: call("r1", "research", {"question": "q"}))
    task = asyncio.create_task(run(new_state(), parent, RunOptions(tools={"research": Tool(ToolSpec("research", "r"),
                                                                                            research)}), scope))
    await started.wait()
    while not child_model.requests:
        await asyncio.sleep(0)
    scope.cancel("user pressed Stop")
    out = await asyncio.wait_for(task, 1)
    assert out.state.status == "interrupted" and child_model.requests


async def test_a_stopped_subrun_still_charges_what_it_spent() -> None:
    scope = CancelScope()
    hang = asyncio.Event()

    class OneThenHang(ScriptModel):
        async def complete(self, request):  # type: ignore[no-untyped-def]
            if self.requests:
                self.requests.append(request)
                await hang.wait()  # never set: the child is stuck in its second model call
            return await super().complete(request)

    child_model = OneThenHang(lambda t, _: call("k1", "list_files"))

    async def research(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        opts = RunOptions(tools={"list_files": Recorder().tool("list_files")})
        return await run_subrun(ctx, model=child_model, model_name="fake", options=opts, system="s", task="q",
                                limits=Limits(max_turns=6))

    parent = ScriptModel(lambda t, _: call("r1", "research", {"question": "q"}))
    task = asyncio.create_task(run(new_state(), parent, RunOptions(tools={"research": Tool(ToolSpec("research", "r"),
                                                                                            research)}), scope))
    while len(child_model.requests) < 2:
        await asyncio.sleep(0)
    scope.cancel("user pressed Stop")
    out = await asyncio.wait_for(task, 1)
    own = RunOptions().price.cost(out.state.per_turn[0])
    child_turn = RunOptions().price.cost(ScriptModelUsage(2))  # system + task
    assert out.state.status == "interrupted"
    assert abs(out.state.cost_usd - (own + child_turn)) < 1e-12  # the child's one paid turn is on the parent


def ScriptModelUsage(messages: int) -> Any:  # noqa: N802 - mirrors ScriptModel's usage rule
    from gateway.harness.usage import Usage

    return Usage(100 + 10 * messages, 20)


@pytest.mark.parametrize("ends", ["raises", "returns"])
async def test_a_tool_that_ends_when_it_sees_the_stop_leaves_its_call_pending(ends: str) -> None:
    # The tool wakes on the Stop before the loop does (its waiter was registered first) and
    # ends: what it says then is not the call's result; the call stays pending and a resume
    # runs it again. (Under load, the server's scan_archive and a sub-run's tool hit this order.)
    started = asyncio.Event()

    async def gives_up(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        started.set()
        await ctx.cancelled.wait()
        if ends == "raises":
            raise RuntimeError("scan_archive was cancelled after 600 of 1200 files")
        return ToolResult("stopped at step 18")

    tool = Tool(ToolSpec("scan_archive", "scan", {"type": "object"}), gives_up)
    scope = CancelScope()
    model = ScriptModel(lambda t, _: call("c1", "scan_archive") if t == 0 else text("done"))
    task = asyncio.create_task(run(new_state(), model, RunOptions(tools={"scan_archive": tool}), scope))
    await started.wait()
    scope.cancel("user pressed Stop")
    out = await task
    assert out.state.status == "interrupted" and out.state.resumable
    assert [m for m in out.state.messages if m.get("role") == "tool"] == []
    assert out.state.failed_calls == []
