"""The two ends of a governed pass-through call: refuse it, or book the turn it made.

Booking a turn settles the team reservation with the actual cost, saves the run (turns,
usage, cost, per-turn usage, last transcript) and appends the `turn` trace line, all in one
store step (`Store.commit_turn`, which also reports the team's ledger for the headers), then
writes the line to the trace file and counts the turn in the metrics, before the client sees
the answer's end, so the client's next call always meets the updated run. If that step
fails for good, the spend is still booked on its own: the money was spent upstream; if the
store cannot take it at all (unreachable, or its disk full), the turn waits in a local
durable spool (`spool_file`, with room set aside for it) with its reservation held, and is
booked, exactly once, when the store takes writes again (`keep_booking`, in the background).
The store's health (`ctx.STORE_HEALTH`) follows these writes: failing from the first that
fails, ok again from the first that succeeds (or a probe write, `probe_write`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
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
from gateway.server.http.errors import Conflict, LimitApprovalPending, LimitExceeded, limit_stop
from gateway.server.http.headers import run_headers
from gateway.server.runs.governor import Admission, Governor
from gateway.server.runs.keying import Call, add_turn, commit_run, stop_run
from gateway.server.runs.replies import checked_usage
from gateway.store import tracefile
from gateway.store.base import Booking, Event, Ledger
from gateway.store.spool import BOOKING_ONLY, booking_from_json, booking_json
from gateway.store.errors import AlreadyBooked, RunNotFound, StaleRun, StoreError

if TYPE_CHECKING:
    from gateway.telemetry.tracing import ChatSpan

log = logging.getLogger(__name__)

SPOOL_REPLAY_S = 1.0
"""How often the spool is looked at (`keep_booking`)."""


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
    """The run takes the refusal's status (once; a `LimitApprovalPending` finds the run
    waiting already); the 429 carries the run object and headers."""
    app = request.app
    status, reason, interruption = limit_stop(exc.kind)
    run = call.run
    asked = isinstance(exc, LimitApprovalPending) or run.waits_for_decision  # it stays asked
    if not asked and (run.status, run.reason) != (status, reason):
        detail = exc.message if reason in ("team_budget", "key_budget", "user_budget") else None

        def trace(r: RunState) -> list[Event]:
            return [Tracer(r.run_id)("run_stopped", status=status, reason=reason, turns=r.turns,
                                     costUsd=round(r.cost_usd, 9), detail=exc.message)]

        async with app[ctx.GOVERNOR].run_lock(run.run_id):
            run, events, _ = await commit_run(app[ctx.STORE], run, stop_run(status, reason, interruption, detail),
                                              trace, None)
        app[ctx.RUN_CACHE].put(run)
        append_trace_file(app[ctx.LIVE].config.trace_file, events)
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
                "booking": None if b is None else booking_json(b)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnRecord:
        b = data.get("booking")
        return cls(str(data["run_id"]), str(data["model"]), Usage.from_json(data["usage"]), float(data["cost_usd"]),
                   list(data["transcript"]), bool(data["completed"]), str(data["finish"]), str(data["upstream"]),
                   None if data.get("reported") is None else Usage.from_json(data["reported"]),
                   None if b is None else booking_from_json(b),
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
    If the store cannot take it (unreachable, or its disk full), the turn is written to the
    spool (booked when the store is back) and the call is answered with the run as it will be.
    """
    share = request.get(ctx.SHARE)
    cancelled = share is not None and not await share.take_for_booking()
    try:
        booked = await _book_turn(request, call, adm, reported, message, finish, routed, repairs, others,
                                  response_model)
    finally:
        if share is not None:  # the slot is the booking's alone, not the writing of the answer's end
            share.give_back()  # (a client reading slowly would hold its team's share)
    if cancelled:  # a cancel came while it waited for its slot: raised once the spend is booked
        raise asyncio.CancelledError
    return booked


