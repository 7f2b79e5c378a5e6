"""What the runs API reads from a request (query, headers, JSON bodies), checked and bounded.

Every refusal is a 400 `invalid_request_error` naming the parameter (`after`,
`Last-Event-ID`, `limit`, `max_turns`, ...); numbers are bounded before they reach the
store or the limits of a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

from gateway.harness.state import STATUSES, WHOLE_LIMITS, Amounts, LimitName
from gateway.server.http.errors import InvalidField
from gateway.server.http.validation import (
    INT64_MAX,
    optional_bool,
    optional_int,
    optional_number,
    optional_str,
    query_int,
    wrong_type,
)

MAX_RESUME_TURNS: Final = 1_000_000
MAX_BUDGET_USD: Final = 1_000_000.0
MAX_DURATION_S: Final = 10_000_000.0
MAX_REASON_CHARS: Final = 2_000
MAX_CALL_ID_CHARS: Final = 256
MAX_TEAM_CHARS: Final = 128
FOLLOW_VALUES: Final[Mapping[str, bool]] = {"": False, "0": False, "false": False, "1": True, "true": True}


def events_after(query: Mapping[str, str], headers: Mapping[str, str]) -> int:
    """The sequence number to read the trace after: `?after=` or else `Last-Event-ID` (SSE reconnects)."""
    raw = query.get("after")
    if raw:
        return query_int(raw, "after", 0, INT64_MAX)
    last = headers.get("Last-Event-ID")
    if last:
        return query_int(last.strip(), "Last-Event-ID", 0, INT64_MAX)
    return 0


def follow(query: Mapping[str, str]) -> bool:
    """`?follow=1|true` streams the trace as SSE; `0|false` or absent reads it once."""
    raw = query.get("follow", "")
    value = FOLLOW_VALUES.get(raw.lower())
    if value is None:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise InvalidField("follow", f"follow must be 1, true, 0 or false, got {shown!r}", "invalid_value")
    return value


@dataclass(frozen=True)
class ListQuery:
    """`GET /v1/runs?status=&team=&policy=&limit=`, checked."""

    status: str | None
    team: str | None
    limit: int
    policy: str | None = None


def list_query(query: Mapping[str, str], max_limit: int, default_limit: int = 100) -> ListQuery:
    """The listing's filters; unknown statuses, odd teams and limits out of 1..`max_limit` are 400."""
    status = query.get("status") or None
    if status is not None and status not in STATUSES:
        shown = status if len(status) <= 40 else status[:40] + "..."
        raise InvalidField("status", f"status must be one of {', '.join(STATUSES)}, got {shown!r}")
    team = query.get("team") or None
    if team is not None and (len(team) > MAX_TEAM_CHARS or not team.isprintable()):
        raise InvalidField("team", f"team must be a team name (at most {MAX_TEAM_CHARS} printable characters)")
    policy = query.get("policy") or None
    if policy is not None and (len(policy) > MAX_TEAM_CHARS or not policy.isprintable()):
        raise InvalidField("policy", f"policy must be a policy name (at most {MAX_TEAM_CHARS} printable characters)")
    raw_limit = query.get("limit")
    limit = default_limit if raw_limit is None else query_int(raw_limit, "limit", 1, max_limit)
    return ListQuery(status, team, limit, policy)


@dataclass(frozen=True)
class ApprovalInput:
    """`POST /v1/runs/{id}/approvals` body."""

    call_id: str
    decision: Literal["approve", "reject"]
    reason: str
    grant: Amounts | None = None
    """For a limit request: what to raise each limit by (None: the grant proposed)."""


GRANT_BOUNDS: Final[Mapping[LimitName, float]] = {
    "max_turns": MAX_RESUME_TURNS, "max_budget_usd": MAX_BUDGET_USD, "max_tool_calls": MAX_RESUME_TURNS,
    "max_duration_s": MAX_DURATION_S,
}


