"""Who may do what with a run: one table, checked by the runs API.

| caller \\ action | read, list, events | decide an approval | resume (raise limits) | cancel |
|-----------------|--------------------|--------------------|-----------------------|--------|
| owning team     | yes                | only if the policy names no approvers | yes  | yes    |
| approver        | yes                | yes                | 403                   | 403    |
| admin team      | yes                | only if also an approver | yes             | yes    |
| any other team  | 404                | 404                | 404                   | 404    |

An approver is a team named in the run's policy's `approval.approvers` (or, for limit
requests, `limits.ask.approvers`): it reviews calls and limits, so it sees the runs it can
decide and decides, nothing more. Resuming (which may raise the
run's limits, charged to the owning team's budget) and cancelling steer the run, which
belongs to its team; admin teams (`admin: true`) may steer any run, as operators. A team
that may not see a run gets the same 404 as for a run that does not exist; a team that
sees it but may not steer it gets 403 saying what it may do.
"""

from __future__ import annotations

from typing import Literal

from gateway.config.settings import TeamConfig
from gateway.harness.state import RunState
from gateway.policy.approval import can_decide
from gateway.policy.decl import Policy
from gateway.server.http.errors import Forbidden
from gateway.server.notify.message import RequestKind
from gateway.server.runs.limit_requests import approvers as limit_approvers

Role = Literal["owner", "approver", "admin", "other"]
Steer = Literal["resume", "cancel"]


def is_approver(team: str, policy: Policy) -> bool:
    """Whether `team` decides some of `policy`'s requests: its tool calls or its limits."""
    return team in policy.approval.approvers or team in limit_approvers(policy)


def roles(team: TeamConfig, run: RunState, policy: Policy | None) -> frozenset[Role]:
    """Every role `team` holds towards `run` (empty: it may not even see the run)."""
    held: set[Role] = set()
    if run.team == team.name:
        held.add("owner")
    if policy is not None and is_approver(team.name, policy):
        held.add("approver")
    if team.admin:
        held.add("admin")
    return frozenset(held)


def may_see(team: TeamConfig, run: RunState, policy: Policy | None) -> bool:
    """Owner, approver or admin: the run exists for this caller."""
    return bool(roles(team, run, policy))


def may_decide(team: TeamConfig, run: RunState, policy: Policy | None, kind: RequestKind = "tool_call") -> bool:
    """Calls: the policy's approvers (or, when it names none, the owning team). Limit
    requests: `limits.ask.approvers` only (a policy that asks always names some): the team
    that owns the run does not raise its own limits this way unless it is one of them."""
    if policy is None:
        return False
    if kind == "limit":
        return team.name in limit_approvers(policy)
    return can_decide(policy.approval, team.name, run.team)


def request_kind(run: RunState) -> RequestKind:
    """What the run waits for a person on: a tool call, or a limit request."""
    waiting = run.interruption
    return "limit" if waiting is not None and waiting.type == "limit" else "tool_call"


def may_steer(team: TeamConfig, run: RunState) -> bool:
    """Resume (with or without raised limits) and cancel: the owning team and admin teams."""
    return run.team == team.name or team.admin


def require_steer(team: TeamConfig, run: RunState, action: Steer) -> None:
    """403 `not_run_owner` unless `team` may resume or cancel `run` (call after `may_see`)."""
    if may_steer(team, run):
        return
    raise Forbidden(f"team '{team.name}' may not {action} run {run.public_id}: it may see the run and decide its "
                    f"approvals, but resuming and cancelling belong to the run's team '{run.team}' and to admin teams",
                    code="not_run_owner")
