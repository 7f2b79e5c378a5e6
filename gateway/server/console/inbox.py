"""The approver's inbox: every pending request the signed-in team may decide, oldest first.

An item is a run waiting for a decision (`interrupted`, an `approval` or `limit`
interruption not yet decided) that the team may see and decide (`run_access.may_see`,
`may_decide`: the runs API's own rules), with what a person needs to judge it: the tool
and its arguments and the policy rule that asked (`RuleApproval.explain`, the rule the
loop applied), or, for a limit request (`kind: "limit"`), the limit, what the run used,
the grant proposed and how far `max_total` lets it go; the run's team, policy, model,
turns and cost, the last user message and the assistant message that made the call (for
a limit: the run's last one, what it was doing), and when the request expires.

`GET /console/api/inbox/events` streams changes as server-sent events, read from the
shared store (so a decision taken on another replica, or by the API, shows too):
`snapshot` (the whole inbox, first), `added` (an item), `decided` (an item's key, the
decision and who took it; or, for a run no longer waiting for another reason, its status).
"""

from __future__ import annotations

import time
from typing import Any, Final, TypedDict

from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.harness.state import Message, RunState
from gateway.policy.approval import compile_approval
from gateway.policy.decl import Policy, Rule
from gateway.server import context as ctx
from gateway.harness.approvals import describe_call
from gateway.harness.limit_requests import plain
from gateway.harness.limit_requests import room as room_left
from gateway.server.api.access import may_decide, may_see, request_kind
from gateway.server.api.runs import LIST_SCAN, run_policy
from gateway.server.console.session import json_answer, signed_in
from gateway.server.http.errors import Unauthorized
from gateway.server.http.sse import ClientGone, SSEStream
from gateway.server.runs.auto_resume import waits_for_decision
from gateway.server.runs.tracelog import asked_at

POLL_S: Final = 1.0
"""How often an open inbox re-reads the store (every replica writes there)."""
KEEPALIVE_S: Final = 15.0
MAX_TEXT: Final = 4000
"""Characters of a message shown in an item (the run page shows the whole transcript)."""


class InboxItem(TypedDict):
    """One pending call, as the inbox shows it."""

    key: str
    run_id: str
    team: str
    policy: str
    policy_version: str | None
    model: str
    turns: int
    cost_usd: float
    call_id: str
    tool: str
    args: Any
    rule: str
    asked_at: float | None
    expires_at: float | None
    last_user: str | None
    assistant: str | None
    decision: str
    run_resumes_on_decision: bool
    kind: str
    """`tool_call`, or `limit` (then `tool` and `args` are empty and the fields below are set)."""
    limit: str | None
    used: float | None
    cap: float | None
    grant: dict[str, float] | None
    """The grant proposed (what each limit would be raised by)."""
    room: dict[str, float] | None
    """How far each limit the grant names may still be raised (`limits.ask.max_total`; absent: no bound)."""
    grants: int
    """Grants the run had so far."""


class Decided(TypedDict):
    """An item that left the inbox: decided (by whom), or no longer waiting."""

    key: str
    decision: str | None
    by: str | None
    reason: str | None
    status: str


def item_key(run: RunState, call_id: str) -> str:
    return f"{run.run_id}#{call_id}"


