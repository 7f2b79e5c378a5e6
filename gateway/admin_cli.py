"""`gateway keys`, `gateway spend`, `gateway audit`: the admin API from a terminal.

    gateway keys create --team T --name N [--user U] [--model GLOB]... [--policy P]... [--budget USD]
                        [--period day|week|month|total] [--expires-in SECONDS] [--rpm N] [--tpm N]
                        [--max-in-flight N] [--meta KEY=VALUE]... [--manage-keys]
    gateway keys list [--team T] [--user U] [--all]
    gateway keys show ID
    gateway keys update ID [the options of create but --team]
    gateway keys rotate ID [--grace SECONDS]
    gateway keys revoke ID
    gateway spend [--group-by team,key,user,model,policy,day] [--from DAY] [--to DAY] [--team T]
    gateway audit [--since EPOCH] [--action A] [--team T]
    gateway audit verify

The gateway is `--url` (else $GATEWAY_URL, else http://127.0.0.1:8080) and the key `--key`
(else $GATEWAY_KEY): an admin team's, or a key with `manage_keys: true`. `--json` prints the
API's JSON. A key's secret is printed once, when it is created or rotated: store it then.
Exit codes: 0 done, 1 refused or unreachable (the gateway's words are printed), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO
from urllib.parse import quote, urlencode

from gateway.approvals_cli import Client, CliError, _dumps, _safe, _url

TEAMS = "the team's"
MANAGES = "its team's keys"
SECRET_WARNING = "This is the key's secret. It is shown once: store it now (the gateway keeps only its hash)."


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="the gateway (default $GATEWAY_URL, else http://127.0.0.1:8080)")
    common.add_argument("--key", help="an admin key, or a key that manages keys (default $GATEWAY_KEY)")
    common.add_argument("--json", action="store_true", help="print the API's JSON")
    return common


def _scope_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="what the key is for")
    parser.add_argument("--user", help="every call of the key is this user's")
    parser.add_argument("--model", action="append", dest="models", metavar="GLOB",
                        help="a model the key may call (a glob; repeat for more)")
    parser.add_argument("--policy", action="append", dest="policies", metavar="NAME",
                        help="a policy of the team the key may use (repeat for more)")
    parser.add_argument("--budget", type=float, metavar="USD", help="the key's budget per --period")
    parser.add_argument("--period", choices=["day", "week", "month", "total"], help="its budget period")
    parser.add_argument("--expires-in", type=float, metavar="SECONDS", help="the key stops working this much later")
    parser.add_argument("--rpm", type=int, help="requests per minute (rate limit of the key)")
    parser.add_argument("--tpm", type=int, help="tokens per minute (rate limit of the key)")
    parser.add_argument("--max-in-flight", type=int, help="calls at once (rate limit of the key)")
    parser.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata (repeat)")
    parser.add_argument("--manage-keys", action=argparse.BooleanOptionalAction, default=None,
                        help="may issue and manage keys of its own team")


def add_parsers(sub: Any) -> None:
    """The `keys`, `spend` and `audit` subcommands (called by `gateway.cli`)."""
    common = _common()
    keys = sub.add_parser("keys", help="issue, list, change, rotate and revoke keys (admin API)")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    create = actions.add_parser("create", parents=[common], help="issue a key (its secret is printed once)")
    create.add_argument("--team", required=True, help="the key's team")
    _scope_options(create)
    listing = actions.add_parser("list", parents=[common], help="keys you may manage")
    listing.add_argument("--team", help="one team's")
    listing.add_argument("--user", help="one user's")
    listing.add_argument("--all", action="store_true", help="revoked and expired keys too")
    for verb, text in (("show", "one key"), ("revoke", "revoke a key (it stops working everywhere within a second)")):
        one = actions.add_parser(verb, parents=[common], help=text)
        one.add_argument("id", help="the key's id (key_... or cfg_...)")
    update = actions.add_parser("update", parents=[common], help="change a key's name, scope, budget or expiry")
    update.add_argument("id", help="the key's id")
    _scope_options(update)
    rotate = actions.add_parser("rotate", parents=[common], help="a new secret for a key (printed once)")
    rotate.add_argument("id", help="the key's id")
    rotate.add_argument("--grace", type=float, default=0.0, metavar="SECONDS",
                        help="the old secret keeps working this long (default 0, at most 7 days)")

    spend = sub.add_parser("spend", parents=[common], help="what was spent, grouped (GET /v1/spend)")
    spend.add_argument("--group-by", default="team,key,model", help="of team, key, user, model, policy, day "
                                                                    "(default %(default)s)")
    spend.add_argument("--from", dest="first", help="first day (YYYY-MM-DD, UTC; default 29 days before --to)")
    spend.add_argument("--to", dest="last", help="last day (default today)")
    spend.add_argument("--team", help="one team's (admins; a team sees its own)")

    audit = sub.add_parser("audit", parents=[common], help="the audit log (admin teams)")
    audit.add_argument("verify", nargs="?", choices=["verify"], help="check the whole log's hash chain")
    audit.add_argument("--since", type=float, metavar="EPOCH", help="records at or after this time")
    audit.add_argument("--action", help="one action (key.created, approval.decided, ...)")
    audit.add_argument("--team", help="acts about or by one team")



def _client(args: argparse.Namespace) -> Client:
    return Client(_url(args.url), args.key or os.environ.get("GATEWAY_KEY") or "")


def _scope_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, field in (("name", "name"), ("user", "user"), ("models", "models"), ("policies", "policies"),
                        ("budget", "budget_usd"), ("period", "budget_period"), ("expires_in", "expires_in_s"),
                        ("manage_keys", "manage_keys")):
        value = getattr(args, name)
        if value is not None:
            body[field] = value
    limits = {k: v for k, v in (("requests_per_minute", args.rpm), ("tokens_per_minute", args.tpm),
                                ("max_in_flight", args.max_in_flight)) if v is not None}
    if limits:
        body["rate_limits"] = limits
    if args.meta:
        metadata = {}
        for item in args.meta:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise CliError(f"--meta takes KEY=VALUE, got {item!r}", 2)
            metadata[key] = value
        body["metadata"] = metadata
    return body


def keys_command(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run one `gateway keys ...` command."""
    try:
        client = _client(args)
        action = args.keys_command
        if action == "create":
            answer = client._call("POST", "/v1/admin/keys", {"team": args.team, **_scope_body(args)})
            _print_secret(answer, args.json, out, err)
        elif action == "list":
            query = {k: v for k, v in (("team", args.team), ("user", args.user)) if v}
            if args.all:
                query["include_revoked"] = "true"
            keys: list[dict[str, Any]] = []
            after = ""
            while True:
                page = client._call("GET", "/v1/admin/keys?" + urlencode({**query, "limit": 200, "after": after}))
                keys += [k for k in page.get("data") or [] if isinstance(k, dict)]
                if not page.get("has_more") or not page.get("next_after"):
                    break
                after = str(page["next_after"])
            out.write(_dumps({"object": "list", "data": keys}) if args.json else render_keys(keys, time.time()))
        elif action == "show":
            answer = client._call("GET", _key_path(args.id))
            out.write(_dumps(answer) if args.json else render_key(answer))
        elif action == "update":
            body = _scope_body(args)
            if not body:
                raise CliError("nothing to change: give at least one option (see gateway keys update --help)", 2)
            answer = client._call("PATCH", _key_path(args.id), body)
            out.write(_dumps(answer) if args.json else render_key(answer))
        elif action == "rotate":
            answer = client._call("POST", _key_path(args.id, "/rotate"), {"grace_s": args.grace})
            _print_secret(answer, args.json, out, err)
        else:
            answer = client._call("DELETE", _key_path(args.id))
            out.write(_dumps(answer) if args.json else f"revoked {_safe(str(answer.get('id')))}\n")
    except CliError as exc:
        print(f"gateway keys: {exc}", file=err)
        return exc.code
    return 0


