"""Limits that ask a person (`on_exceed: ask`): pure loop tests over in-process fakes.

A limit the policy asks about stops the run as a request (`interrupted`, reason `limit`)
instead of ending it; a grant raises exactly the limits it names and the run goes on
from where it stopped; a rejection ends it as the limit would; `max_grants` and
`max_total` make the limit stop as `on_exceed: stop` does.
"""

from __future__ import annotations

import pytest

from gateway.harness import limit_requests
from gateway.harness.approvals import ApprovalError, resume
from gateway.harness.loop import run
from gateway.harness.model import LimitReached, ModelReply, ModelRequest
from gateway.harness.options import LimitAsk, RunOptions
from gateway.harness.state import Decision, Limits, Message, RunState
from gateway.harness.trace import EventList
from tests.harness.fakes import Recorder, ScriptModel, call, text

ASK = LimitAsk(approvers=("ops",), grant={"max_turns": 3, "max_tool_calls": 5}, max_grants=2,
               max_total={"max_turns": 9})


def plan(turn: int, _: str) -> Message:
    return call(f"c{turn + 1}", "list_files") if turn < 4 else text("done")


def state(limits: Limits = Limits(max_turns=2)) -> RunState:
    return RunState.new("fake", [{"role": "user", "content": "u"}], limits=limits)


def options(events: EventList, ask: LimitAsk | None = ASK) -> RunOptions:
    return RunOptions(tools={"list_files": Recorder().tool("list_files")}, dedupe="off", limit_ask=ask,
                      on_event=events)


async def test_the_turn_cap_asks_a_person_and_a_grant_lets_the_run_finish() -> None:
    events, model = EventList(), ScriptModel(plan)
    out = await run(state(), model, options(events))
    s = out.state
    assert (s.status, s.reason, s.turns) == ("interrupted", "limit", 2)
    waiting = s.waiting_request
    assert waiting is not None and waiting.type == "limit" and waiting.limit == "max_turns"
    assert (waiting.used, waiting.cap, waiting.grant) == (2, 2, {"max_turns": 3, "max_tool_calls": 5})
    assert waiting.call_id is not None and waiting.call_id.startswith("lim_")
    [line] = events.of("limit_reached")
    assert line["callId"] == waiting.call_id and line["asked"] is True and line["grants"] == 0  # type: ignore[typeddict-item]
    assert len(model.requests) == 2  # nothing was asked past the cap

    with pytest.raises(ApprovalError, match="waits for a decision on its max_turns"):
        resume(s)  # nobody raises the cap by resuming while a person is asked
    record = limit_requests.grant(s, waiting.call_id, Decision("approve", "ok", "ops"), {"max_turns": 3}, 5.0)
    assert (record.before, record.after, record.by) == ({"max_turns": 2}, {"max_turns": 5}, "ops")
    assert s.limits.max_turns == 5 and s.limits.max_tool_calls == 100  # exactly what the grant names
    # as after a call's decision: decided, still interrupted, waiting for the resume that drives it
    assert s.status == "interrupted" and s.decided and s.waiting_request is None and s.waiting_for == "resume"
    assert s.interruption_json() is not None and s.interruption_json()["decision"] == "approve"  # type: ignore[index]
    resume(s)
    out = await run(s, model, options(events))
    assert out.state.status == "completed" and out.state.turns == 5 and len(out.state.grants) == 1


async def test_a_rejection_ends_the_run_as_the_limit_does_with_the_reason() -> None:
    out = await run(state(), ScriptModel(plan), options(EventList()))
    waiting = out.state.waiting_request
    assert waiting is not None and waiting.call_id is not None
    limit_requests.refuse(out.state, waiting.call_id, Decision("reject", "enough for today", "ops"))
    s = out.state
    assert (s.status, s.reason) == ("max_turns_exceeded", "max_turns")
    assert s.interruption is not None and s.interruption.type == "max_turns"
    assert "ops" in (s.interruption.reason or "") and "enough for today" in (s.interruption.reason or "")
    with pytest.raises(ApprovalError, match="not waiting for a limit request"):
        limit_requests.refuse(s, waiting.call_id, Decision("reject", "", "ops"))


