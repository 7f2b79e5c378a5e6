"""The two ends of a governed pass-through call: refuse it, or book the turn it made.

Booking a turn settles the team reservation with the actual cost, saves the run (turns,
usage, cost, per-turn usage, last transcript) and appends the `turn` trace line, all in one
store step (`Store.commit_turn`, which also reports the team's ledger for the headers), then
writes the line to the trace file and counts the turn in the metrics, before the client sees
the answer's end, so the client's next call always meets the updated run. If that step
fails for good, the spend is still booked on its own: the money was spent upstream; if the
store cannot be reached at all, the turn waits in a local durable spool (`spool_file`) and
is booked, exactly once, when the store is back (`replay_spool`, run in the background).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from gateway.harness.state import Message, RunState
from gateway.harness.trace import RepairFields, Tracer, UpstreamAttemptFields, usage_clamped
from gateway.harness.usage import Usage
from gateway.providers.failover import Answer, RoutedCall
from gateway.providers.repair import Repair
from gateway.server import context as ctx
from gateway.server.http.errors import Conflict, LimitExceeded, limit_stop
from gateway.server.http.headers import run_headers
from gateway.server.runs.governor import Admission
from gateway.server.runs.keying import Call, add_turn, commit_run, stop_run
from gateway.server.runs.replies import checked_usage
from gateway.store import tracefile
from gateway.store.base import Booking, Event, Ledger, TokenCharge
from gateway.store.errors import AlreadyBooked, RunNotFound, StaleRun, StoreError

if TYPE_CHECKING:
    from gateway.telemetry.tracing import ChatSpan

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Booked:
    """The run after a booked turn, and the team's budget left (None: no team budget)."""

    run: RunState
    team_remaining_usd: float | None
    usage: Usage | None = None  # what the turn was booked at

    def headers(self) -> dict[str, str]:
        return run_headers(self.run, self.team_remaining_usd)


def append_trace_file(path: Path | None, events: list[Event]) -> None:
    """The lines the store has, also in the optional trace file (a failure there is logged)."""
    tracefile.append(path, events)


async def refuse(request: web.Request, call: Call, exc: LimitExceeded) -> LimitExceeded:
    """The run takes the refusal's status (once); the 429 carries the run object and headers."""
    app = request.app
    status, reason, interruption = limit_stop(exc.kind)
    run = call.run
    if (run.status, run.reason) != (status, reason):
        detail = exc.message if reason in ("team_budget", "key_budget", "user_budget") else None

        def trace(r: RunState) -> list[Event]:
            return [Tracer(r.run_id)("run_stopped", status=status, reason=reason, turns=r.turns,
                                     costUsd=round(r.cost_usd, 9), detail=exc.message)]

        async with app[ctx.GOVERNOR].run_lock(run.run_id):
            run, events, _ = await commit_run(app[ctx.STORE], run, stop_run(status, reason, interruption, detail),
                                              trace, None)
        app[ctx.RUN_CACHE].put(run)
        append_trace_file(app[ctx.CONFIG].trace_file, events)
        app[ctx.METRICS].on_run_stopped(call.team.name, call.policy.name, status, reason, run.turns, run.cost_usd)
    call.run = run
    request[ctx.RUN] = run
    team_left = await app[ctx.GOVERNOR].team_remaining(call.team)
    exc.extra["run"] = run.summary()
    exc.headers.update(run_headers(run, team_left))
    return exc


