"""Limit requests (policy `limits: {on_exceed: ask}`) decided over HTTP, kept in the store.

A server-side run's loop turns a limit it reached into a request (`gateway.harness.
limit_requests`); a pass-through call does it here. Every path of a request goes through
this module:

- `ask_passthrough`: a pass-through call refused at a limit that asks records the request
  on its run (once, however many of its calls are refused at the same moment, on however
  many replicas) and is answered 429 `limit_approval_pending`; `pending_refusal` answers
  the calls that come while the run waits.
- `decide`: an approver's verdict (`POST /v1/runs/{id}/approvals`). A grant is checked
  against `max_total`, then the decision, the raised limits, the `limit_granted` line and
  the audit log's `limit.granted` record (who raised what, from what to what) are saved in
  one store step, with the webhook notices they cause; the run stays `interrupted`,
  decided, until its resume (as after a call's decision). A rejection ends the run as the
  limit does (`limit_rejected`, `run_stopped` and `limit.rejected` in the same step). A
  decision sent after `approval.expires_after_s` is recorded as the expiry's rejection.
- `expire`: the expiry's rejection made by the recovery sweep.
Each path counts its lines in `gateway_limit_requests_total` (`Metrics.on_limit_lines`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.harness import limit_requests as requests
from gateway.harness.approvals import EXPIRY, ApprovalError
from gateway.harness.options import LimitAsk, Stop
from gateway.harness.state import Amounts, Decision, Interruption, LimitGrant, LimitName, RunState
from gateway.harness.trace import Event, TraceLink, Tracer
from gateway.policy.approval import duration_text, expired
from gateway.policy.decl import ApprovalConfig, Policy
from gateway.server import audit
from gateway.server import context as ctx
from gateway.server.http.errors import Conflict, InvalidField, LimitApprovalPending, LimitExceeded, LimitKind
from gateway.server.metrics import Metrics
from gateway.server.runs.keying import UPDATE_ATTEMPTS, Call, commit_run
from gateway.server.runs.run_spans import decided
from gateway.server.runs.tracelog import asked_at
from gateway.store import tracefile
from gateway.store.audit import AuditEntry
from gateway.store.base import Lease, Store
from gateway.store.errors import RunNotFound, StaleRun

LIMIT_KINDS: Final[Mapping[LimitName, LimitKind]] = {
    "max_turns": "max_turns_exceeded", "max_budget_usd": "budget_exceeded", "max_duration_s": "max_duration_exceeded",
    "max_tool_calls": "max_turns_exceeded",  # a pass-through run executes no tools: never asked for
}
KIND_LIMITS: Final[Mapping[str, LimitName]] = {kind: name for name, kind in LIMIT_KINDS.items()
                                               if name != "max_tool_calls"}
"""The run limit behind each refusal of a pass-through call (a team's budget is not a run's)."""
UNITS: Final[Mapping[LimitName, str]] = {"max_turns": "turns", "max_budget_usd": "USD", "max_tool_calls": "tool calls",
                                         "max_duration_s": "s"}


def approvers(policy: Policy | None) -> tuple[str, ...]:
    """The teams that may decide a limit request of `policy`'s runs (`limits.ask.approvers`,
    which default to `approval.approvers`)."""
    if policy is None:
        return ()
    return policy.limit_ask.approvers if policy.limit_ask is not None else policy.approval.approvers


def waits_on_limit(run: RunState) -> Interruption | None:
    """The limit request the run waits for, nobody having decided it yet."""
    waiting = run.waiting_request
    return waiting if waiting is not None and waiting.type == "limit" else None


def asks_budget(policy: Policy, run: RunState) -> bool:
    """Whether the run's budget asks a person before it is passed (its calls then fit whole)."""
    ask = policy.limit_ask
    return ask is not None and ask.asks("max_budget_usd") and run.limits.max_budget_usd is not None


