"""The two ends of a governed pass-through call: refuse it, or book the turn it made.

Booking a turn settles the team reservation with the actual cost, saves the run (turns,
usage, cost, per-turn usage, last transcript), appends the `turn` trace line (to the store
and the trace file) and counts it in the metrics, before the client sees the answer's
end, so the client's next call always meets the updated run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from gateway.harness.state import Interruption, Message, RunState, Status
from gateway.harness.usage import Usage
from gateway.server import context as ctx
from gateway.server.budget import Admission
from gateway.server.errors import LimitExceeded
from gateway.server.headers import run_headers
from gateway.server.runs import Call, add_turn, stop_run, update_run
from gateway.server.tracelog import TraceWriter

StopReason = Literal["max_turns", "max_budget", "team_budget"]

_REFUSALS: dict[str, tuple[Status, StopReason, Interruption]] = {
    "max_turns_exceeded": ("max_turns_exceeded", "max_turns", Interruption("max_turns")),
    "budget_exceeded": ("budget_exceeded", "max_budget", Interruption("max_budget")),
    "team_budget_exceeded": ("budget_exceeded", "team_budget", Interruption("max_budget")),
}


@dataclass(frozen=True)
class Booked:
    """The run after a booked turn, and the team's budget left (None: no team budget)."""

    run: RunState
    team_remaining_usd: float | None

    def headers(self) -> dict[str, str]:
        return run_headers(self.run, self.team_remaining_usd)


def event(run_id: str, kind: str, **fields: Any) -> dict[str, Any]:
    """A trace line in the harness's style: runId, type, fields, ts."""
    out: dict[str, Any] = {"runId": run_id, "type": kind}
    out.update(fields)
    out["ts"] = round(time.time(), 6)
    return out


async def write_trace(app: web.Application, run_id: str, events: list[dict[str, Any]]) -> None:
    writer = TraceWriter(app[ctx.STORE], run_id, trace_file=app[ctx.CONFIG].trace_file)
    for e in events:
        writer(e)
    await writer.flush()


async def refuse(request: web.Request, call: Call, exc: LimitExceeded) -> LimitExceeded:
    """The run takes the refusal's status (once); the 429 carries the run object and headers."""
    app = request.app
    status, reason, interruption = _REFUSALS[exc.kind]
    run = call.run
    if (run.status, run.reason) != (status, reason):
        run = await update_run(app[ctx.STORE], run, stop_run(status, reason, interruption,
                                                             exc.message if reason == "team_budget" else None))
        await write_trace(app, run.run_id, [event(run.run_id, "run_stopped", status=status, reason=reason,
                                                  turns=run.turns, costUsd=round(run.cost_usd, 9),
                                                  detail=exc.message)])
        app[ctx.METRICS].on_run_stopped(call.team.name, call.policy.name, status, reason, run.turns, run.cost_usd)
    call.run = run
    request[ctx.RUN] = run
    team_left = await app[ctx.GOVERNOR].team_remaining(call.team)
    exc.extra["run"] = run.summary()
    exc.headers.update(run_headers(run, team_left))
    return exc


async def book_turn(request: web.Request, call: Call, adm: Admission, *, usage: Usage, message: Message,
                    finish: str) -> Booked:
    """Settle, save and trace one turn; returns the updated run."""
    app = request.app
    cost = call.route.price.cost(usage)
    await app[ctx.GOVERNOR].settle(adm, cost)
    completed = finish == "stop" and not message.get("tool_calls")
    transcript = [*call.chat.messages, message]
    run = await update_run(app[ctx.STORE], call.run,
                           add_turn(model=call.chat.model, usage=usage, cost_usd=cost, transcript=transcript,
                                    completed=completed))
    call.run = run
    request[ctx.RUN] = run
    events = [event(run.run_id, "turn", turn=run.turns, prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                    costUsd=round(run.cost_usd, 9), finish=finish)]
    metrics = app[ctx.METRICS]
    metrics.on_turn(call.team.name, call.policy.name, call.chat.model, usage, cost)
    if completed:
        events.append(event(run.run_id, "run_stopped", status="completed", reason="completed", turns=run.turns,
                            costUsd=round(run.cost_usd, 9)))
        metrics.on_run_stopped(call.team.name, call.policy.name, "completed", "completed", run.turns, run.cost_usd)
    await write_trace(app, run.run_id, events)
    return Booked(run, await app[ctx.GOVERNOR].team_remaining(call.team))