@dataclass(frozen=True)
class TurnRecord:
    """One pass-through turn as it is booked: serializable, so that a turn the store could not
    take is spooled (`Spool`) and booked later exactly as it would have been."""

    run_id: str
    model: str
    usage: Usage
    cost_usd: float
    transcript: list[Message]
    completed: bool
    finish: str
    upstream: str
    reported: Usage | None
    booking: Booking | None
    attempts: tuple[UpstreamAttemptFields, ...] = ()  # the call's upstream attempts (`upstream_attempt` lines)
    repairs: tuple[RepairFields, ...] = ()  # the upstream's tool calls the gateway repaired (Repair.to_json)

    def change(self) -> Callable[[RunState], None]:
        return add_turn(model=self.model, usage=self.usage, cost_usd=self.cost_usd, transcript=self.transcript,
                        completed=self.completed)

    def trace(self, run: RunState) -> list[Event]:
        usage, line = self.usage, Tracer(run.run_id)
        lines: list[Event] = [line("upstream_attempt", **fields) for fields in self.attempts]
        lines += [line("tool_call_repaired", upstream=self.upstream, turn=run.turns, **repair)
                  for repair in self.repairs]
        if self.reported is not None:
            lines.append(line("usage_clamped", **usage_clamped(self.upstream, self.reported, usage)))
        lines.append(line("turn", turn=run.turns, prompt_tokens=usage.prompt_tokens,
                          completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                          costUsd=round(run.cost_usd, 9), finish=self.finish))
        if self.completed:
            lines.append(line("run_stopped", status="completed", reason="completed", turns=run.turns,
                              costUsd=round(run.cost_usd, 9)))
        return lines

    def to_json(self) -> dict[str, Any]:
        b = self.booking
        return {"run_id": self.run_id, "model": self.model, "usage": self.usage.to_json(), "cost_usd": self.cost_usd,
                "transcript": self.transcript, "completed": self.completed, "finish": self.finish,
                "upstream": self.upstream, "reported": None if self.reported is None else self.reported.to_json(),
                "attempts": list(self.attempts),
                "repairs": list(self.repairs),
                "booking": None if b is None else {"team": b.team, "period": b.period, "actual_usd": b.actual_usd,
                                                   "reservation_id": b.reservation_id,
                                                   "tokens": [[c.scope, c.tokens, c.tokens_s] for c in b.tokens]}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnRecord:
        b = data.get("booking")
        return cls(str(data["run_id"]), str(data["model"]), Usage.from_json(data["usage"]), float(data["cost_usd"]),
                   list(data["transcript"]), bool(data["completed"]), str(data["finish"]), str(data["upstream"]),
                   None if data.get("reported") is None else Usage.from_json(data["reported"]),
                   None if b is None else Booking(str(b["team"]), str(b["period"]), float(b["actual_usd"]),
                                                  b.get("reservation_id"), if_held=True, tokens=tuple(
                                                      TokenCharge(str(s), int(n), float(per))
                                                      for s, n, per in b.get("tokens") or ())),
                   tuple(data.get("attempts") or ()),
                   tuple(cast(RepairFields, {str(k): str(v) for k, v in r.items()}) for r in data.get("repairs") or ()))


async def book_turn(request: web.Request, call: Call, adm: Admission, *, reported: Usage | None, message: Message,
                    finish: str, routed: RoutedCall | None = None, repairs: Sequence[Repair] = (),
                    others: Sequence[Message] = (), response_model: str | None = None) -> Booked:
    """Settle, save and trace one turn in one store step; returns the updated run.

    The turn costs the price of the deployment that answered `routed` (or that had the
    request when its client left; else the route's),
    and its trace carries the call's `upstream_attempt` lines.

    The usage booked is the upstream's `reported` one unless it is absent or beyond belief
    (`checked_usage`, counting `message` and the `others` choices of the answer); then the
    gateway's count is booked, and a `usage_clamped` line says so. `response_model`: the model
    the upstream's answer names (its trace span's `gen_ai.response.model`).
    If the store cannot be reached, the turn is written to the spool (booked when the store
    is back) and the call is answered with the run as it will be.
    """
    app = request.app
    governor = app[ctx.GOVERNOR]
    chat = call.chat
    checked = checked_usage(reported, counter=app[ctx.COUNTER], messages=chat.messages, tools=chat.tools,
                            replies=[message, *others], body_bytes=len(chat.raw),
                            allowed_completion=adm.allowed_completion, n=chat.n, counted_prompt=adm.prompt_tokens)
    usage = checked.usage
    answer = routed.sent_to if routed is not None else None
    price, upstream = (answer.price, answer.upstream.name) if answer is not None else (call.route.price,
                                                                                          call.route.upstream)
    cost = price.cost(usage)
    attempts: tuple[UpstreamAttemptFields, ...] = ()
    if routed is not None:
        attempts, routed.traced = tuple(a.fields() for a in routed.attempts), True
    record = TurnRecord(call.run.run_id, chat.model, usage, cost, [*chat.messages, message],
                        finish == "stop" and not message.get("tool_calls"), finish, upstream,
                        checked.reported, governor.booking(adm, cost, usage.total_tokens), attempts,
                        tuple(r.to_json() for r in repairs))
    metrics = app[ctx.METRICS]
    metrics.on_tool_call_repairs(upstream, repairs)
    metrics.on_turn(call.team.name, call.policy.name, chat.model, usage, cost)
    metrics.on_usage_clamped(upstream, checked.clamped)
    span = request.get(ctx.CHAT_SPAN)
    started = time.perf_counter()
    try:
        run, ledger = await commit_turn_record(app, call.run, record)
    except StoreError as exc:
        app[ctx.RUN_CACHE].drop(call.run.run_id)
        if isinstance(exc, (StaleRun, RunNotFound)):
            raise
        run = await _spool(app, call.run, record, exc)
        call.run = run
        request[ctx.RUN] = run
        if span is not None:
            _on_span(span, record, answer, time.perf_counter() - started, message, response_model, spooled=True)
        return Booked(run, None, usage)
    if span is not None:
        _on_span(span, record, answer, time.perf_counter() - started, message, response_model)
    app[ctx.RUN_CACHE].put(run)  # the run as stored now: its next call need not load it
    call.run = run
    request[ctx.RUN] = run
    if record.completed:
        metrics.on_run_stopped(call.team.name, call.policy.name, "completed", "completed", run.turns, run.cost_usd)
    team = call.team
    left = governor.remaining(team, ledger) if ledger is not None else await governor.team_remaining(team)
    return Booked(run, left, usage)


def _on_span(span: ChatSpan, record: TurnRecord, answer: Answer | None, seconds: float, message: Message,
             response_model: str | None, spooled: bool = False) -> None:
    """The booked turn on the call's `chat {model}` span (tracing on)."""
    span.booked(usage=record.usage, cost_usd=record.cost_usd, finish=record.finish,
                upstream=answer.upstream if answer is not None else None,
                deployment=answer.model if answer is not None else record.model, response_model=response_model,
                seconds=seconds, spooled=spooled)
    span.output(message)


async def commit_turn_record(app: web.Application, run: RunState, record: TurnRecord) -> tuple[RunState, Ledger | None]:
    """Book `record` on `run` in one store step (`commit_run`), then append its trace lines to
    the trace file. A failure other than the store's being unreachable still books the spend."""
    governor = app[ctx.GOVERNOR]
    try:
        # Bookings of one run take turns here; between replicas, each round of revision
        # conflicts books at least one of the run's calls in flight, which are bounded.
        async with governor.run_lock(run.run_id):
            run, events, ledger = await commit_run(app[ctx.STORE], run.copy(), record.change(), record.trace,
                                                   record.booking,
                                                   attempts=app[ctx.CONFIG].defaults.max_calls_in_flight_per_run + 8)
    except BaseException as exc:
        if record.booking is not None and not _unreachable(exc):
            await _book_alone(governor.book, record.booking, exc)
        raise
    append_trace_file(app[ctx.CONFIG].trace_file, events)
    return run, ledger


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, (StaleRun, RunNotFound, AlreadyBooked))