async def _book_turn(request: web.Request, call: Call, adm: Admission, reported: Usage | None, message: Message,
                     finish: str, routed: RoutedCall | None, repairs: Sequence[Repair],
                     others: Sequence[Message], response_model: str | None) -> Booked:
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
        run = _spool(app, call.run, record, exc)
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
    the trace file. A failure other than the store's being unreachable still books the spend
    (into the spool, if the store cannot take that either)."""
    governor = app[ctx.GOVERNOR]
    health = app[ctx.STORE_HEALTH]
    try:
        # Bookings of one run take turns here; between replicas, each round of revision
        # conflicts books at least one of the run's calls in flight, which are bounded.
        async with governor.run_lock(run.run_id):
            run, events, ledger = await commit_run(app[ctx.STORE], run.copy(), record.change(), record.trace,
                                                   record.booking,
                                                   attempts=app[ctx.LIVE].config.defaults.max_calls_in_flight_per_run + 8)
    except BaseException as exc:
        if _unreachable(exc):
            health.fail(str(exc))
        elif record.booking is not None:
            await book_alone(governor, record.booking, exc)
        raise
    health.recover()
    append_trace_file(app[ctx.LIVE].config.trace_file, events)
    return run, ledger


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, (StaleRun, RunNotFound, AlreadyBooked))


def _spool(app: web.Application, run: RunState, record: TurnRecord, exc: StoreError) -> RunState:
    """The store failed after the upstream was paid: keep the turn durably in the spool, its
    reservation held, and answer with the run as it will be once booked."""
    app[ctx.GOVERNOR].keep(record.booking, record.to_json(), exc)
    ahead = run.copy()
    record.change()(ahead)
    return ahead


async def replay_spool(app: web.Application) -> int:
    """Book every spooled turn (and spend), oldest first, exactly once; stops at the first
    that the store still cannot take. Returns how many were booked."""
    spool = app[ctx.SPOOL]
    governor = app[ctx.GOVERNOR]
    done: dict[str, str | None] = {}  # record id -> its reservation
    try:
        for data in spool.pending():
            record = None if data.get("only") == BOOKING_ONLY else TurnRecord.from_json(data)
            booking = record.booking if record is not None else booking_from_json(data["booking"])
            try:
                if record is None:
                    if booking is not None:
                        await governor.book(booking)
                else:
                    run = await app[ctx.STORE].load_run(record.run_id)
                    if run is None:  # the run is gone: the money was spent all the same
                        if booking is not None:
                            await governor.book(booking)
                    else:
                        await commit_turn_record(app, run, record)
            except AlreadyBooked:
                pass  # booked before a crash kept it from being dropped
            done[str(data["id"])] = booking.reservation_id if booking is not None else None
    except StoreError as exc:
        if not done:
            log.debug("the spool waits for the store: %s", exc)
    finally:
        spool.drop(set(done))
        governor.booked([rid for rid in done.values() if rid is not None])
    if done:
        app[ctx.STORE_HEALTH].recover()
    return len(done)


async def keep_booking(app: web.Application) -> None:
    """Every `SPOOL_REPLAY_S`, until cancelled: records the spool could not write are written,
    its reserve checked and topped up, spooled spend booked as soon as the store takes it, and, while the
    store is failing with nothing spooled, a probe write tells when it takes writes again."""
    spool, governor, health = app[ctx.SPOOL], app[ctx.GOVERNOR], app[ctx.STORE_HEALTH]
    while True:
        try:
            spool.write_unwritten()
            spool.keep_reserve()  # every pass: another process sharing the spool may have used its room
            if spool.has_pending():
                booked = await replay_spool(app)
                if booked:
                    log.warning("booked %d spooled turns", booked)
            elif not health.ok:
                await probe_write(app)
            waiting = spool.reservations() if governor.spooled else set()
            governor.booked(governor.spooled - waiting)  # booked by another process sharing the spool
            app[ctx.METRICS].set_spooled(len(spool.pending()) if spool.has_pending() else 0)
        except StoreError as exc:
            log.debug("the spool waits: %s", exc)
        except Exception:
            log.exception("booking the spool failed")
        await asyncio.sleep(SPOOL_REPLAY_S)


async def probe_write(app: web.Application) -> None:
    """One small write (a lease of this process's own, taken and given back): the store's
    health recovers when it succeeds."""
    owner = app[ctx.GOVERNOR].owner or "gateway"
    store = app[ctx.STORE]
    try:
        await store.acquire_lease(f"probe:{owner}", owner, 5.0)
        await store.release_lease(f"probe:{owner}", owner)
    except StoreError as exc:
        app[ctx.STORE_HEALTH].fail(str(exc))
        return
    app[ctx.STORE_HEALTH].recover()


async def book_alone(governor: Governor, booking: Booking, exc: BaseException) -> None:
    """A call's save on its run failed with `exc` (a turn's for good, or embeddings' on a run):
    book its spend on the ledgers anyway, into the spool when the store cannot take it now
    (`Governor.book_surely`). A settle is idempotent, so it is safe whatever happened; a charge
    when the store refused the save (it wrote nothing) or could not be reached (like a
    spooled turn's), not when the call was cancelled mid-save (it may have been written)."""
    if booking.reservation_id is None and not (isinstance(exc, (StaleRun, RunNotFound, Conflict)) or _unreachable(exc)):
        return
    try:
        await governor.book_surely(booking)
    except Exception:
        log.exception("cannot book $%.9f of team %s after a failed save on its run", booking.actual_usd, booking.team)