def shown(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def describe(waiting: Interruption) -> str:
    """`max_turns (2 of 2 turns used)`."""
    name = waiting.limit or "a limit"
    if waiting.limit == "max_budget_usd":
        return f"max_budget_usd (${waiting.used or 0:.6f} of ${waiting.cap or 0:.6f} spent)"
    unit = UNITS.get(waiting.limit, "") if waiting.limit else ""
    return f"{name} ({shown(waiting.used)} of {shown(waiting.cap)} {unit} used)"


def pending_refusal(app: web.Application, run: RunState, policy: Policy) -> LimitApprovalPending:
    """The answer to a pass-through call of a run that waits for a grant: who may grant it, and where."""
    waiting = waits_on_limit(run)
    assert waiting is not None and waiting.limit is not None
    base = app[ctx.LIVE].config.server.public_url or app.get(ctx.SELF_URL) or ""
    who = ", ".join(approvers(policy)) or "an approver"
    return LimitApprovalPending(
        LIMIT_KINDS[waiting.limit],
        f"run {run.public_id} reached its {describe(waiting)} and waits for a person to grant more: a key of team "
        f"{who} decides limit request {waiting.call_id} with POST /v1/runs/{run.public_id}/approvals, "
        f"`gateway approvals approve {run.team}/{run.public_id} {waiting.call_id}`, or the console inbox "
        f"({base}/console/#/inbox); nothing was forwarded, and a retry is refused the same way until then")


def _stopped_line(tracer: Tracer, run: RunState, detail: str | None) -> Event:
    return tracer("run_stopped", status=run.status, reason=run.reason, turns=run.turns,
                  costUsd=round(run.cost_usd, 9), detail=detail)


async def ask_passthrough(app: web.Application, call: Call, exc: LimitExceeded) -> LimitExceeded | None:
    """A pass-through call refused at a run limit (`exc`): when the policy asks a person for
    that limit, the run records the request (status `interrupted`, reason `limit`, traced
    `limit_reached` and `run_stopped` in one store step) unless it waits for one already.

    Returns the refusal to answer with: `LimitApprovalPending` while a person is asked; `exc`
    when the limit stops the run as under `on_exceed: stop` (not asked, `max_grants` or
    `max_total` reached, or already stopped at it: rejected); None when the stored run's
    limits were raised since the call was judged, so it is admitted again."""
    ask = call.policy.limit_ask
    name = KIND_LIMITS.get(exc.kind)
    if ask is None or name is None or not ask.asks(name):
        return exc
    store = app[ctx.STORE]
    judged, run = call.run.limits, call.run
    for _ in range(UPDATE_ATTEMPTS):
        if waits_on_limit(run) is not None:
            call.run = run
            return pending_refusal(app, run, call.policy)
        if run.limits != judged:
            call.run = run
            return None
        if run.status not in ("running", "completed") and not run.decided:  # stopped at it (a person said no)
            call.run = run
            return exc
        status, reason, kind = requests.LIMIT_STOPS[name]
        reached = requests.reached(run, Stop(status, reason, exc.message, Interruption(kind)), ask, time.time())
        if reached is None:
            return exc
        attempt = run.copy()
        attempt.status, attempt.reason, attempt.interruption = (reached.stop.status, reached.stop.reason,
                                                                reached.stop.interruption)
        tracer = Tracer(run.run_id)
        events = [requests.reached_line(tracer, reached, len(run.grants)), _stopped_line(tracer, attempt, reached.stop.detail)]
        try:
            async with app[ctx.GOVERNOR].run_lock(run.run_id):
                await store.commit_turn(attempt, events)
        except StaleRun:
            fresh = await store.load_run(run.run_id)
            if fresh is None:
                raise RunNotFound(run.run_id) from None
            run = fresh
            continue
        app[ctx.RUN_CACHE].put(attempt)
        tracefile.append(app[ctx.LIVE].config.trace_file, events)
        metrics = app[ctx.METRICS]
        metrics.on_limit_lines(call.policy.name, events)
        metrics.on_run_stopped(call.team.name, call.policy.name, attempt.status, attempt.reason or "", attempt.turns,
                               attempt.cost_usd)
        call.run = attempt
        if reached.asked:
            app[ctx.DRIVER].approvals_changed()
            return pending_refusal(app, attempt, call.policy)
        return LimitExceeded(exc.kind, reached.stop.detail)
    raise Conflict(f"run {run.public_id} is being changed by too many calls at once; retry", code="run_contended",
                   headers={"x-should-retry": "true", "retry-after": "1"})


def checked_grant(run: RunState, waiting: Interruption, ask: LimitAsk | None, given: Amounts | None) -> Amounts:
    """The grant to apply: `given` (an approver's own, smaller or larger) or the one proposed;
    it must raise the limit that was reached and keep every limit within `max_total`."""
    amounts: Amounts = dict(given) if given is not None else dict(waiting.grant or {})
    name = waiting.limit
    assert name is not None
    if name not in amounts:
        raise InvalidField(f"grant.{name}", f"run {run.public_id} waits on its {name}: a grant must raise it "
                                            f"(grant.{name})")
    for limit, add in amounts.items():
        cap = run.limits.value(limit)
        if cap is None:
            raise InvalidField(f"grant.{limit}", f"run {run.public_id} has no {limit} to raise")
        total = ask.max_total.get(limit) if ask is not None else None
        if total is not None and cap + add > total + 1e-9:
            raise InvalidField(f"grant.{limit}", f"grant.{limit} {add:g} would raise {limit} from {cap:g} to "
                                                 f"{cap + add:g}, past limits.ask.max_total.{limit} ({total:g}): "
                                                 f"grant at most {max(total - cap, 0):g}")
    return amounts


def expiry_decision(config: ApprovalConfig) -> Decision:
    """The rejection recorded for a limit request nobody decided within `expires_after_s`."""
    after = duration_text(config.expires_after_s) if config.expires_after_s is not None else "its deadline"
    return Decision("reject", f"Nobody decided on this limit request within {after}, so it expired.",
                    EXPIRY)


def decision_json(call_id: str, decision: Decision, expired_: bool, limit: LimitName | None,
                  made: LimitGrant | None) -> dict[str, Any]:
    """The `decision` object of the approvals answer for a limit request."""
    out: dict[str, Any] = {"call_id": call_id, **decision.to_json(), "expired": expired_, "kind": "limit",
                           "limit": limit}
    if made is not None:
        out.update(grant=dict(made.grant), before=dict(made.before), after=dict(made.after))
    return out


async def decide(app: web.Application, run: RunState, policy: Policy, team: TeamConfig, call_id: str, verdict: str,
                 reason: str, given: Amounts | None) -> tuple[RunState, dict[str, Any]]:
    """Record the verdict of approver `team` (a view: its key) on limit request `call_id` in
    one store step, with its audit record (see the module's docstring); returns the run as
    saved and the decision's JSON."""
    store = app[ctx.STORE]
    asked = await asked_at(store, run, call_id)
    late = asked is not None and expired(asked, time.time(), policy.approval)
    decision = expiry_decision(policy.approval) if late else Decision(
        "approve" if verdict == "approve" else "reject", reason, team.name)
    made: list[LimitGrant] = []
    limit: list[LimitName] = []
    now = time.time()
    asking = run.interruption
    link = decided(app.get(ctx.TRACING), team, run.public_id, call_id, decision, expired=late,
                   limit=asking.limit if asking is not None and asking.call_id == call_id else None)

    def change(state: RunState) -> None:
        made.clear()
        limit.clear()
        try:
            waiting = requests.waiting_limit(state, call_id)
        except ApprovalError as exc:
            raise Conflict(str(exc), code="not_waiting_for_call") from None
        assert waiting.limit is not None
        limit.append(waiting.limit)
        if decision.decision == "reject":
            requests.refuse(state, call_id, decision)
            return
        amounts = checked_grant(state, waiting, policy.limit_ask, given)
        made.append(requests.grant(state, call_id, decision, amounts, now))

    def trace(state: RunState) -> list[Event]:
        return _decision_lines(state, call_id, limit[0], decision, made[0] if made else None, late, link)

    def recorded(state: RunState) -> list[AuditEntry]:
        return [audit_entry(team, state, call_id, limit[0], decision, made[0] if made else None, late)]

    # The decision, its trace lines and its audit record in one store step.
    run, events, _ = await commit_run(store, run, change, trace, None, audit=recorded)
    tracefile.append(app[ctx.LIVE].config.trace_file, events)
    metrics = app[ctx.METRICS]
    metrics.on_limit_lines(policy.name, events)
    if not made:
        metrics.on_run_stopped(run.team, policy.name, run.status, run.reason or "", run.turns, run.cost_usd)
    return run, decision_json(call_id, decision, late, limit[0] if limit else None, made[0] if made else None)


def audit_entry(team: TeamConfig, run: RunState, call_id: str, limit: LimitName, decision: Decision,
                made: LimitGrant | None, late: bool) -> AuditEntry:
    """The audit record of a decision on a limit request: `limit.granted` with each raised
    limit as `[old, new]` (`audit.changed`), or `limit.rejected` with the limit as it stays."""
    details: dict[str, Any] = {"call_id": call_id, "limit": limit, "reason": decision.reason, "expired": late}
    if made is not None:
        details.update(audit.changed(requests.plain(made.before), requests.plain(made.after)),
                       grant=requests.plain(made.grant))
        return audit.entry(team, audit.LIMIT_GRANTED, run.public_id, concerns=run.team, details=details)
    details[limit] = [run.limits.value(limit)] * 2
    return audit.entry(team, audit.LIMIT_REJECTED, run.public_id, concerns=run.team, details=details)


def _decision_lines(state: RunState, call_id: str, limit: LimitName, decision: Decision, made: LimitGrant | None,
                    late: bool, link: TraceLink | None = None) -> list[Event]:
    tracer = Tracer(state.run_id)
    if made is not None:
        return [tracer("limit_granted", callId=call_id, limit=limit, grant=requests.plain(made.grant),
                       before=requests.plain(made.before), after=requests.plain(made.after), by=made.by,
                       reason=made.reason, **(link or {}))]
    detail = state.interruption.reason if state.interruption is not None else None
    return [tracer("limit_rejected", callId=call_id, limit=limit, reason=decision.reason, by=decision.by,
                   expired=late), _stopped_line(tracer, state, detail)]


async def expire(store: Store, run: RunState, policy: Policy, trace_file: Any,
                 metrics: Metrics | None, *, lease: Lease | None = None) -> RunState:
    """The recovery sweep's rejection of a limit request nobody decided in time (the caller
    holds the run's lease, `lease`, which fences the write, and loaded `run` fresh): the run
    ends as the limit does."""
    waiting = waits_on_limit(run)
    if waiting is None or waiting.call_id is None or waiting.limit is None:
        raise ApprovalError(f"run {run.public_id} waits for no limit request")
    decision = expiry_decision(policy.approval)
    requests.refuse(run, waiting.call_id, decision)
    events = _decision_lines(run, waiting.call_id, waiting.limit, decision, None, True)
    await store.commit_turn(run, events, lease=lease)
    tracefile.append(trace_file, events)
    if metrics is not None:
        metrics.on_limit_lines(policy.name, events)
        metrics.on_run_stopped(run.team, policy.name, run.status, run.reason or "", run.turns, run.cost_usd)
    return run
