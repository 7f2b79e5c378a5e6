"""`gateway approvals`: decide pending tool calls and limit requests from a terminal, over the runs API.

    gateway approvals list                         calls and limit requests waiting for a decision you may make
    gateway approvals show RUN                     one run: what it waits for (a call and its arguments, or a
                                                   limit and the grant proposed), its context
    gateway approvals approve RUN CALL [--reason] [--grant LIMIT=AMOUNT ...]
                                                   approve the call, or grant more (the proposed grant, or yours)
    gateway approvals reject RUN CALL --reason ... reject it, saying why (the model reads it)

RUN is the run's id, or TEAM/ID for another team's run. The gateway is `--url`, else the
one `--config FILE` describes (its `server.public_url`, else `server.host`/`server.port`),
else $GATEWAY_URL, else http://127.0.0.1:8080; the key is `--key` (else $GATEWAY_KEY).
`--json` prints JSON instead of text: `list` gives one object per pending call or limit
request (its `kind`, `call_id`, `tool_name`, `args` (a limit request: `limit`, `used`,
`cap`, `grant`), `run` as TEAM/ID and `waiting_s` at the top, beside the run object's
fields, as before), the other commands the API's answer. Exit codes: 0 done,
1 refused or unreachable (the gateway's words are printed), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Final, TextIO
from urllib.parse import quote, urlencode, urlsplit

DEFAULT_URL: Final = "http://127.0.0.1:8080"
TIMEOUT_S: Final = 30.0
MAX_ANSWER_BYTES: Final = 16 * 1024 * 1024
SHORT: Final = 80


class CliError(Exception):
    """What went wrong, in words for the terminal; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_parser(sub: Any) -> None:
    """The `approvals` subcommand and its own subcommands (called by `gateway.cli`)."""
    parser = sub.add_parser("approvals", help="list, show, approve and reject pending tool calls and limit requests")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the gateway (default: --config's, else $GATEWAY_URL, else {DEFAULT_URL})")
    common.add_argument("--config", help="a gateway config file: the gateway is the address it serves on")
    common.add_argument("--key", help="an approver team's key (default $GATEWAY_KEY)")
    common.add_argument("--json", action="store_true", help="print the API's JSON")
    actions = parser.add_subparsers(dest="approvals_command", required=True)
    actions.add_parser("list", parents=[common], help="calls and limit requests waiting for a decision, oldest first")
    show = actions.add_parser("show", parents=[common], help="a run and the call it waits for")
    show.add_argument("run", help="the run's id, or TEAM/ID")
    for verb in ("approve", "reject"):
        decide = actions.add_parser(verb, parents=[common], help=f"{verb} the call a run waits for")
        decide.add_argument("run", help="the run's id, or TEAM/ID")
        decide.add_argument("call", help="the call's id (see `gateway approvals show RUN`)")
        decide.add_argument("--reason", required=verb == "reject", default="",
                            help="why (required to reject: the model is told)")
        if verb == "approve":
            decide.add_argument("--grant", action="append", default=[], metavar="LIMIT=AMOUNT",
                                help="for a limit request: raise LIMIT (max_turns, max_budget_usd, max_tool_calls, "
                                     "max_duration_s) by AMOUNT instead of the proposed grant; repeatable")


def approvals_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run one `gateway approvals ...` command; prints errors to stderr."""
    try:
        client = Client(_url(args.url, getattr(args, "config", None)), args.key or os.environ.get("GATEWAY_KEY") or "")
        action = args.approvals_command
        if action == "list":
            runs, now = client.pending(), time.time()
            out.write(_dumps({"object": "list", "data": pending_calls(runs, now)}) if args.json
                      else render_list(runs, now))
        elif action == "show":
            run = client.run(args.run)
            out.write(_dumps(run) if args.json else render_run(run, time.time()))
        else:
            verdict = "approve" if action == "approve" else "reject"
            grant = parse_grant(getattr(args, "grant", None) or [])
            answer = client.decide(args.run, args.call, verdict, args.reason, grant)
            out.write(_dumps(answer) if args.json else render_decision(answer))
    except CliError as exc:
        print(f"gateway approvals: {exc}", file=sys.stderr)
        return exc.code
    return 0


class Client:
    """The runs API over HTTP with one team's key."""

    def __init__(self, url: str, key: str) -> None:
        if not key:
            raise CliError("no key: pass --key or set GATEWAY_KEY to an approver team's key", 2)
        self.url = url
        self.key = key

    def pending(self) -> list[dict[str, Any]]:
        """Runs waiting for a decision the caller may see, oldest first."""
        listing = self._call("GET", "/v1/runs?" + urlencode({"status": "interrupted", "limit": 1000}))
        runs = [r for r in listing.get("data", []) if isinstance(r, dict) and waiting_call(r) is not None]
        return sorted(runs, key=lambda r: float(r.get("updated_at") or 0))

    def run(self, run: str) -> dict[str, Any]:
        return self._call("GET", _run_path(run))

    def decide(self, run: str, call: str, decision: str, reason: str,
               grant: dict[str, float] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"call_id": call, "decision": decision, "reason": reason}
        if grant:
            body["grant"] = grant
        return self._call("POST", _run_path(run, "/approvals"), body)

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:  # noqa: S310 - http(s) checked in _url
                raw = resp.read(MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as exc:
            raise CliError(_refusal(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach the gateway at {self.url}: {reason}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise CliError(f"the gateway at {self.url} answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise CliError(f"the gateway at {self.url} answered an unexpected shape")
        return answer


GRANTABLE: Final = ("max_turns", "max_budget_usd", "max_tool_calls", "max_duration_s")


def parse_grant(items: list[str]) -> dict[str, float] | None:
    """`--grant max_turns=3 --grant max_budget_usd=0.25` -> {"max_turns": 3, "max_budget_usd": 0.25}."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in GRANTABLE:
            raise CliError(f"--grant {item!r}: expected LIMIT=AMOUNT with LIMIT one of {', '.join(GRANTABLE)}", 2)
        try:
            value = float(raw)
        except ValueError:
            raise CliError(f"--grant {item!r}: {raw!r} is not a number", 2) from None
        out[name] = int(value) if name in ("max_turns", "max_tool_calls") and value.is_integer() else value
    return out or None


def waiting_call(run: Mapping[str, Any]) -> dict[str, Any] | None:
    """The call or limit request an interrupted run waits for, if nobody decided it yet."""
    waiting = run.get("interruption")
    if run.get("status") != "interrupted" or not isinstance(waiting, dict) or \
            waiting.get("type") not in ("approval", "limit"):
        return None
    decisions = run.get("decisions") or {}
    return None if waiting.get("call_id") in decisions else waiting


def pending_calls(runs: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """One object per pending call or limit request, for scripts: its fields at the top
    level (a run waits for one at a time; `kind` says which), the run object's fields
    beside them as before."""
    out = []
    for run in runs:
        call = waiting_call(run) or {}
        item = {**run, "kind": "limit" if call.get("type") == "limit" else "tool_call", "call_id": call.get("call_id"),
                "tool_name": call.get("tool_name"), "args": call.get("args"),
                "run": f"{run.get('team')}/{run.get('id')}",
                "waiting_s": round(max(0.0, now - float(run.get("updated_at") or now)), 3)}
        if call.get("type") == "limit":
            item.update(limit=call.get("limit"), used=call.get("used"), cap=call.get("cap"), grant=call.get("grant"))
        out.append(item)
    return out


def render_list(runs: list[dict[str, Any]], now: float) -> str:
    """One line per pending call: run (TEAM/ID), policy, call, tool, arguments (short), waiting for."""
    if not runs:
        return "No calls or limit requests wait for a decision.\n"
    rows = [("RUN", "POLICY", "CALL", "TOOL", "ARGUMENTS", "WAITING")]
    for run in runs:
        call = waiting_call(run) or {}
        if call.get("type") == "limit":
            tool, args = f"limit {call.get('limit')}", f"used {_num(call.get('used'))} of {_num(call.get('cap'))}; " \
                                                        f"grant {_grant(call.get('grant'))}"
        else:
            tool, args = str(call.get("tool_name")), _args(call.get("args"))
        rows.append((f"{run.get('team')}/{run.get('id')}", str(run.get("policy")), str(call.get("call_id")),
                     tool, _short(args), _age(now - float(run.get("updated_at") or now))))
    safe = [tuple(_safe(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in safe) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in safe)


def render_run(run: dict[str, Any], now: float) -> str:
    """A run as a person judging its call needs it: who, what, with which arguments, after what."""
    lines = [f"run       {run.get('team')}/{run.get('id')}",
             f"status    {run.get('status')} ({run.get('reason')})",
             f"policy    {run.get('policy')}   model {run.get('model')}",
             f"turns     {run.get('turns')}   cost ${float(run.get('cost_usd') or 0):.6f}"]
    call = waiting_call(run)
    if call is not None and call.get("type") == "limit":
        lines += [f"waiting   {_age(now - float(run.get('updated_at') or now))} for a grant on limit request "
                  f"{call.get('call_id')}: its {call.get('limit')} ({_num(call.get('used'))} of "
                  f"{_num(call.get('cap'))} used)", f"proposed  {_grant(call.get('grant'))}",
                  f"why       {call.get('reason') or ''}"]
    elif call is not None:
        lines += [f"waiting   {_age(now - float(run.get('updated_at') or now))} for a decision on call "
                  f"{call.get('call_id')}: {call.get('tool_name')}", "arguments", _indent(_args(call.get("args")))]
    transcript = run.get("transcript") or []
    asked = next((m for m in reversed(transcript) if isinstance(m, dict) and m.get("role") == "user"), None)
    if asked is not None:
        lines += ["last user message", _indent(_text(asked.get("content")))]
    said = next((m for m in reversed(transcript) if isinstance(m, dict) and m.get("role") == "assistant"), None)
    if said is not None and said.get("content"):
        lines += ["assistant said", _indent(_text(said.get("content")))]
    for call_id, decision in (run.get("decisions") or {}).items():
        if isinstance(decision, dict):
            why = f": {decision.get('reason')}" if decision.get("reason") else ""
            lines.append(f"decided   {call_id} {decision.get('decision')} by {decision.get('by')}{why}")
    return "".join(_safe(line, keep_newlines=True) + "\n" for line in lines)


def render_decision(answer: dict[str, Any]) -> str:
    decision = answer.get("decision") or {}
    run = answer.get("run") or {}
    rid = str(run.get("id"))
    if answer.get("run_resumes_on_decision"):
        then = "the gateway resumes the run now (its policy says on_decision: resume)"
    else:
        then = (f"the run waits for its owner to resume it (POST /v1/runs/{quote(rid, safe='')}/resume with "
                f"team {run.get('team')}'s key, or the run's next chat call)")
    if decision.get("kind") == "limit":
        if decision.get("decision") == "approve":
            raised = ", ".join(f"{k} {_num((decision.get('before') or {}).get(k))} -> {_num(v)}"
                               for k, v in (decision.get("after") or {}).items())
            text = f"granted more to run {run.get('team')}/{rid}: {raised}; {then}"
        else:
            note = " (the request had expired)" if decision.get("expired") else ""
            text = (f"rejected more {decision.get('limit')} for run {run.get('team')}/{rid}{note}; "
                    f"the run is {run.get('status')}")
        return _safe(text) + "\n"
    verb = "approved" if decision.get("decision") == "approve" else "rejected"
    note = " (the approval had expired: recorded as a rejection)" if decision.get("expired") else ""
    text = f"{verb} call {decision.get('call_id')} of run {run.get('team')}/{rid}{note}; {then}"
    return _safe(text) + "\n"


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _grant(grant: Any) -> str:
    if not isinstance(grant, dict) or not grant:
        return "nothing"
    return " ".join(f"{k}+{_num(v)}" for k, v in grant.items())


def _url(given: str | None, config: str | None = None) -> str:
    url = (given or (config_url(config) if config else None) or os.environ.get("GATEWAY_URL") or DEFAULT_URL).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"--url must be an http:// or https:// address, got {url!r}", 2)
    return url


def config_url(path: str) -> str:
    """The address a gateway config serves on: `server.public_url`, else http://host:port
    (a wildcard host is reached on loopback)."""
    from gateway.config.settings import ConfigError, load_config  # only when asked: the CLI stays light

    try:
        server = load_config(path).server
    except ConfigError as exc:
        raise CliError(f"--config: {exc}", 2) from None
    if server.public_url:
        return server.public_url
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(server.host, server.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{server.port}"


def _run_path(run: str, tail: str = "") -> str:
    team, _, rid = run.rpartition("/")
    query = "?" + urlencode({"team": team}) if team else ""
    return f"/v1/runs/{quote(rid, safe='')}{tail}{query}"


def _refusal(exc: urllib.error.HTTPError) -> str:
    try:
        error = json.loads(exc.read(MAX_ANSWER_BYTES)).get("error") or {}
        message = str(error.get("message") or "")
    except (ValueError, AttributeError, OSError):
        message = ""
    return f"HTTP {exc.code}: {_safe(message or exc.reason or 'refused')}"


def _args(args: Any) -> str:
    """Tool arguments pretty-printed (a JSON string of them is parsed first)."""
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return json.dumps(parsed, indent=2, ensure_ascii=False)
    return json.dumps(args, indent=2, ensure_ascii=False)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return json.dumps(content, ensure_ascii=False)


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SHORT else flat[:SHORT - 1] + "…"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines() or [""])


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _safe(text: str, *, keep_newlines: bool = False) -> str:
    """Model- and user-written text made harmless for a terminal: control characters
    (escape sequences could rewrite the screen) shown as \\xNN."""
    return "".join(c if c.isprintable() or (keep_newlines and c == "\n") else f"\\x{ord(c):02x}" for c in text)


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=True) + "\n"
