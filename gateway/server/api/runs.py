"""The runs API: list, read, trace, approve, resume and cancel runs.

| route                            | does                                                     |
| GET  /v1/runs?status=&team=&policy= | runs visible to the caller                            |
| GET  /v1/runs/{id}               | the run with its transcript                              |
| GET  /v1/runs/{id}/events        | its trace as JSONL (`?follow=1`: SSE until it stops)     |
| POST /v1/runs/{id}/approvals     | approve or reject the call (or limit request: grant more) |
|                                  | it waits for (approvers only)                            |
|                                  | (policy `on_decision: resume`: the run then goes on)     |
| POST /v1/runs/{id}/resume        | continue it; answers like chat completions               |
| POST /v1/runs/{id}/cancel        | stop it within milliseconds, tools included              |

Who may do what is `gateway.server.api.access`'s table: the owning team and admin teams
see and steer (resume, cancel) a run, approvers see it and decide; any other caller gets
the same 404 as for a run that does not exist.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.harness.approvals import ApprovalError, decide
from gateway.harness.state import Decision, Interruption, RunState, scoped_run_id
from gateway.harness.trace import Event, StartSetup, Tracer, with_run_id
from gateway.policy.approval import expired, expiry_decision
from gateway.policy.decl import Policy
from gateway.server import audit
from gateway.server import context as ctx
from gateway.store.audit import AuditEntry
from gateway.server.api.access import is_approver, may_decide, may_see, request_kind, require_steer
from gateway.server.api.runs_input import (
    ApprovalInput,
    approval_input,
    cancel_reason,
    events_after,
    follow,
    list_query,
    resume_input,
)
from gateway.server.chat.server_side import answer
from gateway.server.http.errors import Conflict, Forbidden, InvalidField, NotFound
from gateway.server.http.headers import run_headers
from gateway.server.http.sse import ClientGone, SSEStream
from gateway.server.http.validation import check_depth, json_object, read_body
from gateway.server.runs.auto_resume import (
    BACKGROUND,
    FOLLOW_POLL_S,
    RESUMED_BY,
    after_decision,
    follow_until_stopped,
    resume_decided,
)
from gateway.server.runs.cancels import RunBusy, cancel_event
from gateway.server.runs import limit_requests
from gateway.server.runs.continuations import resume_with
from gateway.server.runs.driver import Audited, Prepare
from gateway.server.runs.booking import append_trace_file
from gateway.server.runs.keying import commit_run, stop_run
from gateway.server.runs.run_spans import decided
from gateway.server.runs.tracelog import asked_at
from gateway.store.base import Lease

CANCEL_WAIT_S: Final = 5.0
LIST_SCAN: Final = 1000
"""Runs read per listing before the visibility filter (approvers see other teams' runs)."""




def run_policy(app: web.Application, run: RunState) -> Policy | None:
    """The policy governing `run` (`PolicyRegistry.for_run`), None when none is loaded."""
    policies = app[ctx.POLICIES]
    return policies.for_run(run.policy, run.policy_version)


def visible(app: web.Application, run: RunState, team: TeamConfig) -> bool:
    """Whether `team` may see `run` at all (`run_access.may_see`)."""
    return may_see(team, run, run_policy(app, run))


async def run_for(request: web.Request) -> tuple[TeamConfig, RunState]:
    """The caller's team and the run of the path, or 404 if the caller may not see it.

    Run ids are per team: `{id}` is the caller's own run of that id if it has one; else,
    for approvers and admins, the one run of that id among the teams whose runs they may
    see (`?team=NAME` picks the team when several have one, which is a 409 otherwise).
    """
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    run_id = request.match_info["id"]
    store = app[ctx.STORE]
    config = app[ctx.LIVE].config
    owner = request.query.get("team")
    if owner is not None and config.team(owner) is None:
        raise NotFound(f"run {run_id} not found (no team named {owner!r})", code="run_not_found", param="team")
    run = None
    if owner in (None, team.name):
        run = await store.load_run(scoped_run_id(team.name, run_id))
    if run is None and _reviews_others(app, team):
        names = [owner] if owner not in (None, team.name) else [t.name for t in config.teams if t.name != team.name]
        found = [r for r in [await store.load_run(scoped_run_id(n, run_id)) for n in names if n is not None]
                 if r is not None and visible(app, r, team)]
        if len(found) > 1:
            teams = ", ".join(sorted(r.team for r in found))
            raise Conflict(f"teams {teams} each have a run {run_id}; say which with ?team=NAME",
                           code="run_ambiguous", param="team")
        run = found[0] if found else None
    if run is None:
        raise NotFound(f"run {run_id} not found", code="run_not_found")
    request[ctx.RUN] = run
    return team, run


def _reviews_others(app: web.Application, team: TeamConfig) -> bool:
    """Whether `team` may see other teams' runs at all (an admin, or a policy's approver)."""
    policies = app[ctx.POLICIES]
    return team.admin or any(is_approver(team.name, p)
                             for name in policies.names() if (p := policies.get(name)) is not None)


def public_event(run: RunState, event: Event) -> Event:
    """A trace line as the API shows it: run ids as the client knows them."""
    rid = event.get("runId")
    if isinstance(rid, str) and rid.startswith(run.team + "/"):
        return with_run_id(event, rid[len(run.team) + 1:])
    return event


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request, request.app[ctx.LIVE].config.server.max_body_bytes)
    if not raw.strip():
        return {}  # these bodies are all optional
    body = json_object(raw, "a JSON object")
    check_depth(body)
    return body


