"""The loop's exits, limits, tool errors, dedupe and client tools, over in-process fakes."""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.harness.loop import ANSWER_NOW, REUSED_PREFIX, run
from gateway.harness.options import RunOptions, ToolErrorPolicy
from gateway.harness.state import Limits, RunState
from gateway.harness.stops import RepeatedCall
from gateway.harness.trace import EventList
from tests.harness.fakes import Recorder, ScriptModel, call, text


def new_state(limits: Limits = Limits(max_turns=20)) -> RunState:
    return RunState.new("fake", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], limits=limits)


def plan(t: int, tools: str) -> dict[str, Any]:
    if t == 0:
        return call("c1", "list_files")
    if t == 1:
        return call("c2", "read_file", {"path": "errors.log"})
    return text("errors.log mentions a timeout")


async def test_plan_completes_with_every_change_checkpointed() -> None:
    rec, events, saved = Recorder(), EventList(), []

    async def checkpoint(state: RunState) -> None:
        saved.append((state.turns, len(state.messages)))

    options = RunOptions(tools={"list_files": rec.tool("list_files"), "read_file": rec.tool("read_file")},
                         on_event=events, checkpoint=checkpoint)
    out = await run(new_state(), ScriptModel(plan), options)
    assert out.state.status == "completed" and out.answer == "errors.log mentions a timeout"
    assert out.state.turns == 3 and [r[0] for r in rec.runs] == ["list_files", "read_file"]
    assert out.state.cost_usd == sum(options.price.cost(u) for u in out.state.per_turn)
    # saved after turn 1, its tool, turn 2, its tool, and the stop
    assert saved == [(1, 3), (1, 4), (2, 5), (2, 6), (3, 7)]
    assert all(e["runId"] == out.state.run_id for e in events.events)
    assert [e["type"] for e in events.events] == ["turn", "tool_start", "tool_result", "turn", "tool_start",
                                                  "tool_result", "turn", "run_stopped"]
    assert rec.runs[0][2] == f"{out.state.run_id}:c1"


async def test_turn_cap_stops_before_the_model_is_asked() -> None:
    rec = Recorder()
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "list_files"))
    out = await run(new_state(Limits(max_turns=5)), model, RunOptions(tools={"list_files": rec.tool("list_files")},
                                                                      dedupe="off"))
    assert out.state.status == "max_turns_exceeded" and out.state.reason == "max_turns"
    assert len(model.requests) == 5 and out.state.turns == 5
    assert len(rec.runs) == 4  # the fifth turn's call stays pending for a resume


async def test_budget_overshoots_by_less_than_one_turn() -> None:
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "list_files"))
    out = await run(new_state(Limits(max_budget_usd=0.01)), model,
                    RunOptions(tools={"list_files": Recorder().tool("list_files")}, dedupe="off"))
    state = out.state
    assert state.status == "budget_exceeded"
    last = RunOptions().price.cost(state.per_turn[-1])
    assert 0.01 <= state.cost_usd < 0.01 + last


async def test_tool_error_wording_is_a_policy() -> None:
    rec = Recorder()
    missing = FileNotFoundError("no such file: timeout.log. Call list_files to see what exists.")
    tools = {"read_file": rec.tool("read_file", raises=missing)}
    script = lambda t, _: call("c1", "read_file", {"path": "timeout.log"}) if t == 0 else text("done")  # noqa: E731
    vague = await run(new_state(), ScriptModel(script), RunOptions(tools=tools, tool_errors=ToolErrorPolicy("Error")))
    assert vague.state.messages[3]["content"] == "Error" and vague.state.status == "completed"
    actionable = await run(new_state(), ScriptModel(script),
                           RunOptions(tools=tools, tool_errors=ToolErrorPolicy("{message}")))
    assert "Call list_files" in actionable.state.messages[3]["content"]
    fatal = await run(new_state(), ScriptModel(script), RunOptions(tools=tools, tool_errors=ToolErrorPolicy(fatal=True)))
    assert fatal.state.status == "failed" and fatal.state.reason == "tool_error" and "timeout.log" in str(fatal.state.error)


