"""`GET /v1/spend` and `GET /v1/admin/audit`: what was spent, by whom, and who did what.

    GET /v1/spend?group_by=team,key,user,model,policy,day&from=YYYY-MM-DD&to=YYYY-MM-DD&team=&format=json|csv
    GET /v1/admin/audit?since=&action=&team=&after=&limit=

Spend is read from the store's spend rows (`Store.spend`: every booking of a team's ledger
adds to the day's row of its team, key, user, model and policy), so its totals equal the
ledgers to the micro-dollar. A team sees its own spend (any of its keys); an admin team
sees every team's, or one (`team=`). Days are UTC; the range is at most 366 days (default:
the last 30). CSV cells that a spreadsheet would read as a formula are quoted with a
leading `'`. The audit log is for admin teams only.
"""

from __future__ import annotations

import csv
import io
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.server import context as ctx
from gateway.server.http.errors import Forbidden, InvalidField
from gateway.server.http.validation import query_int
from gateway.store.base import MICROS_PER_USD, SpendRow, spend_day

GROUPS: Final = ("team", "key", "user", "model", "policy", "day")
MAX_DAYS: Final = 366
DEFAULT_DAYS: Final = 30
AUDIT_LIMIT: Final = 1000
FORMULA: Final = ("=", "+", "-", "@", "\t", "\r")


def _day(raw: str, name: str) -> datetime:
    try:
        parsed = datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=UTC)
    except ValueError:
        raise InvalidField(name, f"{name} must be a day, YYYY-MM-DD (UTC), got {raw[:40]!r}") from None
    return parsed


def _groups(raw: str | None) -> tuple[str, ...]:
    if not raw:
        return ("team",)
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in GROUPS]
    if unknown or not names:
        raise InvalidField("group_by", f"group_by takes a comma-separated list of {', '.join(GROUPS)}; "
                                       f"got {raw[:80]!r}")
    return names


def _row_value(row: SpendRow, group: str) -> str:
    return row.day if group == "day" else str(getattr(row, group))


async def get_spend(request: web.Request) -> web.Response:
    """GET /v1/spend: spend grouped, as JSON or CSV."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    q = request.query
    groups = _groups(q.get("group_by"))
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    last = _day(q["to"], "to") if q.get("to") else today
    first = _day(q["from"], "from") if q.get("from") else last - timedelta(days=DEFAULT_DAYS - 1)
    if first > last:
        raise InvalidField("from", "from must not be after to")
    if (last - first).days >= MAX_DAYS:
        raise InvalidField("from", f"the range is at most {MAX_DAYS} days")
    team = q.get("team") or None
    if team is not None and len(team) > 64:
        raise InvalidField("team", "team must be a team's name (at most 64 characters)")
    if not caller.admin:
        if team is not None and team != caller.name:
            raise Forbidden(f"team '{caller.name}' sees its own spend only; admin teams see every team's",
                            code="not_an_admin", param="team")
        team = caller.name
    fmt = q.get("format", "json")
    if fmt not in ("json", "csv"):
        raise InvalidField("format", f"format must be json or csv, got {fmt[:20]!r}")
    rows = await app[ctx.STORE].spend(spend_day(first.timestamp()), spend_day(last.timestamp()), team)
    totals: dict[tuple[str, ...], list[int]] = {}
    for row in rows:
        figures = totals.setdefault(tuple(_row_value(row, g) for g in groups), [0, 0])
        figures[0] += row.cost_micros
        figures[1] += row.calls
    names = _key_names(request) if "key" in groups else {}
    data: list[dict[str, Any]] = []
    for values, (micros, calls) in sorted(totals.items(), key=lambda item: (-item[1][0], item[0])):
        entry: dict[str, Any] = dict(zip(groups, values, strict=True))
        if "key" in groups:
            entry["key_name"] = names.get(entry["key"], "")
        entry.update(cost_usd=micros / MICROS_PER_USD, cost_micros=micros, calls=calls)
        data.append(entry)
    total = sum(f[0] for f in totals.values())
    if fmt == "csv":
        return _csv(data, groups)
    return web.Response(body=orjson.dumps({
        "object": "list", "from": spend_day(first.timestamp()), "to": spend_day(last.timestamp()),
        "team": team, "group_by": list(groups), "data": data, "total_micros": total,
        "total_usd": total / MICROS_PER_USD, "calls": sum(f[1] for f in totals.values())}),
        content_type="application/json")


def _key_names(request: web.Request) -> dict[str, str]:
    keyring = request.app[ctx.KEYRING]
    names = {r.id: r.name for r in keyring.records()}
    for team in keyring.teams():
        for ck in team.config_keys:
            names[ck.id] = ck.name
    return names


def _cell(value: Any) -> str:
    text = str(value)
    return "'" + text if text.startswith(FORMULA) else text


def _csv(data: list[dict[str, Any]], groups: tuple[str, ...]) -> web.Response:
    out = io.StringIO()
    columns = [*groups, *(["key_name"] if "key" in groups else []), "cost_usd", "calls"]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for entry in data:
        writer.writerow([_cell(entry[c]) if c not in ("cost_usd", "calls") else
                         (f"{entry['cost_micros'] / MICROS_PER_USD:.6f}" if c == "cost_usd" else entry[c])
                         for c in columns])
    return web.Response(text=out.getvalue(), content_type="text/csv", charset="utf-8")


async def get_audit(request: web.Request) -> web.Response:
    """GET /v1/admin/audit?since=&action=&team=&after=&limit=: the audit log (admin teams)."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    if not caller.admin:
        raise Forbidden(f"team '{caller.name}' may not read the audit log: only admin teams may",
                        code="not_an_admin")
    q = request.query
    since = None
    if q.get("since"):
        try:
            since = float(q["since"])
        except ValueError:
            raise InvalidField("since", f"since must be a time in epoch seconds, got {q['since'][:40]!r}") from None
        if not 0 <= since <= time.time() + 86_400 * 366 * 100:
            raise InvalidField("since", "since must be a time in epoch seconds")
    action = q.get("action") or None
    team = q.get("team") or None
    for name, value in (("action", action), ("team", team)):
        if value is not None and len(value) > 64:
            raise InvalidField(name, f"{name} must be at most 64 characters")
    after = query_int(q["after"], "after", 0, 2**62) if q.get("after") else 0
    limit = query_int(q["limit"], "limit", 1, AUDIT_LIMIT) if q.get("limit") else 100
    records = await app[ctx.STORE].audit_log(after_seq=after, limit=limit + 1, since=since, action=action, team=team)
    more = len(records) > limit
    records = records[:limit]
    return web.Response(body=orjson.dumps({
        "object": "list", "data": [r.to_json() for r in records], "has_more": more,
        "next_after": records[-1].seq if more and records else None}), content_type="application/json")