def _print_secret(answer: dict[str, Any], as_json: bool, out: TextIO, err: TextIO) -> None:
    print(f"gateway keys: {SECRET_WARNING}", file=err)
    if as_json:
        out.write(_dumps(answer))
        return
    out.write(render_key(answer))
    for warning in answer.get("warnings") or ():
        print(f"gateway keys: warning: {_safe(str(warning))}", file=err)
    out.write(f"key       {_safe(str(answer.get('key')))}\n")


def _key_path(key_id: str, tail: str = "") -> str:
    return f"/v1/admin/keys/{quote(key_id, safe='')}{tail}"


def _when(at: Any, now: float | None = None) -> str:
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(at))


def _state(key: Mapping[str, Any], now: float) -> str:
    if key.get("revoked_at"):
        return "revoked"
    expires = key.get("expires_at")
    if isinstance(expires, (int, float)) and expires <= now:
        return "expired"
    return "active"


def render_keys(keys: Sequence[Mapping[str, Any]], now: float) -> str:
    """One line per key: id, team, name, prefix, user, source, budget, state, last used."""
    if not keys:
        return "No keys.\n"
    rows = [("ID", "TEAM", "NAME", "PREFIX", "USER", "SOURCE", "BUDGET", "STATE", "LAST USED")]
    for k in keys:
        budget = "-" if k.get("budget_usd") is None else f"${float(k['budget_usd']):g}/{k.get('budget_period')}"
        rows.append((str(k.get("id")), str(k.get("team")), str(k.get("name") or ""), str(k.get("prefix") or "-"),
                     str(k.get("user") or "-"), str(k.get("source")), budget, _state(k, now),
                     _when(k.get("last_used_at"))))
    return _table(rows)