def run_json(run: RunState, *, transcript: bool = False) -> dict[str, Any]:
    """The run as the API shows it; `transcript` adds its messages."""
    out: dict[str, Any] = {
        "object": "run", **run.summary(), "team": run.team, "policy": run.policy,
        "policy_version": run.policy_version, "model": run.model, "limits": run.limits.to_json(),
        "error": run.error, "decisions": {cid: d.to_json() for cid, d in run.decisions.items()},
        "grants": [g.to_json() for g in run.grants],
        "created_at": run.created_at, "updated_at": run.updated_at,
    }
    if transcript:
        out["per_turn"] = [u.to_json() for u in run.per_turn]
        out["transcript"] = run.messages
    return out


def _json(data: Any, status: int = 200, run: RunState | None = None) -> web.Response:
    """A JSON answer; about one run, it carries the run's X-Run-* headers too."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=run_headers(run) if run is not None else None)


async def list_runs(request: web.Request) -> web.Response:
    """GET /v1/runs?status=&team=&policy=&limit=: newest first."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    query = list_query(request.query, LIST_SCAN)
    status, team, limit = query.status, query.team, query.limit
    scan = limit if team == caller.name and query.policy is None else LIST_SCAN
    runs = await app[ctx.STORE].list_runs(team=team, status=status, limit=scan)
    data = [run_json(r) for r in runs
            if visible(app, r, caller) and (query.policy is None or r.policy == query.policy)][:limit]
    return _json({"object": "list", "data": data})


async def get_run(request: web.Request) -> web.Response:
    """GET /v1/runs/{id}: status, turns, cost, usage, interruption, transcript."""
    _, run = await run_for(request)
    return _json(run_json(run, transcript=True), run=run)


async def run_events(request: web.Request) -> web.StreamResponse:
    """GET /v1/runs/{id}/events[?after=N][&follow=1]."""
    _, run = await run_for(request)
    after = events_after(request.query, request.headers)
    store = request.app[ctx.STORE]
    if not follow(request.query):
        lines = b"".join(orjson.dumps(public_event(run, e)) + b"\n" for _, e in await store.events(run.run_id, after))
        return web.Response(body=lines, content_type="application/x-ndjson")
    sse = await SSEStream.open(request)

    async def emit(seq: int, event: Event) -> None:
        await sse.data(public_event(run, event), id=seq)

    try:
        current = await follow_until_stopped(store, lambda r: run_policy(request.app, r), run, after, emit,
                                             lambda: sse.comment("waiting"), sse.pause)
        if not sse.ending:  # else the gateway is shutting down: the client follows on from Last-Event-ID
            await sse.data(current.summary(), event="end")
    except ClientGone:
        return sse.response
    await sse.close()
    return sse.response


