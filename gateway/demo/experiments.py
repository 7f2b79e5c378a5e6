"""The chapter's experiments, each an async function of the lab returning its result lines."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.demo.lab import Lab
from gateway.demo.report import Result
from gateway.harness.approvals import decide
from gateway.harness.options import ToolErrorPolicy, Verdict
from gateway.harness.state import Decision, Limits
from gateway.harness.subrun import run_subrun
from gateway.harness.tools import Tool, ToolContext, ToolResult, ToolSpec
from gateway.harness.trace import Event
from gateway.tools.catalog import RESEARCH, RESEARCH_SYSTEM
from gateway.tools.files import deleted, file_tools

Experiment = Callable[[Lab], Awaitable[list[Result]]]


def allow_all(spec: ToolSpec, args: Mapping[str, Any]) -> Verdict:
    return Verdict("allow")


async def plan(lab: Lab) -> list[Result]:
    trial = await lab.trial("scripted-plan", limits=Limits(max_turns=20))
    return [trial.result("plan", "cap 20")]


async def runaway(lab: Lab) -> list[Result]:
    # the chapter's loop at this point has no result cache: every list_files runs
    return [(await lab.trial("scripted-runaway", limits=Limits(max_turns=cap), dedupe="off")).result(
        "runaway", f"cap {cap}") for cap in (8, 20, 50, 100)]


async def budget(lab: Lab) -> list[Result]:
    out = []
    for usd in (0.010, 0.020, 0.050):
        trial = await lab.trial("scripted-runaway", limits=Limits(max_budget_usd=usd), dedupe="off")
        last_turn = lab_turn_cost(trial.state.per_turn[-1].prompt_tokens, trial.state.per_turn[-1].completion_tokens)
        out.append(trial.result("budget", f"${usd:.3f}, no cap", budget_usd=usd,
                                overshoot_usd=round(trial.state.cost_usd - usd, 6),
                                last_turn_usd=round(last_turn, 6)))
    return out


def lab_turn_cost(prompt: int, completion: int) -> float:
    return (prompt * 2.0 + completion * 12.0) / 1e6


async def recover(lab: Lab) -> list[Result]:
    policies = {
        "fatal": ToolErrorPolicy(fatal=True),
        'vague "Error"': ToolErrorPolicy(text="Error"),
        "actionable text": ToolErrorPolicy(text="{message}"),
    }
    return [(await lab.trial("scripted-recover", limits=Limits(max_turns=20), tool_errors=p)).result("recover", name)
            for name, p in policies.items()]


async def forbidden(lab: Lab) -> list[Result]:
    old = await lab.trial("scripted-forbidden", limits=Limits(max_turns=12), tool_errors=ToolErrorPolicy(permanent=()))
    new = await lab.trial("scripted-forbidden", limits=Limits(max_turns=12))
    return [old.result("forbidden", "retry until cap 12"), new.result("forbidden", "permanent error stops")]


async def repeat(lab: Lab) -> list[Result]:
    base = await lab.trial("scripted-once", limits=Limits(max_turns=20))
    plain = await lab.trial("scripted-repeat", limits=Limits(max_turns=20), dedupe="off")
    cached = await lab.trial("scripted-repeat", limits=Limits(max_turns=20), dedupe="read_only")
    out = [base.result("repeat", "baseline (one read)"),
           plain.result("repeat", "same read twice, no dedupe",
                        extra_usd=round(plain.state.cost_usd - base.state.cost_usd, 6),
                        extra_pct=round(100 * (plain.state.cost_usd / base.state.cost_usd - 1))),
           cached.result("repeat", "same read twice, dedupe",
                         extra_usd=round(cached.state.cost_usd - base.state.cost_usd, 6))]
    for variant, mode in (("naive cache on every tool", "all"), ("cache only on read-only tools", "read_only")):
        trial = await lab.trial("scripted-repeat-write", limits=Limits(max_turns=20), dedupe=mode, approval=allow_all)
        result = trial.result("repeat", variant)
        result.deleted = deleted(trial.sandbox)
        out.append(result)
    return out


async def destructive(lab: Lab) -> list[Result]:
    out = []
    variants = (("approved", Decision("approve", by="demo")),
                ("rejected with a reason", Decision("reject", "Keep access.log: the audit needs it.", by="demo")),
                ("rejected with nothing", Decision("reject", "", by="demo")),
                ("rejected, empty result (chapter)", Decision("reject", "", by="demo")))
    for variant, decision in variants:
        # The chapter's harness wrote nothing for a rejection without a reason; ours writes a sentence.
        wording: dict[str, Any] = {"rejection_text": silent} if variant.endswith("(chapter)") else {}
        paused = await lab.trial("scripted-destructive", limits=Limits(max_turns=20))
        state = paused.state
        if variant == "approved":
            stop = paused.result("destructive", "paused for approval")
            stop.deleted = deleted(paused.sandbox)
            out.append(stop)
        assert state.interruption is not None and state.interruption.call_id is not None
        decide(state, state.interruption.call_id, decision)
        done = await lab.trial(state.model, state=state, sandbox=paused.sandbox, **wording)
        result = done.result("destructive", variant)
        result.tool_runs = paused.result("", "").tool_runs + result.tool_runs  # both halves of the run
        result.deleted = deleted(done.sandbox)
        out.append(result)
    return out


def silent(name: str, args: Any, reason: str, by: str) -> str:
    return ""


async def cancel(lab: Lab) -> list[Result]:
    full = await lab.trial("scripted-slow", limits=Limits(max_turns=20))
    stopped = await lab.trial("scripted-slow", limits=Limits(max_turns=20), stop_after_s=1.2)
    assert stopped.stopped_at is not None
    lag = round((stopped.ended_at - stopped.stopped_at) * 1000, 1)
    progress = [e["label"] for e in full.events.events if e["type"] == "tool_progress"]
    return [full.result("cancel", "no Stop", progress=len(progress)),
            stopped.result("cancel", "Stop at 1.2 s", stop_to_end_ms=lag)]


async def latency(lab: Lab) -> list[Result]:
    out = []
    for ms in (0, 100, 500):
        trial = await lab.trial("scripted-plan", limits=Limits(max_turns=20), latency_ms=ms)
        out.append(trial.result("latency", f"provider {ms} ms", harness_ms=round(trial.own_ms, 2)))
    return out


async def research(lab: Lab) -> list[Result]:
    sandbox = lab.sandbox()
    child_model = lab.model()

    async def research_tool(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        from gateway.harness.options import RunOptions

        options = RunOptions(tools=file_tools(sandbox), on_event=events_sink)
        return await run_subrun(ctx, model=child_model, model_name="scripted-plan", options=options,
                                system=RESEARCH_SYSTEM, task=str(args.get("question", "")),
                                limits=Limits(max_turns=6, max_budget_usd=0.05))

    child_events: list[Event] = []
    events_sink = child_events.append
    tool = Tool(RESEARCH, research_tool)
    trial = await lab.trial("scripted-research", limits=Limits(max_turns=10, max_budget_usd=0.50),
                            sandbox=sandbox, extra_tools={"research": tool})
    child_turns = sum(1 for e in child_events if e["type"] == "turn")
    return [trial.result("research", "sub-run", child_turns=child_turns,
                         child_tools=len([e for e in child_events if e["type"] == "tool_start"]))]


EXPERIMENTS: dict[str, Experiment] = {
    "plan": plan, "runaway": runaway, "budget": budget, "recover": recover, "forbidden": forbidden,
    "repeat": repeat, "destructive": destructive, "cancel": cancel, "latency": latency, "research": research,
}