async def test_after_max_grants_the_limit_stops_the_run_without_asking() -> None:
    events, model = EventList(), ScriptModel(lambda t, _: call(f"c{t + 1}", "list_files"))  # never done
    s = state(Limits(max_turns=1))
    for n in range(2):
        s = (await run(s, model, options(events))).state
        waiting = s.waiting_request
        assert waiting is not None and waiting.call_id is not None, s.reason
        limit_requests.grant(s, waiting.call_id, Decision("approve", by="ops"), {"max_turns": 1}, float(n))
        resume(s)
    s = (await run(s, model, options(events))).state
    assert (s.status, s.reason, s.turns) == ("max_turns_exceeded", "max_turns", 3)
    assert "limits.ask.max_grants" in str(events.of("run_stopped")[-1].get("detail"))
    assert [e["asked"] for e in events.of("limit_reached")] == [True, True, False]  # type: ignore[typeddict-item]


async def test_max_total_cuts_the_proposed_grant_and_then_stops_the_run() -> None:
    s = state(Limits(max_turns=8))
    s.turns = 8
    out = await run(s, ScriptModel(plan), options(EventList()))
    waiting = out.state.waiting_request
    assert waiting is not None and waiting.grant == {"max_turns": 1, "max_tool_calls": 5}  # 8 + 1 = max_total 9
    assert waiting.call_id is not None
    limit_requests.grant(out.state, waiting.call_id, Decision("approve", by="ops"), {"max_turns": 1}, 0.0)
    resume(out.state)
    out.state.turns = 9
    events = EventList()
    again = await run(out.state, ScriptModel(plan), options(events))
    assert again.state.status == "max_turns_exceeded"
    assert "limits.ask.max_total" in str(events.of("run_stopped")[-1].get("detail"))


async def test_a_limit_the_grant_does_not_name_stops_as_before() -> None:
    out = await run(state(Limits(max_turns=20, max_budget_usd=1e-9)), ScriptModel(plan), options(EventList()))
    assert out.state.status == "budget_exceeded"  # the grant names turns and tool calls, not dollars


async def test_the_tool_cap_asks_before_the_tool_that_would_pass_it() -> None:
    rec = Recorder()
    opts = RunOptions(tools={"list_files": rec.tool("list_files")}, dedupe="off", limit_ask=ASK)
    out = await run(state(Limits(max_turns=20, max_tool_calls=2)), ScriptModel(plan), opts)
    waiting = out.state.waiting_request
    assert waiting is not None and waiting.limit == "max_tool_calls" and len(rec.runs) == 2


class Pricey:
    """A model whose every call would pass the budget it is given (it refuses, as the
    gateway's governed model does under `fit_budget`)."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelReply:
        self.requests.append(request)
        raise LimitReached("the next call may cost up to $0.01, more than the $0.000001 left")


async def test_a_budget_that_asks_pauses_before_the_call_that_could_pass_it() -> None:
    ask = LimitAsk(approvers=("ops",), grant={"max_budget_usd": 0.5})
    model = Pricey()
    out = await run(state(Limits(max_turns=20, max_budget_usd=0.25)), model, options(EventList(), ask))
    assert model.requests[0].fit_budget is True
    waiting = out.state.waiting_request
    assert waiting is not None and waiting.limit == "max_budget_usd" and waiting.cap == 0.25
    assert out.state.cost_usd == 0.0 and "$0.01" in (waiting.reason or "")
    plain = await run(state(Limits(max_turns=20, max_budget_usd=0.25)), Pricey(), options(EventList(), None))
    assert plain.state.status == "budget_exceeded"  # the same refusal under on_exceed: stop