async def post_approval(request: web.Request) -> web.Response:
    """POST /v1/runs/{id}/approvals {"call_id", "decision": "approve"|"reject", "reason"}."""
    app = request.app
    team, run = await run_for(request)
    policy = run_policy(app, run)
    kind = request_kind(run)
    if policy is None or not may_decide(team, run, policy, kind):
        if kind == "limit":
            who = ", ".join(limit_requests.approvers(policy)) or "none"
            raise Forbidden(f"team '{team.name}' may not grant more to runs of policy '{run.policy}' (limit "
                            f"approvers: {who}); the run's own team raises its limits only by resuming it",
                            code="not_an_approver")
        approvers = ", ".join(policy.approval.approvers) if policy else "unknown"
        raise Forbidden(f"team '{team.name}' may not decide calls of policy '{run.policy}' (approvers: {approvers})",
                        code="not_an_approver")
    given = approval_input(await _body(request))
    call_id, verdict, reason = given.call_id, given.decision, given.reason
    if kind == "limit":
        return await _decide_limit(request, team, run, policy, given)
    if given.grant is not None:
        raise InvalidField("grant", f"run {run.public_id} waits for a decision on a call, not on a limit: a grant "
                                    "goes with a limit request only")
    store = app[ctx.STORE]
    asked = await asked_at(app[ctx.STORE], run, call_id)
    late = asked is not None and expired(asked, time.time(), policy.approval)
    decision = expiry_decision(policy.approval) if late else Decision(verdict, reason, team.name)
    waiting = run.interruption

    def change(state: RunState) -> None:
        try:
            decide(state, call_id, decision)
        except ApprovalError as exc:
            raise Conflict(str(exc), code="not_waiting_for_call") from None

    link = decided(app.get(ctx.TRACING), team, run.public_id, call_id, decision,
                   tool=waiting.tool_name if waiting else None, expired=late)

    def trace(state: RunState) -> list[Event]:
        return [Tracer(state.run_id)(
            "approval_decided", callId=call_id, toolName=waiting.tool_name if waiting else None,
            args=waiting.args if waiting else None, decision=decision.decision, reason=decision.reason,
            by=decision.by, expired=late, **link)]

    def recorded(state: RunState) -> list[AuditEntry]:
        return [audit.entry(team, audit.APPROVAL_DECIDED, state.public_id, concerns=state.team, details={
            "call_id": call_id, "tool": waiting.tool_name if waiting else None, "decision": decision.decision,
            "reason": decision.reason, "expired": late})]

    # The decision, its trace line and its audit record in one store step.
    run, lines, _ = await commit_run(store, run, change, trace, None, audit=recorded)
    append_trace_file(app[ctx.LIVE].config.trace_file, lines)
    request[ctx.RUN] = run
    app[ctx.DRIVER].approvals_changed()
    resumes = after_decision(app[BACKGROUND], run, policy, resume_decided(RESUMED_BY))
    return _json({"run": run_json(run), "decision": {"call_id": call_id, **decision.to_json(), "expired": late},
                  "run_resumes_on_decision": resumes}, run=run)


async def _decide_limit(request: web.Request, team: TeamConfig, run: RunState, policy: Policy,
                        given: ApprovalInput) -> web.Response:
    """A verdict on a limit request (`on_exceed: ask`): raised limits (or the run ended), its
    trace lines and its audit record in one store step. Like a call's decision, a grant leaves
    the run `interrupted` until its resume: under `on_decision: resume` the gateway's own."""
    app = request.app
    run, decision = await limit_requests.decide(app, run, policy, team, given.call_id, given.decision,
                                                given.reason, given.grant)
    request[ctx.RUN] = run
    app[ctx.DRIVER].approvals_changed()
    resumes = after_decision(app[BACKGROUND], run, policy, resume_decided(RESUMED_BY))
    return _json({"run": run_json(run), "decision": decision, "run_resumes_on_decision": resumes}, run=run)


