"""The agent executor: a sub-run with its own transcript and limits, capped by the parent's
remaining budget, its cost rolled up into the parent, stopped with its parent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gateway.harness.execute import CancelScope
from gateway.harness.loop import run
from gateway.harness.model import ModelRequest
from gateway.harness.state import Limits, Message, RunState
from gateway.harness.usage import DEFAULT_PRICE, Usage
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from tests.policy.conftest import Events, FnModel, WriteFile, answer, new_state, tool_call, tool_messages, turns

CHILD = """
name: kid
system_prompt: You are the kid.
limits: {max_turns: 4}
dedupe: off
tools:
  - name: echo
    description: Echo.
    parameters: {type: object, properties: {text: {type: string}}}
    read_only: true
    executor: {python: "tests.policy.sample_tools:echo_async"}
  - name: slow
    description: Works until stopped.
    read_only: true
    executor: {python: "tests.policy.sample_tools:wait_for_stop"}
"""

PARENT = """
name: boss
tools:
  - name: research
    description: Investigate one question.
    parameters: {type: object, properties: {question: {type: string}}, required: [question]}
    read_only: true
    executor: {agent: {policy: kid, model: kid-model, max_turns: 6, max_budget_usd: %s}}
"""

TURN = Usage(1000, 100)
TURN_COST = DEFAULT_PRICE.cost(TURN)  # $0.0032


def is_child(req: ModelRequest) -> bool:
    return bool(req.messages[0]["content"] == "You are the kid.")


def load(policy_dir: Path, write: WriteFile, child_budget: str = "0.05") -> PolicyRegistry:
    write("kid.yaml", CHILD)
    write("boss.yaml", PARENT % child_budget)
    reg = PolicyRegistry(policy_dir)
    reg.load()
    return reg


class Saved:
    """The sub-runs' checkpoints, latest state by run id."""

    def __init__(self) -> None:
        self.states: dict[str, RunState] = {}

    async def __call__(self, state: RunState) -> None:
        self.states[state.run_id] = state.copy()


async def test_the_child_has_its_own_transcript_and_its_cost_rolls_up(policy_dir: Path, write: WriteFile) -> None:
    reg = load(policy_dir, write)
    boss = reg.get("boss")
    assert boss is not None

    def reply(req: ModelRequest) -> Message:
        if is_child(req):
            if turns(req) == 0:
                assert req.messages[1] == {"role": "user", "content": "which file mentions a timeout?"}
                assert req.model == "kid-model" and {t["function"]["name"] for t in req.tools} == {"echo", "slow"}
                return tool_call("k1", "echo", {"text": "errors.log"})
            return answer("errors.log mentions a timeout")
        if turns(req) == 0:
            return tool_call("p1", "research", {"question": "which file mentions a timeout?"})
        return answer("It is errors.log.")

    saved, events = Saved(), Events()
    model = FnModel(reply, TURN)
    options = compile_options(boss, ToolEnv(model=model, registry=reg, on_event=events, checkpoint=saved))
    out = await run(new_state(limits=Limits(max_turns=10, max_budget_usd=1.0)), model, options)
    state = out.state
    assert state.status == "completed" and out.answer == "It is errors.log."
    assert tool_messages(state) == ["errors.log mentions a timeout"]  # a summary, not what the child read
    child = saved.states[f"{state.run_id}.p1"]
    assert child.parent_run_id == state.run_id and child.status == "completed" and child.turns == 2
    assert tool_messages(child) == [f"async errors.log run={child.run_id} call=k1"]
    assert child.limits == Limits(6, 0.05, "turn")  # its own limits (the parent had $1 left)
    assert state.turns == 2 and state.cost_usd == 4 * TURN_COST  # 2 own turns + 2 child turns
    assert state.usage == Usage(4000, 400)
    started = events.of("subrun_started")
    assert started[0]["childRunId"] == child.run_id
    assert {e["runId"] for e in events.of("turn")} == {state.run_id, child.run_id}


