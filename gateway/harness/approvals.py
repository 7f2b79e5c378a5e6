"""Approvals as data: a person's decision is recorded in the run, then the loop goes on.

An approval is not a callback: between the stop and the verdict the process may be gone.
`decide` records the verdict in the state; the next `run` drains the pending call, which
now runs (approved) or gets the rejection written into the transcript in words.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.harness.state import Decision, Limits, RunState, pending


class ApprovalError(ValueError):
    """A decision that does not fit the run (no such pending call, already decided, ...)."""


def describe_call(name: str, args: Any) -> str:
    rendered = args if isinstance(args, str) else orjson.dumps(args).decode()
    return f"{name}({rendered})"


EXPIRY = "approval-expiry"
"""`Decision.by` of a rejection made because nobody decided in time."""


def rejection_text(name: str, args: Any, reason: str, by: str = "") -> str:
    """What the model reads when a person said no. Never empty: silence reads as success."""
    if by == EXPIRY:
        why = f" {reason.strip()}" if reason.strip() else ""
        return (f"Nobody approved the call {describe_call(name, args)} in time, so it was rejected. It was not "
                f"run and nothing was done.{why}")
    why = f" The reviewer said: {reason.strip()}" if reason.strip() else ""
    return (f"A person declined the call {describe_call(name, args)}. It was not run and nothing "
            f"was done.{why}")


def denial_text(name: str, args: Any, reason: str) -> str:
    """What the model reads when the approval policy denies a call outright."""
    why = f" Reason: {reason.strip()}" if reason.strip() else ""
    return f"The policy denied the call {describe_call(name, args)}. It was not run and nothing was done.{why}"


def decide(state: RunState, call_id: str, decision: Decision) -> None:
    """Record a verdict on a call the run is waiting for.

    The run stays `interrupted` (its `waiting_for` turns from `decision` to `resume`): it
    goes on when it is resumed (by its owner, its client's next call, or the gateway under
    `on_decision: resume`), which makes it `running` under the run's lease. Recovery takes
    a `running` server-side run nobody drives for a crash, so no decision may make one."""
    interruption = state.interruption
    if state.status != "interrupted" or interruption is None or interruption.type != "approval":
        raise ApprovalError(f"run {state.public_id} is not waiting for an approval (status {state.status})")
    waiting = {c.get("id") for c in pending(state)}
    if call_id not in waiting:
        raise ApprovalError(f"call {call_id!r} is not pending in run {state.public_id}")
    if call_id in state.decisions:
        raise ApprovalError(f"call {call_id!r} was already decided")
    state.decisions[call_id] = decision


def resume(state: RunState, limits: Limits | None = None) -> None:
    """Make a stopped-but-resumable run `running` again, optionally with raised limits."""
    if not state.resumable:
        raise ApprovalError(f"run {state.public_id} ended with status {state.status} and cannot be resumed")
    waiting = state.waiting_request
    if waiting is not None:
        what = f"call {waiting.call_id}" if waiting.type == "approval" else \
            f"its {waiting.limit} (limit request {waiting.call_id})"
        raise ApprovalError(f"run {state.public_id} waits for a decision on {what}")
    if limits is not None:
        state.limits = limits
    state.status, state.reason, state.interruption, state.error = "running", None, None, None