async def test_permanent_error_stops_with_a_reason_instead_of_looping() -> None:
    rec = Recorder()
    tools = {"read_file": rec.tool("read_file", raises=PermissionError("permission denied: /etc/shadow"))}
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "read_file", {"path": "/etc/shadow"}))
    out = await run(new_state(Limits(max_turns=12)), model, RunOptions(tools=tools))
    assert out.state.status == "failed" and out.state.reason == "permanent_error"
    assert "permission denied" in str(out.state.error) and out.state.turns == 1
    assert out.state.messages[-1]["role"] == "tool"  # the transcript stays well-formed
    old = await run(new_state(Limits(max_turns=12)), model,
                    RunOptions(tools=tools, tool_errors=ToolErrorPolicy(permanent=()), dedupe="off"))
    assert old.state.status == "max_turns_exceeded" and old.state.cost_usd > out.state.cost_usd


async def test_dedupe_reuses_reads_but_runs_writes() -> None:
    def twice(name: str) -> Any:
        return lambda t, _: call(f"c{t + 1}", name, {"path": "a"}) if t < 2 else text("done")

    rec = Recorder()
    tools = {"read_file": rec.tool("read_file", "contents"), "delete_file": rec.tool("delete_file", read_only=False)}
    reads = await run(new_state(), ScriptModel(twice("read_file")), RunOptions(tools=tools))
    assert [r[0] for r in rec.runs] == ["read_file"] and reads.state.turns == 3  # saves the run, not the turn
    assert reads.state.messages[5]["content"] == REUSED_PREFIX + "contents"
    rec.runs.clear()
    await run(new_state(), ScriptModel(twice("delete_file")), RunOptions(tools=tools))
    assert [r[2].split(":")[1] for r in rec.runs] == ["c1", "c2"]  # the gate: both writes run, own keys
    rec.runs.clear()
    await run(new_state(), ScriptModel(twice("delete_file")), RunOptions(tools=tools, dedupe="all"))
    assert len(rec.runs) == 1  # the naive cache swallows the second write


async def test_bad_arguments_and_unknown_tools_are_written_back() -> None:
    def script(t: int, _: str) -> dict[str, Any]:
        if t == 0:
            msg = call("c1", "read_file")
            msg["tool_calls"][0]["function"]["arguments"] = "{not json"
            return msg
        return call("c2", "nope") if t == 1 else text("done")

    rec = Recorder()
    out = await run(new_state(), ScriptModel(script), RunOptions(tools={"read_file": rec.tool("read_file")}))
    assert out.state.status == "completed" and rec.runs == []
    assert "not a valid JSON object" in out.state.messages[3]["content"]
    assert "no tool named 'nope'" in out.state.messages[5]["content"]


async def test_client_tools_go_back_to_the_client_and_the_run_continues() -> None:
    def script(t: int, tools: str) -> dict[str, Any]:
        return call("c1", "get_weather", {"city": "Paris"}) if t == 0 else text(f"weather: {tools}")

    client_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    options = RunOptions(client_tools=[client_tool])
    first = await run(new_state(), ScriptModel(script), options)
    assert first.kind == "client_tools" and first.state.status == "running"
    first.state.messages.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    second = await run(first.state, ScriptModel(script), options)
    assert second.answer == "weather: sunny" and second.state.turns == 2


async def test_repeated_call_condition_stops_the_run() -> None:
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "read_file", {"path": "x"}))
    out = await run(new_state(), model, RunOptions(tools={"read_file": Recorder().tool("read_file")}, dedupe="off",
                                                   stop_when=[RepeatedCall(3)]))
    assert out.state.status == "failed" and out.state.reason == "repeated_call" and out.state.turns == 3


async def test_dedupe_never_reuses_a_failed_result() -> None:
    rec = Recorder()
    tools = {"read_file": rec.tool("read_file", raises=FileNotFoundError("no such file: a"))}
    model = ScriptModel(lambda t, _: call(f"c{t + 1}", "read_file", {"path": "a"}) if t < 2 else text("gave up"))
    out = await run(new_state(), model, RunOptions(tools=tools))
    assert len(rec.runs) == 2 and out.state.failed_calls == ["c1", "c2"]


