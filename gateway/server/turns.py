"""The two ends of a governed pass-through call: refuse it, or book the turn it made.

Booking a turn settles the team reservation with the actual cost, saves the run (turns,
usage, cost, per-turn usage, last transcript) and appends the `turn` trace line, all in one
store step (`Store.commit_turn`, which also reports the team's ledger for the headers), then
writes the line to the trace file and counts the turn in the metrics, before the client sees
the answer's end, so the client's next call always meets the updated run. If that step
fails for good, the spend is still booked on its own: the money was spent upstream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from gateway.harness.state import Interruption, Message, RunState, Status
from gateway.harness.usage import Usage
from gateway.server import context as ctx
from gateway.server import tracefile
from gateway.server.budget import Admission
from gateway.server.errors import Conflict, LimitExceeded
from gateway.server.headers import run_headers
from gateway.server.runs import Call, add_turn, commit_run, stop_run
from gateway.store.base import Booking, Event
from gateway.store.errors import RunNotFound, StaleRun

log = logging.getLogger(__name__)

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


def append_trace_file(path: Path | None, events: list[Event]) -> None:
    """The lines the store has, also in the optional trace file (a failure there is logged)."""
    tracefile.append(path, events)


async def refuse(request: web.Request, call: Call, exc: LimitExceeded) -> LimitExceeded:
    """The run takes the refusal's status (once); the 429 carries the run object and headers."""
    app = request.app
    status, reason, interruption = _REFUSALS[exc.kind]
    run = call.run
    if (run.status, run.reason) != (status, reason):
        detail = exc.message if reason == "team_budget" else None

        def trace(r: RunState) -> list[Event]:
            return [event(r.run_id, "run_stopped", status=status, reason=reason, turns=r.turns,
                          costUsd=round(r.cost_usd, 9), detail=exc.message)]

        run, events, _ = await commit_run(app[ctx.STORE], run, stop_run(status, reason, interruption, detail), trace,
                                          None)
        append_trace_file(app[ctx.CONFIG].trace_file, events)
        app[ctx.METRICS].on_run_stopped(call.team.name, call.policy.name, status, reason, run.turns, run.cost_usd)
    call.run = run
    request[ctx.RUN] = run
    team_left = await app[ctx.GOVERNOR].team_remaining(call.team)
    exc.extra["run"] = run.summary()
    exc.headers.update(run_headers(run, team_left))
    return exc


async def book_turn(request: web.Request, call: Call, adm: Admission, *, usage: Usage, message: Message,
                    finish: str) -> Booked:
    """Settle, save and trace one turn in one store step; returns the updated run."""
    app = request.app
    governor = app[ctx.GOVERNOR]
    cost = call.route.price.cost(usage)
    booking = governor.booking(adm, cost)
    completed = finish == "stop" and not message.get("tool_calls")
    change = add_turn(model=call.chat.model, usage=usage, cost_usd=cost, transcript=[*call.chat.messages, message],
                      completed=completed)

    def trace(run: RunState) -> list[Event]:
        lines = [event(run.run_id, "turn", turn=run.turns, prompt_tokens=usage.prompt_tokens,
                       completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                       costUsd=round(run.cost_usd, 9), finish=finish)]
        if completed:
            lines.append(event(run.run_id, "run_stopped", status="completed", reason="completed", turns=run.turns,
                               costUsd=round(run.cost_usd, 9)))
        return lines

    try:
        run, events, ledger = await commit_run(app[ctx.STORE], call.run, change, trace, booking)
    except BaseException as exc:
        if booking is not None:
            await _book_alone(governor.book, booking, exc)
        raise
    call.run = run
    request[ctx.RUN] = run
    append_trace_file(app[ctx.CONFIG].trace_file, events)
    metrics = app[ctx.METRICS]
    metrics.on_turn(call.team.name, call.policy.name, call.chat.model, usage, cost)
    if completed:
        metrics.on_run_stopped(call.team.name, call.policy.name, "completed", "completed", run.turns, run.cost_usd)
    team = call.team
    left = governor.remaining(team, ledger) if ledger is not None else await governor.team_remaining(team)
    return Booked(run, left)


async def _book_alone(book: Callable[[Booking], Awaitable[None]], booking: Booking, exc: BaseException) -> None:
    """The turn's save failed for good: book its spend anyway. A settle is idempotent, so it
    is safe whatever happened; a charge only when the store surely wrote nothing."""
    if booking.reservation_id is None and not isinstance(exc, (StaleRun, RunNotFound, Conflict)):
        return
    try:
        await book(booking)
    except Exception:
        log.exception("cannot book $%.9f of team %s after a failed turn save", booking.actual_usd, booking.team)