async def test_the_child_budget_is_capped_by_the_parent_remaining(policy_dir: Path, write: WriteFile) -> None:
    reg = load(policy_dir, write, child_budget="0.05")
    boss = reg.get("boss")
    assert boss is not None

    def reply(req: ModelRequest) -> Message:
        if is_child(req):  # a runaway child: calls a tool every turn
            return tool_call(f"k{turns(req)}", "echo", {"text": str(turns(req))})
        if turns(req) == 0:
            return tool_call("p1", "research", {"question": "q"})
        return answer("never reached: the parent's budget is spent")

    saved = Saved()
    model = FnModel(reply, TURN)
    options = compile_options(boss, ToolEnv(model=model, registry=reg, checkpoint=saved))
    # the parent may spend $0.01; after its first turn ($0.0032) $0.0068 is left for the child
    out = await run(new_state(limits=Limits(max_turns=10, max_budget_usd=0.01)), model, options)
    state = out.state
    child = saved.states[f"{state.run_id}.p1"]
    assert child.limits.max_budget_usd is not None
    assert abs(child.limits.max_budget_usd - (0.01 - TURN_COST)) < 1e-12  # not its own $0.05
    assert child.status == "budget_exceeded" and child.turns == 3  # 2 turns < $0.0068 <= 3 turns
    assert child.cost_usd - child.limits.max_budget_usd < TURN_COST  # overshoot under one turn
    assert tool_messages(state)[0].startswith("The sub-run stopped before answering: status budget_exceeded")
    assert state.status == "budget_exceeded" and state.turns == 1
    assert state.cost_usd == TURN_COST + child.cost_usd


async def test_the_child_own_budget_applies_when_smaller(policy_dir: Path, write: WriteFile) -> None:
    reg = load(policy_dir, write, child_budget="0.004")
    boss = reg.get("boss")
    assert boss is not None

    def reply(req: ModelRequest) -> Message:
        if is_child(req):
            return tool_call(f"k{turns(req)}", "echo", {"text": str(turns(req))})
        return tool_call("p1", "research", {"question": "q"}) if turns(req) == 0 else answer("ok")

    saved = Saved()
    model = FnModel(reply, TURN)
    out = await run(new_state(limits=Limits(max_budget_usd=1.0)), model,
                    compile_options(boss, ToolEnv(model=model, registry=reg, checkpoint=saved)))
    child = saved.states[f"{out.state.run_id}.p1"]
    assert child.limits.max_budget_usd == 0.004 and child.status == "budget_exceeded" and child.turns == 2
    assert out.state.status == "completed" and out.state.cost_usd == 4 * TURN_COST


async def test_a_stop_on_the_parent_stops_the_child(policy_dir: Path, write: WriteFile) -> None:
    reg = load(policy_dir, write)
    boss = reg.get("boss")
    assert boss is not None

    def reply(req: ModelRequest) -> Message:
        if is_child(req):
            return tool_call("k1", "slow", {})
        return tool_call("p1", "research", {"question": "q"})

    events, saved = Events(), Saved()
    model = FnModel(reply, TURN)
    options = compile_options(boss, ToolEnv(model=model, registry=reg, on_event=events, checkpoint=saved))
    scope = CancelScope()
    task = asyncio.create_task(run(new_state(), model, options, scope))
    progress = await events.wait(lambda e: e["type"] == "tool_progress")
    child_id = progress["runId"]
    stopped_at = time.perf_counter()
    scope.cancel("user pressed Stop")
    out = await task
    # The child's tool would work 10 s; how soon both stop is benchmarks/stop_latency.py's figure.
    assert time.perf_counter() - stopped_at < 5.0
    stopping = await events.wait(lambda e: e.get("label") == "stopping", timeout=5.0)
    assert stopping["runId"] == child_id and stopping["at"] - stopped_at < 5.0
    assert out.state.status == "interrupted" and out.state.reason == "cancelled"
    child = saved.states[child_id]  # the child stopped through its own exit and saved how
    assert child.status == "interrupted" and child.interruption is not None
    assert child.interruption.type == "cancelled" and child.turns == 1
    assert [e["status"] for e in events.of("run_stopped")] == ["interrupted", "interrupted"]


async def test_a_timed_out_sub_run_is_stopped_and_reported(policy_dir: Path, write: WriteFile) -> None:
    write("kid.yaml", CHILD)
    write("boss.yaml", (PARENT % "0.05").replace("    read_only: true\n", "    read_only: true\n    timeout_s: 0.2\n"))
    reg = PolicyRegistry(policy_dir)
    reg.load()
    boss = reg.get("boss")
    assert boss is not None and boss.tools[0].spec.timeout_s == 0.2

    def reply(req: ModelRequest) -> Message:
        if is_child(req):
            return tool_call("k1", "slow", {})
        return tool_call("p1", "research", {"question": "q"}) if turns(req) == 0 else answer("gave up")

    saved, model = Saved(), FnModel(reply, TURN)
    out = await run(new_state(), model, compile_options(boss, ToolEnv(model=model, registry=reg, checkpoint=saved)))
    assert out.state.status == "completed" and tool_messages(out.state) == ["Error: research timed out after 0.2 s"]
    child = saved.states[f"{out.state.run_id}.p1"]
    assert child.status == "interrupted" and tool_messages(child) == []  # its slow call was stopped, not answered