def _text(content: Any) -> str | None:
    if content is None:
        return None
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def _context(messages: list[Message], call_id: str) -> tuple[str | None, str | None]:
    """(the last user message before the call, the assistant message that made it)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and any(isinstance(c, dict) and c.get("id") == call_id for c in calls):
            user = next((messages[j] for j in range(i - 1, -1, -1) if messages[j].get("role") == "user"), None)
            return (_text(user.get("content")) if user else None), _text(m.get("content"))
    return None, None


def _doing(messages: list[Message]) -> str | None:
    """What a run was doing: its last assistant message (its text, or the calls it made)."""
    for m in reversed(messages):
        if m.get("role") != "assistant":
            continue
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            named = [describe_call(str((c.get("function") or {}).get("name")), (c.get("function") or {}).get(
                "arguments") or "{}") for c in calls if isinstance(c, dict)]
            said = _text(m.get("content"))
            return _text(("; ".join(named)) if not said else f"{said}\n{'; '.join(named)}")
        return _text(m.get("content"))
    return None


def _last_user(messages: list[Message]) -> str | None:
    user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    return _text(user.get("content")) if user else None


def limit_rule(policy: Policy, limit: str | None) -> str:
    """Which part of the policy asked a person for more of a limit."""
    ask = policy.limit_ask
    if ask is None:
        return f"policy '{policy.name}' no longer asks for its limits"
    bound = f"; at most {ask.max_grants} grant(s)" if ask.max_grants is not None else ""
    total = next((v for k, v in ask.max_total.items() if k == limit), None)
    return f"limits.on_exceed: ask ({limit} asks {', '.join(ask.approvers)}{bound}" + (
        f"; max_total {total:g})" if total is not None else ")")


def describe_rule(rule: Rule, index: int) -> str:
    """`rule 2: delete_file with path "*.log" -> ask` (1-based, as `gateway policy check` counts)."""
    parts = [rule.tool]
    if rule.args:
        parts.append("with " + ", ".join(f'{k} "{v}"' for k, v in rule.args.items()))
    if rule.read_only is not None:
        parts.append(f"read_only={'yes' if rule.read_only else 'no'}")
    reason = f" ({rule.reason})" if rule.reason else ""
    return f"rule {index + 1}: {' '.join(parts)} -> {rule.action}{reason}"


def asking_rule(policy: Policy, tool: str, args: Any) -> str:
    """Which part of the policy asked a person about this call."""
    decl = policy.tool(tool)
    if decl is None:
        return f"policy '{policy.name}' has no tool {tool!r} any more"
    if not isinstance(args, dict):
        return "the call's arguments are not a JSON object"
    _, index = compile_approval(policy.approval).explain(decl.spec, args)
    if index is None:
        return f"no rule matched; tool {tool} has needs_approval: true"
    return describe_rule(policy.approval.rules[index], index)


async def pending_items(app: web.Application, team: TeamConfig,
                        asked: dict[str, float | None] | None = None) -> list[InboxItem]:
    """The team's inbox, oldest request first. `asked` keeps when each item was asked (read
    from its run's trace once, not on every poll of an open inbox)."""
    store = app[ctx.STORE]
    asked = {} if asked is None else asked
    items: list[InboxItem] = []
    for run in await store.list_runs(status="interrupted", limit=LIST_SCAN):
        waiting = run.interruption
        if waiting is None or waiting.call_id is None or not waits_for_decision(run):
            continue
        policy = run_policy(app, run)
        kind = request_kind(run)
        if policy is None or not may_see(team, run, policy) or not may_decide(team, run, policy, kind):
            continue
        key = item_key(run, waiting.call_id)
        if key not in asked:
            asked[key] = await asked_at(app[ctx.STORE], run, waiting.call_id)
        when = asked[key]
        expires = policy.approval.expires_after_s
        if kind == "limit":
            user, assistant = _last_user(run.messages), _doing(run.messages)
            rule = limit_rule(policy, waiting.limit)
        else:
            user, assistant = _context(run.messages, waiting.call_id)
            rule = asking_rule(policy, waiting.tool_name or "", waiting.args)
        ask = policy.limit_ask
        room = {n: r for n in (waiting.grant or {}) if ask is not None
                and (r := room_left(run.limits, ask, n)) is not None} if kind == "limit" else None
        items.append({
            "key": key, "run_id": run.public_id, "team": run.team,
            "policy": run.policy, "policy_version": run.policy_version, "model": run.model, "turns": run.turns,
            "cost_usd": round(run.cost_usd, 9), "call_id": waiting.call_id, "tool": waiting.tool_name or "",
            "args": waiting.args, "rule": rule,
            "asked_at": when, "expires_at": when + expires if when is not None and expires is not None else None,
            "last_user": user, "assistant": assistant, "decision": "pending",
            "run_resumes_on_decision": policy.approval.on_decision == "resume" and policy.server_side,
            "kind": kind, "limit": waiting.limit, "used": waiting.used, "cap": waiting.cap,
            "grant": plain(waiting.grant) if waiting.grant is not None else None,
            "room": plain(room) if room is not None else None, "grants": len(run.grants),
        })
    items.sort(key=lambda item: (item["asked_at"] or 0.0, item["key"]))
    return items


async def _decided(app: web.Application, item: InboxItem) -> Decided:
    run_id, _, call_id = item["key"].rpartition("#")
    run = await app[ctx.STORE].load_run(run_id)
    decision = run.decisions.get(call_id) if run is not None else None
    return {"key": item["key"], "decision": decision.decision if decision else None,
            "by": decision.by if decision else None, "reason": decision.reason if decision else None,
            "status": run.status if run is not None else "deleted"}


async def get_inbox(request: web.Request) -> web.Response:
    """GET /console/api/inbox: the pending calls the signed-in team may decide."""
    _, team = await signed_in(request)
    return json_answer({"object": "list", "data": await pending_items(request.app, team)})


async def inbox_events(request: web.Request) -> web.StreamResponse:
    """GET /console/api/inbox/events: the inbox as it changes (SSE), until the client leaves."""
    app = request.app
    _, team = await signed_in(request)
    sse = await SSEStream.open(request)
    shown: dict[str, InboxItem] | None = None
    asked: dict[str, float | None] = {}
    quiet_since = time.monotonic()
    try:
        while True:
            current = {i["key"]: i for i in await pending_items(app, team, asked)}
            for gone in asked.keys() - current.keys():
                del asked[gone]
            if shown is None:
                await sse.data({"data": list(current.values())}, event="snapshot")
                quiet_since = time.monotonic()
            else:
                changes = 0
                for key in shown.keys() - current.keys():
                    await sse.data(await _decided(app, shown[key]), event="decided")
                    changes += 1
                for key, item in current.items():
                    if key not in shown:
                        await sse.data(item, event="added")
                        changes += 1
                if changes:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > KEEPALIVE_S:
                    await sse.comment("keepalive")
                    quiet_since = time.monotonic()
            shown = current
            if not await sse.pause(POLL_S):
                break
            try:
                _, team = await signed_in(request)  # a session that ended (signed out, key revoked) stops here
            except Unauthorized:
                break
    except ClientGone:
        return sse.response
    await sse.close()  # the gateway is shutting down: the browser reconnects to another one
    return sse.response