async def test_a_turn_priced_by_its_model_is_booked_at_that_price() -> None:
    """The model that made the call prices it (the gateway's route that answered), not the
    run's default price: one source for a turn's cost."""

    class PricedModel(ScriptModel):
        async def complete(self, request: Any) -> Any:
            return dataclasses.replace(await super().complete(request), cost_usd=0.5)

    rec = Recorder()
    options = RunOptions(tools={"list_files": rec.tool("list_files"), "read_file": rec.tool("read_file")})
    out = await run(new_state(), PricedModel(plan), options)
    assert out.state.turns == 3 and out.state.cost_usd == 1.5
    assert out.state.cost_usd != sum(options.price.cost(u) for u in out.state.per_turn)


async def test_after_tool_rounds_turns_with_calls_the_model_is_asked_without_tools() -> None:
    rec = Recorder()

    class CallsWhileOffered(ScriptModel):  # a small model: calls a tool whenever it is offered one
        async def complete(self, request: Any) -> Any:
            reply = await super().complete(request)
            return dataclasses.replace(reply, message=reply.message if request.tools else text("3 files"))

    model = CallsWhileOffered(lambda t, tools: call(f"c{t}", "list_files", {"n": t}))
    out = await run(new_state(), model, RunOptions(tools={"list_files": rec.tool("list_files")}, tool_rounds=2))
    assert out.state.status == "completed" and out.answer == "3 files"
    assert [len(r.tools) for r in model.requests] == [1, 1, 0]
    assert len(rec.runs) == 2
    # asked without tools, the model is asked for its answer; the line is not kept in the run
    assert model.requests[2].messages[-1] == {"role": "user", "content": ANSWER_NOW}
    assert ANSWER_NOW not in [m.get("content") for m in out.state.messages]
    assert all(r.messages[-1]["content"] != ANSWER_NOW for r in model.requests[:2])

    always = CallsWhileOffered(lambda t, tools: call(f"c{t}", "list_files", {"n": t}))
    out = await run(new_state(Limits(max_turns=5)), always, RunOptions(tools={"list_files": rec.tool("list_files")}))
    assert all(r.tools for r in always.requests) and out.state.reason == "max_turns"


async def test_a_turn_whose_calls_all_failed_is_not_a_tool_round() -> None:
    """The model read an invented path, named no tool or wrote no JSON: it is offered the tools again."""
    rec = Recorder()
    missing = FileNotFoundError("no such file: C:\\log.txt. Call list_files to see what exists.")
    tools = {"list_files": rec.tool("list_files", "notes.txt  40 bytes"),
             "read_file": rec.tool("read_file", raises=missing)}
    turns = [call("c0", "read_file", {"path": "C:\\log.txt"}), call("c1", "grep", {"text": "x"}),
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}}]},
             call("c3", "list_files"), text("notes.txt")]
    model = ScriptModel(lambda t, _: turns[t] if t < len(turns) else text("late"))
    out = await run(new_state(), model, RunOptions(tools=tools, tool_rounds=1))
    assert out.state.status == "completed" and out.answer == "notes.txt"
    assert [len(r.tools) for r in model.requests] == [2, 2, 2, 2, 0]
    assert out.state.failed_calls == ["c0", "c1", "c2"]
    assert model.requests[4].messages[-1] == {"role": "user", "content": ANSWER_NOW}


async def test_a_turn_with_one_call_that_succeeded_is_a_tool_round() -> None:
    rec = Recorder()
    tools = {"list_files": rec.tool("list_files"), "read_file": rec.tool("read_file", raises=FileNotFoundError("x"))}
    both = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "x"}'}},
        {"id": "b", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]}
    model = ScriptModel(lambda t, _: both if t == 0 else text("done"))
    out = await run(new_state(), model, RunOptions(tools=tools, tool_rounds=1))
    assert [len(r.tools) for r in model.requests] == [2, 0] and out.state.failed_calls == ["a"]


async def test_failed_turns_still_end_at_the_turn_cap() -> None:
    tools = {"read_file": Recorder().tool("read_file", raises=FileNotFoundError("no such file"))}
    model = ScriptModel(lambda t, _: call(f"c{t}", "read_file", {"path": f"invented-{t}.log"}))
    out = await run(new_state(Limits(max_turns=4)), model, RunOptions(tools=tools, tool_rounds=1))
    assert out.state.reason == "max_turns" and all(r.tools for r in model.requests)