async def _spool(app: web.Application, run: RunState, record: TurnRecord, exc: StoreError) -> RunState:
    """The store is unreachable after the upstream was paid: keep the turn durably in the
    spool and answer with the run as it will be once booked."""
    try:
        app[ctx.SPOOL].append(record.to_json())
    except StoreError:
        log.exception("cannot spool a turn of run %s ($%.9f): the store failed with %s", run.run_id,
                      record.cost_usd, exc)
        raise exc from None
    log.warning("run %s: the store failed (%s); its turn ($%.9f) is spooled until the store is back", run.run_id,
                exc, record.cost_usd)
    ahead = run.copy()
    record.change()(ahead)
    return ahead


async def replay_spool(app: web.Application) -> int:
    """Book every spooled turn, oldest first, exactly once; stops at the first that the store
    still cannot take. Returns how many were booked."""
    spool = app[ctx.SPOOL]
    done: set[str] = set()
    try:
        for data in spool.pending():
            record = TurnRecord.from_json(data)
            run = await app[ctx.STORE].load_run(record.run_id)
            try:
                if run is None:  # the run is gone: the money was spent all the same
                    if record.booking is not None:
                        await app[ctx.GOVERNOR].book(record.booking)
                else:
                    await commit_turn_record(app, run, record)
            except AlreadyBooked:
                pass  # booked before a crash kept it from being dropped
            done.add(str(data["id"]))
    except StoreError as exc:
        if not done:
            log.debug("the spool waits for the store: %s", exc)
    finally:
        spool.drop(done)
    return len(done)


async def _book_alone(book: Callable[[Booking], Awaitable[None]], booking: Booking, exc: BaseException) -> None:
    """The turn's save failed for good: book its spend anyway. A settle is idempotent, so it
    is safe whatever happened; a charge only when the store surely wrote nothing."""
    if booking.reservation_id is None and not isinstance(exc, (StaleRun, RunNotFound, Conflict)):
        return
    try:
        await book(booking)
    except Exception:
        log.exception("cannot book $%.9f of team %s after a failed turn save", booking.actual_usd, booking.team)
