"""Approvals as data: stop, decide (possibly in another process), continue through pending()."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.harness.approvals import ApprovalError, decide, resume
from gateway.harness.loop import run
from gateway.harness.options import RunOptions, Verdict
from gateway.harness.state import Decision, Limits, RunState
from gateway.harness.tools import ToolSpec
from tests.harness.fakes import Recorder, ScriptModel, call, text


def destructive(t: int, tools: str) -> dict[str, Any]:
    if t == 0:
        return call("c1", "list_files")
    if t == 1:
        return call("c2", "delete_file", {"path": "access.log"})
    last = tools.splitlines()[-1] if tools else ""
    return text("I did not delete anything." if "declined" in last or "denied" in last else "Deleted access.log.")


def setup() -> tuple[Recorder, RunOptions]:
    rec = Recorder()
    tools = {"list_files": rec.tool("list_files"),
             "delete_file": rec.tool("delete_file", "deleted access.log", read_only=False, needs_approval=True)}
    return rec, RunOptions(tools=tools)


async def paused() -> tuple[Recorder, RunOptions, RunState]:
    rec, options = setup()
    state = RunState.new("fake", [{"role": "user", "content": "free space"}], limits=Limits(max_turns=20))
    out = await run(state, ScriptModel(destructive), options)
    return rec, options, out.state


async def test_needs_approval_stops_with_the_call_to_decide() -> None:
    rec, _, state = await paused()
    assert state.status == "interrupted" and state.turns == 2
    assert state.interruption is not None and state.interruption.type == "approval"
    assert (state.interruption.call_id, state.interruption.tool_name) == ("c2", "delete_file")
    assert state.interruption.args == {"path": "access.log"}
    assert [r[0] for r in rec.runs] == ["list_files"]


async def test_approve_runs_the_call_after_a_round_trip_through_json() -> None:
    rec, options, state = await paused()
    restored = RunState.loads(state.dumps())  # as if another process picked it up
    decide(restored, "c2", Decision("approve", by="ops"))
    out = await run(restored, ScriptModel(destructive), options)
    assert out.state.status == "completed" and out.answer == "Deleted access.log." and out.state.turns == 3
    assert [r[0] for r in rec.runs] == ["list_files", "delete_file"]


@pytest.mark.parametrize("reason", ["keep it for the audit", ""])
async def test_reject_writes_a_sentence_even_without_a_reason(reason: str) -> None:
    rec, options, state = await paused()
    decide(state, "c2", Decision("reject", reason))
    out = await run(state, ScriptModel(destructive), options)
    written = out.state.messages[-2]["content"]
    assert "declined" in written and "nothing was done" in written
    assert (reason in written) if reason else written.strip()
    assert out.answer == "I did not delete anything." and [r[0] for r in rec.runs] == ["list_files"]


async def test_deny_verdict_is_written_and_the_tool_never_runs() -> None:
    rec, options = setup()
    options.approval = lambda spec, args: Verdict("deny", "no deletes on Fridays") if not spec.read_only \
        else Verdict("allow")
    out = await run(RunState.new("fake", [{"role": "user", "content": "x"}]), ScriptModel(destructive), options)
    assert "denied" in out.state.messages[-2]["content"] and "no deletes on Fridays" in out.state.messages[-2]["content"]
    assert out.answer == "I did not delete anything." and [r[0] for r in rec.runs] == ["list_files"]


async def test_decisions_that_do_not_fit_are_refused() -> None:
    _, _, state = await paused()
    with pytest.raises(ApprovalError, match="not pending"):
        decide(state, "c9", Decision("approve"))
    with pytest.raises(ApprovalError, match="waits for a decision"):
        resume(state)
    decide(state, "c2", Decision("approve"))
    with pytest.raises(ApprovalError):
        decide(state, "c2", Decision("reject"))


async def test_resume_with_raised_limits_continues_a_capped_run() -> None:
    rec = Recorder()
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "list_files") if t < 4 else text("done"))
    options = RunOptions(tools={"list_files": rec.tool("list_files")}, dedupe="off")
    out = await run(RunState.new("fake", [{"role": "user", "content": "x"}], limits=Limits(max_turns=2)), model, options)
    assert out.state.status == "max_turns_exceeded"
    resume(out.state, Limits(max_turns=10))
    done = await run(out.state, model, options)
    assert done.state.status == "completed" and done.state.turns == 5 and len(rec.runs) == 4
    ids = [c for c in (r[2] for r in rec.runs)]
    assert len(set(ids)) == 4  # the pending call of turn 2 ran once, after the resume


def test_spec_defaults_ask_only_for_flagged_tools() -> None:
    from gateway.harness.options import default_approval

    assert default_approval(ToolSpec("a", "", needs_approval=True), {}).action == "ask"
    assert default_approval(ToolSpec("b", ""), {}).action == "allow"
