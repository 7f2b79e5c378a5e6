"""Limits that ask a person (`on_exceed: ask`): a limit reached becomes a request, a grant raises it.

A run whose next step would pass a limit stops (`stops.py`). When its policy asks a person
for that limit (`LimitAsk.asks`), `reached` turns the stop into a request: the run is
`interrupted`, reason `limit`, with an interruption of type `limit` naming the limit, what
the run used of it, the cap and the grant proposed (the policy's, each amount cut so that
no limit passes `max_total`). After `max_grants` grants, or when the limit reached has no
room left under `max_total`, the stop stands, as under `on_exceed: stop`.

A decision is data, as for a call (`approvals.py`): `grant` raises exactly the limits the
grant names and records who, when, and each limit before and after (`RunState.grants`),
and, like a call's decision, leaves the run `interrupted` until a resume drives it
(`RunState.decided`, `waiting_for: resume`); `refuse` ends the run with the limit's own
status, the person's words in its interruption.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final

from gateway.harness.approvals import EXPIRY, ApprovalError
from gateway.harness.trace import Event, Tracer
from gateway.harness.options import LimitAsk, Stop, StopReason
from gateway.harness.state import (
    WHOLE_LIMITS,
    Amounts,
    Decision,
    Interruption,
    InterruptionType,
    LimitGrant,
    LimitName,
    Limits,
    RunState,
    Status,
)

LIMIT_STOPS: Final[Mapping[LimitName, tuple[Status, StopReason, InterruptionType]]] = {
    "max_turns": ("max_turns_exceeded", "max_turns", "max_turns"),
    "max_budget_usd": ("budget_exceeded", "max_budget", "max_budget"),
    "max_tool_calls": ("max_tool_calls_exceeded", "max_tool_calls", "max_tool_calls"),
    "max_duration_s": ("max_duration_exceeded", "max_duration", "max_duration"),
}
"""The status, reason and interruption a limit ends a run with (as `on_exceed: stop` does)."""
STOP_LIMITS: Final[Mapping[str, LimitName]] = {reason: name for name, (_, reason, _) in LIMIT_STOPS.items()}
"""The limit behind each stop reason of a limit."""


def limit_name(reason: str | None) -> LimitName | None:
    """The limit a stop reason names (`max_budget` -> `max_budget_usd`), else None."""
    return STOP_LIMITS.get(reason or "")


def figure(name: LimitName, value: float) -> float:
    """`value` as limit `name` counts it (turns and tool calls whole)."""
    return int(value) if name in WHOLE_LIMITS else float(value)


def room(limits: Limits, ask: LimitAsk, name: LimitName) -> float | None:
    """How far limit `name` may still be raised under `max_total` (None: no bound)."""
    total, cap = ask.max_total.get(name), limits.value(name)
    if total is None or cap is None:
        return None
    return max(0.0, total - cap)


def proposed(limits: Limits, ask: LimitAsk) -> Amounts:
    """The grant to propose: the policy's, each amount cut to the room `max_total` leaves
    (a limit with no room, or with no cap to raise, is left out)."""
    out: Amounts = {}
    for name, amount in ask.grant.items():
        if limits.value(name) is None:
            continue
        left = room(limits, ask, name)
        amount = amount if left is None else min(amount, left)
        if amount > 0:
            out[name] = figure(name, amount)
    return out


@dataclass(frozen=True)
class Reached:
    """A limit the policy asks about was reached: the stop to make (a request when `asked`)."""

    stop: Stop
    asked: bool
    limit: LimitName
    used: float
    cap: float
    grant: Amounts


def plain(amounts: Amounts) -> dict[str, float]:
    """Figures by limit as a trace line or an answer carries them."""
    return {str(name): value for name, value in amounts.items()}


def reached_line(tracer: Tracer, reached: Reached, grants: int) -> Event:
    """The `limit_reached` line of `reached` (`grants`: the grants the run had before)."""
    waiting = reached.stop.interruption
    return tracer("limit_reached", callId=waiting.call_id if reached.asked and waiting else None,
                  limit=reached.limit, used=reached.used, cap=reached.cap, grant=plain(reached.grant), grants=grants,
                  asked=reached.asked, detail=reached.stop.detail)


def new_request_id() -> str:
    return "lim_" + uuid.uuid4().hex[:24]


def reached(state: RunState, stop: Stop, ask: LimitAsk, now: float) -> Reached | None:
    """What `stop` becomes under `ask`: a limit request, or (no grant left) the stop itself
    with words saying why nobody is asked; None when `stop` is not a limit `ask` covers."""
    name = limit_name(stop.reason)
    cap = state.limits.value(name) if name is not None else None
    if name is None or cap is None or not ask.asks(name):
        return None
    used = figure(name, state.used(name, now))
    grant = proposed(state.limits, ask)
    why = ""
    if ask.max_grants is not None and len(state.grants) >= ask.max_grants:
        why = f"no more grants: the run had {len(state.grants)} (limits.ask.max_grants)"
    elif name not in grant:
        why = f"its {name} is at limits.ask.max_total ({ask.max_total.get(name, cap):g})"
    if why:
        return Reached(replace(stop, detail=f"{stop.detail}; {why}" if stop.detail else why), False, name, used,
                       cap, grant)
    interruption = Interruption("limit", new_request_id(), reason=stop.detail, limit=name, used=used, cap=cap,
                                grant=grant)
    return Reached(Stop("interrupted", "limit", f"{stop.detail}; it waits for a person to grant more", interruption),
                   True, name, used, cap, grant)


def waiting_limit(state: RunState, call_id: str) -> Interruption:
    """The limit request `call_id` the run waits for; ApprovalError if it waits for no such one."""
    waiting = state.interruption
    if state.status != "interrupted" or waiting is None or waiting.type != "limit" or waiting.limit is None:
        raise ApprovalError(f"run {state.public_id} is not waiting for a limit request (status {state.status})")
    if waiting.call_id != call_id:
        raise ApprovalError(f"limit request {call_id!r} is not pending in run {state.public_id}")
    if call_id in state.decisions:
        raise ApprovalError(f"limit request {call_id!r} was already decided")
    return waiting


def grant(state: RunState, call_id: str, decision: Decision, amounts: Amounts, at: float) -> LimitGrant:
    """Raise the run's limits by `amounts` (approved as `decision`) and record it. As after a
    call's decision (`approvals.decide`), the run stays `interrupted`, decided (`waiting_for:
    resume`), until a resume drives it: its owner's, its client's next call, or the gateway's
    under `on_decision: resume`."""
    waiting_limit(state, call_id)
    before: Amounts = {n: cap for n in amounts if (cap := state.limits.value(n)) is not None}
    state.limits = state.limits.raised(amounts)
    after: Amounts = {n: cap for n in before if (cap := state.limits.value(n)) is not None}
    record = LimitGrant(call_id, decision.by, at, dict(amounts), before, after, decision.reason)
    state.grants.append(record)
    state.decisions[call_id] = decision
    return record


def refusal_text(limit: LimitName, cap: float | None, reason: str, by: str) -> str:
    """Why a run that asked for more of a limit ended: what the person (or the expiry) said."""
    shown = f" ({cap:g})" if cap is not None else ""
    if by == EXPIRY:
        why = f" {reason.strip()}" if reason.strip() else ""
        return f"Nobody granted more than its {limit}{shown} in time, so the run stopped.{why}"
    why = f": {reason.strip()}" if reason.strip() else ""
    return f"A person ({by or 'an approver'}) declined to raise its {limit}{shown}{why}"


def refuse(state: RunState, call_id: str, decision: Decision) -> None:
    """Record a rejection: the run ends as the limit ends it (its status, its reason), the
    person's words in the interruption (and so in the run's answer)."""
    waiting = waiting_limit(state, call_id)
    assert waiting.limit is not None
    state.decisions[call_id] = decision
    status, reason, kind = LIMIT_STOPS[waiting.limit]
    state.status, state.reason = status, reason
    state.interruption = Interruption(kind, reason=refusal_text(waiting.limit, waiting.cap, decision.reason,
                                                                decision.by))