async def post_resume(request: web.Request) -> web.StreamResponse:
    """POST /v1/runs/{id}/resume {"max_turns"?, "max_budget_usd"?, "max_tool_calls"?, "max_duration_s"?,
    "stream"?}."""
    team, run = await run_for(request)
    require_steer(team, run, "resume")
    given = resume_input(await _body(request))
    prepare: Prepare = resume_with(given.max_turns, given.max_budget_usd, team.name,
                                   max_tool_calls=given.max_tool_calls, max_duration_s=given.max_duration_s)
    raised = {name: [getattr(run.limits, name), value] for name, value in (
        ("max_turns", given.max_turns), ("max_budget_usd", given.max_budget_usd),
        ("max_tool_calls", given.max_tool_calls), ("max_duration_s", given.max_duration_s)) if value is not None}
    entries: tuple[AuditEntry, ...] = ()
    if raised:  # an administrative act: the run may spend more (recorded with the resume's save)
        entries = (audit.entry(team, audit.RUN_RESUMED, run.public_id, concerns=run.team, details=raised),)
        prepare = Audited(prepare, entries)
    policy = run_policy(request.app, run)
    if policy is not None and not policy.server_side:
        return await _reopen_passthrough(request, run, policy, prepare, entries)
    return await answer(request, run.run_id, prepare=prepare, start="run_resumed", stream=given.stream,
                        include_usage=given.include_usage)


async def _reopen_passthrough(request: web.Request, run: RunState, policy: Policy, prepare: Prepare,
                              entries: tuple[AuditEntry, ...]) -> web.Response:
    """A pass-through run is driven by its client: resuming it only reopens it for the next call."""
    app = request.app
    setup: StartSetup | None = None

    def change(state: RunState) -> None:
        nonlocal setup
        setup = prepare(state, policy)

    def trace(state: RunState) -> list[Event]:
        return [Tracer(state.run_id).start("run_resumed", setup, {"turns": state.turns,
                                                                  "costUsd": round(state.cost_usd, 9)})]

    run, lines, _ = await commit_run(app[ctx.STORE], run, change, trace, None, audit=lambda _: entries)
    append_trace_file(app[ctx.LIVE].config.trace_file, lines)
    request[ctx.RUN] = run
    return _json({"run": run_json(run)}, run=run)


