"""Notifications without I/O: which trace lines become notices, the body a webhook is sent,
its Slack text, its signature, and the retry schedule.

A notice (what the outbox keeps) is a `Record`: the webhook it is for, the event, the team,
the run, and the trace line (or budget figures) that caused it. At delivery the record and
the run as it is then become the `Payload` (docs/notifications.md), signed as

    X-Gateway-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, NotRequired, TypedDict
from urllib.parse import quote

import orjson

from gateway.harness.state import public_run_id
from gateway.config.webhooks import NoticeEvent, WebhookConfig
from gateway.store.outbox import Notice

SIGNATURE_HEADER: Final = "X-Gateway-Signature"
SIGNATURE_TOLERANCE_S: Final = 300
"""How old (or how far in the future) a signature's timestamp may be before a receiver
rejects the message as a replay; what `verify` checks by default."""
RUN_EVENTS: Final[frozenset[str]] = frozenset({"approval_required", "approval_decided", "run_stopped"})
NOTICES: Final[Mapping[str, tuple[NoticeEvent, RequestKind | None]]] = {
    "approval_required": ("approval_required", "tool_call"),
    "approval_decided": ("approval_decided", "tool_call"),
    "limit_reached": ("approval_required", "limit"),  # only when a person is asked (`asked`)
    "limit_granted": ("approval_decided", "limit"),
    "limit_rejected": ("approval_decided", "limit"),
    "run_stopped": ("run_stopped", None),
}
"""Trace line -> the webhook event it sends, and (approvals) what is decided: a call or a limit."""
THRESHOLDS_PCT: Final = (80, 100)
RETRY_BASE_S: Final = 1.0
RETRY_CAP_S: Final = 300.0
TEXT_MAX: Final = 500
"""Characters of model- or user-controlled text (tool arguments, reasons) a Slack line shows."""


RequestKind = Literal["tool_call", "limit"]
"""What a person decides: a call (`approval.approvers`) or a limit request (`limits.ask.approvers`)."""


class Record(TypedDict):
    """What the outbox keeps of one notice (its `body`, as JSON)."""

    webhook: str
    event: NoticeEvent
    team: str
    run_id: str | None
    """The stored id (TEAM/ID); None for a budget notice."""
    detail: dict[str, Any]
    at: float
    kind: NotRequired[RequestKind]
    """Approval events: what a person decides (a record written before it existed: a call)."""


class Payload(TypedDict):
    """The JSON body a webhook receives."""

    id: str
    event: NoticeEvent
    created_at: float
    team: str
    run_id: str | None
    """The run's id as its team knows it (None: a budget notice)."""
    run: dict[str, Any] | None
    detail: dict[str, Any]
    link: str | None
    kind: NotRequired[RequestKind]
    """`approval_required` and `approval_decided`: `tool_call` or `limit`."""


def notices_for(webhooks: Sequence[WebhookConfig], run_id: str, events: Sequence[Mapping[str, Any]],
                now: float) -> list[Notice]:
    """The notices that appending `events` to the trace of stored run `run_id` causes: one per
    notifying line and webhook that wants it (its event, its team, a run_stopped's reason)."""
    team = run_id.split("/", 1)[0] if "/" in run_id else ""
    out: list[Notice] = []
    for line in events:
        kind = line.get("type")
        found = NOTICES.get(str(kind))
        if found is None or (kind == "limit_reached" and not line.get("asked")):
            continue
        event, asked = found
        reason = line.get("reason") if kind == "run_stopped" else None
        subject = line.get("runId") if isinstance(line.get("runId"), str) else run_id
        detail = {k: v for k, v in line.items() if k not in ("runId", "type")}
        for hook in webhooks:
            if hook.wants(event, team, reason if isinstance(reason, str) else None):
                record = Record(webhook=hook.name, event=event, team=team, run_id=str(subject), detail=detail,
                                at=_ts(line.get("ts"), now))
                if asked is not None:
                    record["kind"] = asked
                out.append(Notice(f"{event}:{uuid.uuid4().hex}:{hook.name}", orjson.dumps(record)))
    return out


def crossed(budget_usd: float | None, spent_usd: float) -> list[int]:
    """The thresholds (percent of the budget) that `spent_usd` has reached."""
    if budget_usd is None or budget_usd <= 0 or spent_usd <= 0:
        return []
    return [pct for pct in THRESHOLDS_PCT if spent_usd * 100 >= budget_usd * pct - 1e-9]


def budget_notice(hook: WebhookConfig, team: str, period: str, pct: int, budget_usd: float, spent_usd: float,
                  at: float) -> Notice:
    """The one notice of `team` reaching `pct`% of its budget in `period`, for `hook` (its id
    says so: the outbox keeps one per team, period, threshold and webhook)."""
    record = Record(webhook=hook.name, event="budget_threshold", team=team, run_id=None, at=at,
                    detail={"threshold_pct": pct, "period": period, "budget_usd": budget_usd,
                            "spent_usd": round(spent_usd, 9)})
    return Notice(f"budget_threshold:{team}:{period}:{pct}:{hook.name}", orjson.dumps(record), period=period)