def _table(rows: Sequence[Sequence[str]]) -> str:
    safe = [tuple(_safe(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in safe) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in safe)


def render_key(key: Mapping[str, Any]) -> str:
    lines = [f"id        {key.get('id')}  ({key.get('source')})", f"team      {key.get('team')}",
             f"name      {key.get('name')}", f"prefix    {key.get('prefix') or '-'}",
             f"user      {key.get('user') or '-'}", f"state     {_state(key, time.time())}",
             f"models    {', '.join(key.get('models') or []) or TEAMS}",
             f"policies  {', '.join(key.get('policies') or []) or TEAMS}"]
    if key.get("budget_usd") is not None:
        lines.append(f"budget    ${float(key['budget_usd']):.6f} per {key.get('budget_period')}")
        spent = key.get("budget")
        if isinstance(spent, dict):
            lines.append(f"          spent ${float(spent.get('spent_usd') or 0):.6f} in {spent.get('period')}, "
                         f"left ${float(spent.get('remaining_usd') or 0):.6f}")
    if key.get("rate_limits"):
        lines.append(f"limits    {json.dumps(key['rate_limits'])}")
    lines += [f"manages   {MANAGES if key.get('manage_keys') else 'no keys'}",
              f"expires   {_when(key.get('expires_at'))}", f"created   {_when(key.get('created_at'))} by "
              f"{key.get('created_by')}", f"last used {_when(key.get('last_used_at'))}"]
    if key.get("metadata"):
        lines.append(f"metadata  {json.dumps(key['metadata'], ensure_ascii=False)}")
    return "".join(_safe(line) + "\n" for line in lines)


def spend_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """`gateway spend`: GET /v1/spend as a table (or its JSON)."""
    try:
        query = {k: v for k, v in (("group_by", args.group_by), ("from", args.first), ("to", args.last),
                                   ("team", args.team)) if v}
        answer = _client(args)._call("GET", "/v1/spend?" + urlencode(query))
        out.write(_dumps(answer) if args.json else render_spend(answer))
    except CliError as exc:
        print(f"gateway spend: {exc}", file=sys.stderr)
        return exc.code
    return 0


def render_spend(answer: Mapping[str, Any]) -> str:
    groups = [str(g) for g in answer.get("group_by") or []]
    columns = [*groups, *(["key_name"] if "key" in groups else [])]
    rows: list[tuple[str, ...]] = [(*(c.upper() for c in columns), "CALLS", "COST_USD")]
    for entry in answer.get("data") or []:
        rows.append((*(str(entry.get(c) or "-") for c in columns), str(entry.get("calls")),
                     f"{int(entry.get('cost_micros') or 0) / 1_000_000:.6f}"))
    rows.append(("TOTAL", *([""] * (len(columns) - 1)), str(answer.get("calls")),
                 f"{int(answer.get('total_micros') or 0) / 1_000_000:.6f}"))
    head = f"spend from {answer.get('from')} to {answer.get('to')} (UTC days)\n"
    return _safe(head, keep_newlines=True) + _table(rows)


def audit_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """`gateway audit [verify]`: the audit log as lines (or JSON), or a check of its chain."""
    try:
        client = _client(args)
        query: dict[str, Any] = {} if args.verify else {k: v for k, v in (
            ("since", args.since), ("action", args.action), ("team", args.team)) if v is not None}
        records: list[dict[str, Any]] = []
        after = 0
        while True:
            page = client._call("GET", "/v1/admin/audit?" + urlencode({**query, "after": after, "limit": 1000}))
            records += [r for r in page.get("data") or [] if isinstance(r, dict)]
            if not page.get("has_more") or not page.get("next_after"):
                break
            after = int(page["next_after"])
        if args.verify:
            from gateway.store.audit import AuditRecord, verify  # not at import: `gateway --help` stays fast

            checked, problem = verify(AuditRecord.from_stored(json.dumps(r)) for r in records)
            if problem is not None:
                raise CliError(f"the audit log does not verify: {problem} ({checked} records checked before it)")
            first = records[0]["seq"] if records else "-"
            out.write(f"ok: {checked} records, {first} to {records[-1]['seq'] if records else '-'}, each chained "
                      "to the one before\n")
        else:
            out.write(_dumps({"object": "list", "data": records}) if args.json else render_audit(records))
    except (CliError, KeyError, ValueError, TypeError) as exc:
        if not isinstance(exc, CliError):
            exc = CliError(f"the gateway answered an audit record this command cannot read: {exc}")
        print(f"gateway audit: {exc}", file=sys.stderr)
        return exc.code
    return 0


def render_audit(records: Sequence[Mapping[str, Any]]) -> str:
    if not records:
        return "No audit records.\n"
    rows = [("SEQ", "AT (UTC)", "ACTOR", "ACTION", "TARGET", "DETAILS")]
    for r in records:
        actor = r.get("actor") or {}
        who = f"{actor.get('team') or 'gateway'}/{actor.get('key_id') or '-'}"
        rows.append((str(r.get("seq")), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(r.get("at") or 0))),
                     who, str(r.get("action")), str(r.get("target")),
                     json.dumps(r.get("details") or {}, ensure_ascii=False)[:120]))
    return _table(rows)
