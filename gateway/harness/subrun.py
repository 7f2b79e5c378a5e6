"""A run behind a tool: its own transcript, its own limits, its parent's Stop button.

The parent's transcript receives a summary, not everything the child read; the child's
budget is capped by what the parent may still spend; every dollar the child spends is
charged to the parent as it happens (`ToolContext.spend`), so a Stop mid-sub-run loses none.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.harness.execute import CancelScope
from gateway.harness.loop import run
from gateway.harness.model import Model
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, RunState
from gateway.harness.tools import ToolContext, ToolResult
from gateway.harness.trace import Tracer


def child_limits(own: Limits, parent_remaining_usd: float | None) -> Limits:
    """The child's own limits, with its budget never above what the parent has left."""
    budget = own.max_budget_usd
    if parent_remaining_usd is not None:
        budget = parent_remaining_usd if budget is None else min(budget, parent_remaining_usd)
    return replace(own, max_budget_usd=budget)


async def run_subrun(ctx: ToolContext, *, model: Model, model_name: str, options: RunOptions, system: str,
                     task: str, limits: Limits, team: str = "", policy: str = "", policy_version: str = "",
                     scope: CancelScope | None = None) -> ToolResult:
    """Run a child agent on `task` and return its answer (or how it ended) as a tool result.

    `scope` defaults to the parent's Stop button (`ctx.cancelled`).
    """
    child = RunState.new(
        model_name,
        [{"role": "system", "content": system}, {"role": "user", "content": task}],
        run_id=f"{ctx.run_id}.{ctx.call_id}",
        limits=child_limits(limits, ctx.budget_remaining_usd),
        parent_run_id=ctx.run_id, team=team, policy=policy, policy_version=policy_version,
    )
    Tracer(ctx.run_id, options.on_event)("subrun_started", childRunId=child.run_id, toolName=ctx.tool_name,
                                         callId=ctx.call_id)
    options = replace(options, on_spend=ctx.spend)
    outcome = await run(child, model, options, scope or CancelScope(ctx.cancelled))
    state = outcome.state
    if state.status == "completed":
        content = outcome.answer or "The sub-run finished without an answer."
    else:
        content = (f"The sub-run stopped before answering: status {state.status}, reason {state.reason}"
                   f" after {state.turns} turns and ${state.cost_usd:.6f}.")
    return ToolResult(content=content)  # its spend was charged to the parent as it happened