async def post_cancel(request: web.Request) -> web.Response:
    """POST /v1/runs/{id}/cancel {"reason"}: Stop, here or on the replica driving the run."""
    app = request.app
    team, run = await run_for(request)
    require_steer(team, run, "cancel")
    reason = cancel_reason(await _body(request)) or f"cancelled by team {team.name}"
    driver = app[ctx.DRIVER]
    # A cancel by someone other than the run's team is an administrative act: recorded with
    # the stopped run when this process stops it, else (the run is driven here, or by another
    # replica, which saves the stop itself) with the request.
    entries = [audit.entry(team, audit.RUN_CANCELLED, run.public_id, concerns=run.team, details={"reason": reason})
               ] if team.name != run.team else []
    if driver.active.cancel(run.run_id, reason, team.name):
        if entries:
            await app[ctx.STORE].append_audit(entries)
        await driver.active.wait_stopped(run.run_id, CANCEL_WAIT_S)
        run = await _reload(app, run)
        return _json({"run": run_json(run), "cancel": "done"}, run=run)
    if not _cancellable(run):
        raise Conflict(f"run {run.public_id} is not running (status {run.status}); nothing to cancel",
                       code="run_not_running")
    store = app[ctx.STORE]
    try:
        with driver.active.claim(run.run_id, lambda event: None):
            lease = await store.acquire_lease(run.run_id, driver.owner, driver.lease_ttl_s)
            if lease is not None:
                try:
                    run = await _cancel_undriven(app, await _reload(app, run), reason, team.name, lease, entries)
                finally:
                    await store.release_lease(run.run_id, driver.owner)
                request[ctx.RUN] = run
                driver.approvals_changed()
                return _json({"run": run_json(run), "cancel": "done"}, run=run)
    except RunBusy:  # a drive started here meanwhile: stop it
        driver.active.cancel(run.run_id, reason, team.name)
        if entries:
            await app[ctx.STORE].append_audit(entries)
        await driver.active.wait_stopped(run.run_id, CANCEL_WAIT_S)
        run = await _reload(app, run)
        return _json({"run": run_json(run), "cancel": "done"}, run=run)
    # Another replica (or worker) drives it: it reads its run's trace and stops; the answer
    # says "done" once the stored run shows it, "requested" if that takes longer.
    await store.append_events(run.run_id, [cancel_event(run.run_id, reason, team.name)])
    if entries:
        await store.append_audit(entries)
    stopped = await _stopped_elsewhere(app, run, CANCEL_WAIT_S)
    if stopped is not None:
        request[ctx.RUN] = stopped
        return _json({"run": run_json(stopped), "cancel": "done"}, run=stopped)
    return _json({"run": run_json(run), "cancel": "requested"}, status=202, run=run)


async def _stopped_elsewhere(app: web.Application, run: RunState, timeout_s: float) -> RunState | None:
    """The run once another process stopped it (saved, no longer running), else None after
    `timeout_s` (polled from the store: the driving process tells nobody directly)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(FOLLOW_POLL_S)
        fresh = await app[ctx.STORE].load_run(run.run_id)
        if fresh is None:
            return None
        if fresh.revision != run.revision and fresh.status != "running":
            return fresh
    return None


async def _reload(app: web.Application, run: RunState) -> RunState:
    return await app[ctx.STORE].load_run(run.run_id) or run


def _cancellable(run: RunState) -> bool:
    """Running, or stopped on a call or limit request (decided or not) that would let it go on."""
    return run.status == "running" or run.waits_for_decision or run.decided


async def _cancel_undriven(app: web.Application, run: RunState, reason: str, by: str, lease: Lease,
                           entries: Sequence[AuditEntry] = ()) -> RunState:
    """A run nobody drives, whose lease this process took: `running` (it waits for client
    tools, or its replica died), waiting for a decision, or decided and waiting for its
    resume (the decision stays: a later resume acts on it). A pending approval is dropped:
    nobody can decide it any more, and a later resume asks again (the call is still pending
    in the transcript)."""
    store = app[ctx.STORE]
    if not _cancellable(run):
        raise Conflict(f"run {run.public_id} is not running (status {run.status}); nothing to cancel",
                       code="run_not_running")
    dropped = run.waiting_request

    def trace(r: RunState) -> list[Event]:
        lines: list[Event] = [cancel_event(r.run_id, reason, by)]
        if dropped is not None:
            lines.append(Tracer(r.run_id)("approval_dropped", callId=dropped.call_id, toolName=dropped.tool_name,
                                          args=dropped.args, reason=reason, by=by))
        lines.append(Tracer(r.run_id)("run_stopped", status="interrupted", reason="cancelled", turns=r.turns,
                                      costUsd=round(r.cost_usd, 9), detail=reason))
        return lines

    # The lines and the stopped run in one store step: a reader that sees `run_stopped` finds
    # the run stopped (and may resume it at once).
    run, lines, _ = await commit_run(store, run, stop_run("interrupted", "cancelled",
                                                          Interruption("cancelled", reason=reason)), trace, None,
                                     audit=lambda _: entries, lease=lease)
    append_trace_file(app[ctx.LIVE].config.trace_file, lines)
    return run