def read_record(body: bytes) -> Record:
    """A stored notice back; ValueError if it is not one."""
    data = orjson.loads(body)
    if not isinstance(data, dict) or not isinstance(data.get("webhook"), str) or data.get("event") not in (
            *RUN_EVENTS, "budget_threshold") or not isinstance(data.get("detail"), dict):
        raise ValueError("not a notice record")
    record: Record = data  # type: ignore[assignment]  # checked above
    return record


def console_link(base: str | None, team: str, run_id: str | None) -> str | None:
    """Where a person sees what a notice is about: the run's console page, or the team's spend."""
    if base is None:
        return None
    if run_id is None:
        return f"{base}/console/spend?team={quote(team, safe='')}"
    return f"{base}/console/runs/{quote(team, safe='')}/{quote(public_run_id(run_id), safe='')}"


def payload(notice_id: str, record: Record, run: dict[str, Any] | None, base_url: str | None) -> Payload:
    """The body of a notice as sent; `run` is the run's summary at delivery (None: none/gone)."""
    rid = record["run_id"]
    body = Payload(id=notice_id, event=record["event"], created_at=record["at"], team=record["team"],
                   run_id=None if rid is None else public_run_id(rid), run=run, detail=record["detail"],
                   link=console_link(base_url, record["team"], rid))
    if record["event"] in ("approval_required", "approval_decided"):
        body["kind"] = record.get("kind", "tool_call")
    return body


def encode(body: Payload, fmt: str) -> bytes:
    """The bytes sent: the payload as JSON, or (`slack`) `{"text": ...}` for a Slack incoming webhook."""
    if fmt == "slack":
        return orjson.dumps({"text": slack_text(body)})
    return orjson.dumps(body)


def slack_text(body: Payload) -> str:
    """One line of Slack mrkdwn saying what happened; every text from a model, a client or a
    person is escaped (Slack's &, <, >) and bounded, so it cannot ping a channel or fake a link."""
    d, team = body["detail"], _esc(body["team"])
    rid = _esc(str(body["run_id"]))
    tool = _esc(str(d.get("toolName") or "a tool"))
    limit = _esc(str(d.get("limit") or "a limit"))
    if body.get("kind") == "limit" and body["event"] == "approval_required":
        grant = ", ".join(f"{_esc(str(k))} +{_esc(str(v))}" for k, v in (d.get("grant") or {}).items()) or "nothing"
        text = f":raising_hand: More needed: run `{rid}` of team *{team}* reached its `{limit}` " \
               f"({_esc(str(d.get('used')))} of {_esc(str(d.get('cap')))}) and asks for {grant}"
    elif body.get("kind") == "limit":
        verdict = "granted more" if d.get("grant") is not None else "refused more"
        why = f": {_esc(_short(d.get('reason')))}" if d.get("reason") else ""
        text = f":ballot_box_with_check: Run `{rid}` (team *{team}*) was {verdict} of its `{limit}` by " \
               f"*{_esc(str(d.get('by') or 'nobody'))}*{why}"
    elif body["event"] == "approval_required":
        text = f":raising_hand: Approval needed: run `{rid}` of team *{team}* wants to call `{tool}` with " \
               f"`{_esc(_short(d.get('args')))}`"
    elif body["event"] == "approval_decided":
        verdict = "approved" if d.get("decision") == "approve" else "rejected"
        why = f": {_esc(_short(d.get('reason')))}" if d.get("reason") else ""
        text = f":ballot_box_with_check: `{tool}` of run `{rid}` (team *{team}*) was {verdict} by " \
               f"*{_esc(str(d.get('by') or 'nobody'))}*{why}"
    elif body["event"] == "run_stopped":
        text = f":octagonal_sign: Run `{rid}` of team *{team}* stopped: {_esc(str(d.get('status')))} " \
               f"({_esc(str(d.get('reason')))}), {int(d.get('turns') or 0)} turns, ${float(d.get('costUsd') or 0):.6f}"
    else:
        text = f":warning: Team *{team}* has spent ${float(d.get('spent_usd') or 0):.6f} of its " \
               f"${float(d.get('budget_usd') or 0):.6f} budget for {_esc(str(d.get('period')))} " \
               f"({int(d.get('threshold_pct') or 0)}%)"
    link = body["link"]
    return f"{text} <{_esc(link)}|open in the console>" if link else text


def sign(secret: bytes, body: bytes, t: int) -> str:
    """The X-Gateway-Signature value of `body` sent at unix time `t`."""
    mac = hmac.new(secret, str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(secret: bytes, header: str, body: bytes, now: float, tolerance_s: float = SIGNATURE_TOLERANCE_S) -> bool:
    """What a receiver checks: a well-formed header, a timestamp within `tolerance_s` of `now`
    (an old message replayed is refused), and the HMAC of exactly these bytes, compared in
    constant time."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    t = fields.get("t", "")
    if not t.isdigit() or abs(now - int(t)) > tolerance_s or "v1" not in fields:
        return False
    return hmac.compare_digest(sign(secret, body, int(t)), f"t={t},v1={fields['v1']}")


def retry_in(attempts: int, base_s: float = RETRY_BASE_S) -> float:
    """Seconds before the next attempt after `attempts` failed ones: `base_s` (1 by default),
    then twice as long after each failure, up to 5 minutes."""
    return float(min(base_s * 2 ** max(attempts - 1, 0), RETRY_CAP_S))


def _ts(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= TEXT_MAX else text[:TEXT_MAX] + "…"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