def grant_input(body: Mapping[str, Any]) -> Amounts | None:
    """`grant`: {limit name: a positive amount}, turns and tool calls whole, each bounded."""
    raw = body.get("grant")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise wrong_type("grant", "an object of limit name to amount", raw)
    if not raw:
        raise InvalidField("grant", "grant must name at least one limit to raise")
    out: Amounts = {}
    for key in raw:
        if key not in GRANT_BOUNDS:
            shown = key if len(key) <= 40 else key[:40] + "..."
            raise InvalidField(f"grant.{shown}", f"grant.{shown} is not a limit (expected "
                                                 f"{', '.join(GRANT_BOUNDS)})")
        name = cast(LimitName, key)
        high = GRANT_BOUNDS[name]
        if name in WHOLE_LIMITS:
            value: float | None = optional_int(raw, name, 1, int(high), f"grant.{name}")
        else:
            value = optional_number(raw, name, 0, high, f"grant.{name}")
            if value is not None and value <= 0:
                raise InvalidField(f"grant.{name}", f"grant.{name} must be > 0 and <= {high:g}, got {value:g}")
        if value is not None:
            out[name] = value
    return out


def approval_input(body: Mapping[str, Any]) -> ApprovalInput:
    """{"call_id", "decision": "approve"|"reject", "reason"?, "grant"?}."""
    call_id = body.get("call_id")
    if call_id is None:
        raise InvalidField("call_id", "call_id must be the id of the call the run waits for (a string)",
                           "missing_field")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidField("call_id", "call_id must be the id of the call the run waits for (a string)",
                           "invalid_type")
    optional_str(body, "call_id", max_len=MAX_CALL_ID_CHARS)
    verdict = body.get("decision")
    if verdict not in ("approve", "reject"):
        shown = repr(verdict) if isinstance(verdict, str) and len(verdict) <= 40 else "something else"
        raise InvalidField("decision", f"decision must be \"approve\" or \"reject\", got {shown}",
                           "missing_field" if verdict is None else "invalid_value")
    reason = optional_str(body, "reason", max_len=MAX_REASON_CHARS) or ""
    grant = grant_input(body)
    if grant is not None and verdict != "approve":
        raise InvalidField("grant", "grant goes with decision \"approve\" only")
    return ApprovalInput(call_id, "approve" if verdict == "approve" else "reject", reason, grant)


@dataclass(frozen=True)
class ResumeInput:
    """`POST /v1/runs/{id}/resume` body."""

    max_turns: int | None
    max_budget_usd: float | None
    stream: bool
    include_usage: bool
    max_tool_calls: int | None = None
    max_duration_s: float | None = None


def resume_input(body: Mapping[str, Any]) -> ResumeInput:
    """{"max_turns"?: 1..1e6, "max_budget_usd"?: > 0 and <= 1e6, "max_tool_calls"?: 1..1e6,
    "max_duration_s"?: > 0 and <= 1e7, "stream"?, "stream_options"?}."""
    max_turns = optional_int(body, "max_turns", 1, MAX_RESUME_TURNS)
    budget = optional_number(body, "max_budget_usd", 0, MAX_BUDGET_USD)
    if budget is not None and budget <= 0:
        raise InvalidField("max_budget_usd", f"max_budget_usd must be > 0 and <= {MAX_BUDGET_USD:g}, got {budget:g}")
    max_tool_calls = optional_int(body, "max_tool_calls", 1, MAX_RESUME_TURNS)
    duration = optional_number(body, "max_duration_s", 0, MAX_DURATION_S)
    if duration is not None and duration <= 0:
        raise InvalidField("max_duration_s", f"max_duration_s must be > 0 and <= {MAX_DURATION_S:g}, got {duration:g}")
    stream = bool(optional_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    include_usage = bool(optional_bool(options, "include_usage", "stream_options.include_usage")) if options else False
    return ResumeInput(max_turns, budget, stream, include_usage, max_tool_calls, duration)


def cancel_reason(body: Mapping[str, Any]) -> str | None:
    """{"reason"?: a string of at most MAX_REASON_CHARS}."""
    return optional_str(body, "reason", max_len=MAX_REASON_CHARS)
