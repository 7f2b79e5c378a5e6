"""What the console shows beyond the runs API's own answers: a run's trace as the timeline
`gateway trace` prints (its own formatting, `gateway.trace_view.timeline`) with the cost of
each turn, and each team's spend against its budget for the current period."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from aiohttp import web

from gateway.harness.trace import Event
from gateway.server import context as ctx
from gateway.server.console.session import json_answer, signed_in
from gateway.server.api.runs import public_event, run_for
from gateway.trace_view import timeline


class TurnCost(TypedDict):
    """One model turn of a run: its tokens, what it cost, and the run's cost after it."""

    turn: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    total_usd: float


class TeamSpend(TypedDict):
    """A team's spending in its current budget period."""

    team: str
    budget_usd: float | None
    budget_period: str
    period: str
    spent_usd: float
    reserved_usd: float
    remaining_usd: float | None


def turn_costs(events: Sequence[Event]) -> list[TurnCost]:
    """Each `turn` event's cost: the difference of the run's cumulative cost (`costUsd`)."""
    out: list[TurnCost] = []
    before = 0.0
    for e in events:
        if e["type"] != "turn":
            continue
        total = e.get("costUsd")
        total = float(total) if isinstance(total, (int, float)) else before
        out.append({"turn": int(e.get("turn") or 0), "prompt_tokens": int(e.get("prompt_tokens") or 0),
                    "completion_tokens": int(e.get("completion_tokens") or 0),
                    "cost_usd": round(max(total - before, 0.0), 9), "total_usd": round(total, 9)})
        before = total
    return out


async def run_trace(request: web.Request) -> web.Response:
    """GET /console/api/runs/{id}/trace (through `as_api`): the timeline lines and turn costs
    (`last_seq`: follow the run's events after it)."""
    _, run = await run_for(request)
    stored = await request.app[ctx.STORE].events(run.run_id)
    events = [public_event(run, e) for _, e in stored]
    stops = [e for e in events if e["type"] == "run_stopped"]
    return json_answer({"run_id": run.public_id, "team": run.team, "lines": timeline(run.public_id, events),
                        "turns": turn_costs(events), "last_stop": stops[-1] if stops else None,
                        "last_seq": stored[-1][0] if stored else 0})


async def spend(request: web.Request) -> web.Response:
    """GET /console/api/spend: the signed-in team's spend (an admin team: every team's)."""
    app = request.app
    _, caller = await signed_in(request)
    governor, store = app[ctx.GOVERNOR], app[ctx.STORE]
    rows: list[TeamSpend] = []
    for team in (app[ctx.LIVE].config.teams if caller.admin else [caller]):
        period = governor.period(team)
        spent, reserved = await store.team_spend(team.name, period)
        remaining = None if team.budget_usd is None else round(team.budget_usd - spent - reserved, 9)
        rows.append({"team": team.name, "budget_usd": team.budget_usd, "budget_period": team.budget_period,
                     "period": period, "spent_usd": round(spent, 9), "reserved_usd": round(reserved, 9),
                     "remaining_usd": remaining})
    return json_answer({"object": "list", "data": rows})
