"""The audit log as the store keeps it: one record per administrative act, chained by hash.

An `AuditEntry` is what the caller says happened (`actor`: team and key id, never a secret;
`action`; `target`; `details`, with `old -> new` values for changes of limits and scope;
`team`: the team the act concerns, for filtering). The store numbers it (`seq`, one
sequence shared by every replica) and chains it: `hash` is the SHA-256 of the previous
record's hash and this record's canonical JSON, so a record changed, removed or inserted
afterwards breaks every hash after it (`verify`). Retention removes the oldest records
first; the first record kept names the hash of the one before it (`prev`), so what is left
still verifies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

GENESIS = "0" * 64
"""The `prev` of the first record ever written."""


@dataclass(frozen=True)
class AuditEntry:
    """One administrative act, before the store numbers it."""

    action: str
    actor_team: str
    actor_key: str
    target: str
    team: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    at: float = 0.0


@dataclass(frozen=True)
class AuditRecord:
    """An entry as stored: numbered and chained."""

    seq: int
    at: float
    action: str
    actor_team: str
    actor_key: str
    target: str
    team: str
    details: Mapping[str, Any]
    prev: str
    hash: str

    def body(self) -> dict[str, Any]:
        """The canonical fields the hash covers (everything but the hash itself)."""
        return {"seq": self.seq, "at": self.at, "action": self.action,
                "actor": {"team": self.actor_team, "key_id": self.actor_key}, "target": self.target,
                "team": self.team, "details": dict(self.details), "prev": self.prev}

    def to_json(self) -> dict[str, Any]:
        return {"object": "audit_record", **self.body(), "hash": self.hash}

    def stored(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_stored(cls, raw: bytes | str) -> AuditRecord:
        d = orjson.loads(raw)
        actor = d.get("actor") or {}
        return cls(int(d["seq"]), float(d["at"]), str(d["action"]), str(actor.get("team") or ""),
                   str(actor.get("key_id") or ""), str(d.get("target") or ""), str(d.get("team") or ""),
                   dict(d.get("details") or {}), str(d["prev"]), str(d["hash"]))


def digest(prev: str, body: Mapping[str, Any]) -> str:
    return hashlib.sha256(prev.encode() + b"\n" + orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def chain(last_seq: int, last_hash: str, entries: Sequence[AuditEntry], now: float) -> list[AuditRecord]:
    """`entries` numbered after `last_seq` and chained after `last_hash` (an entry without
    `at` takes `now`)."""
    out: list[AuditRecord] = []
    seq, prev = last_seq, last_hash
    for e in entries:
        seq += 1
        record = AuditRecord(seq, e.at or now, e.action, e.actor_team, e.actor_key, e.target, e.team,
                             dict(e.details), prev, "")
        h = digest(prev, record.body())
        out.append(AuditRecord(**{**record.__dict__, "hash": h}))
        prev = h
    return out


def verify(records: Iterable[AuditRecord]) -> tuple[int, str | None]:
    """(records checked, None) when each record's hash is right and names the one before it;
    else the first problem, in words."""
    prev: AuditRecord | None = None
    n = 0
    for r in records:
        if prev is not None and (r.seq != prev.seq + 1 or r.prev != prev.hash):
            return n, f"record {r.seq} does not follow record {prev.seq} (a record was removed or changed between)"
        if digest(r.prev, r.body()) != r.hash:
            return n, f"record {r.seq} ({r.action}) was changed after it was written: its hash does not match"
        prev = r
        n += 1
    return n, None


def matches(record: AuditRecord, since: float | None, action: str | None, team: str | None) -> bool:
    return ((since is None or record.at >= since) and (action is None or record.action == action)
            and (team is None or record.team == team or record.actor_team == team))
