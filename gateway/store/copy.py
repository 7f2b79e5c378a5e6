"""`gateway db copy`: a SQLite file's or a Redis prefix's state, moved into a PostgreSQL schema.

For a team moving from one machine (SQLite) or from Redis to replicas on PostgreSQL. The
source is read as it is stored (`SqliteSource`, `RedisSource`): runs (their stored heads or
whole bodies, byte for byte, revisions and times, and the transcript items kept beside a
head), trace lines (with their numbers), ledgers (spent per
team or hold and period), spend rows, stored responses, the webhook outbox, keys (with the
key revision counter), console sessions and the audit log (with its head). What is only
alive while a process runs is not copied: reservations of calls in flight, leases, rate
clocks. Copy with the gateways stopped.

The target must be an empty schema (its migrations are applied first). Everything is
written in one transaction, so a copy that fails leaves the target as it was. Afterwards
`check` compares counts and sums of the source and the target; a difference is an error.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson

from gateway.store.base import parse_run, spend_day, to_micros
from gateway.store.errors import StoreError

BATCH = 500


@dataclass
class Totals:
    """Counts and sums of what was read or written, compared by `check`."""

    runs: int = 0
    run_cost_micros: int = 0
    run_turns: int = 0
    transcript_items: int = 0
    events: int = 0
    ledger_rows: int = 0
    ledger_micros: int = 0
    spend_micros: int = 0
    spend_calls: int = 0
    responses: int = 0
    outbox: int = 0
    keys: int = 0
    key_revision: int = 0
    sessions: int = 0
    audit: int = 0
    audit_head: int = 0

    def differences(self, other: Totals) -> list[str]:
        return [f"{name}: source {getattr(self, name)}, target {getattr(other, name)}"
                for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]


@dataclass
class Rows:
    """One batch of rows of each table, in the target's column order."""

    runs: list[tuple[Any, ...]] = field(default_factory=list)
    transcripts: list[tuple[str, int, int, bytes]] = field(default_factory=list)
    """(run_id, kind, seq, body): kind 0 a message (its JSON), 1 a turn's usage ("prompt completion")."""
    events: list[tuple[Any, ...]] = field(default_factory=list)
    ledger: list[tuple[Any, ...]] = field(default_factory=list)
    spend: list[tuple[Any, ...]] = field(default_factory=list)
    responses: list[tuple[Any, ...]] = field(default_factory=list)
    outbox: list[tuple[Any, ...]] = field(default_factory=list)
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    sessions: list[tuple[Any, ...]] = field(default_factory=list)
    audit: list[tuple[Any, ...]] = field(default_factory=list)
    key_revision: int = 0
    audit_head: tuple[int, str] | None = None


COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("id", "team", "status", "policy", "created_at", "updated_at", "revision", "turns", "cost_micros",
             "prompt_tokens", "completion_tokens", "body"),
    "transcripts": ("run_id", "kind", "seq", "body"),
    "events": ("run_id", "seq", "body"),
    "ledger": ("scope", "period", "spent_micros"),
    "spend_rows": ("day", "team", "key_id", "user", "model", "policy", "run_id", "cost_micros", "calls"),
    "responses": ("id", "team", "created_at", "body"),
    "outbox": ("id", "body", "period", "created_at", "state", "attempts", "due_at", "owner", "error", "done_at"),
    "keys": ("id", "team", "revision", "body", "last_used_at"),
    "console_sessions": ("id_hash", "key_id", "idle_until", "expires_at", "body"),
    "audit": ("seq", "at", "action", "team", "actor_team", "hash", "body"),
}


class Source(Protocol):
    """A store as it is stored, read in batches."""

    def describe(self) -> str: ...

    def batches(self) -> AsyncIterator[Rows]: ...

    async def close(self) -> None: ...


def run_row(run_id: str, team: str, status: str, policy: str, created_at: float | None, updated_at: float | None,
            revision: int, body: bytes, items: Sequence[tuple[str, int, int, bytes]] = ()) -> tuple[Any, ...]:
    """A stored run as the target's row (its turns, cost and tokens read from its head and
    its transcript `items`, which must be all the run's, in order: `Rows.transcripts`; a
    policy, creation or update time not given is the run's own)."""
    state = parse_run(run_id, body, ([i[3] for i in items if i[1] == 0],
                                     [i[3] for i in items if i[1] == 1]))
    return (run_id, team, status, policy or state.policy, state.created_at if created_at is None else created_at,
            state.updated_at if updated_at is None else updated_at, revision, state.turns,
            to_micros(state.cost_usd, "cost_usd"), state.usage.prompt_tokens, state.usage.completion_tokens, bytes(body))


def _day(value: str) -> Any:
    return datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=UTC).date()


class SqliteSource:
    """A SQLite store file, opened read-only."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            self._db.execute("SELECT 1 FROM runs LIMIT 1")
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite store {path}: cannot read it: {exc}") from exc

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def _tables(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    async def batches(self) -> AsyncIterator[Rows]:
        db, tables = self._db, self._tables()
        held = db.execute("SELECT COUNT(*) FROM reservations WHERE state = 'held'").fetchone()[0]
        if held:
            raise StoreError(f"sqlite store {self.path}: {held} calls are in flight (reservations held); stop the "
                             "gateways first")
        last = ""
        while True:
            rows = db.execute("SELECT id, team, status, policy, created_at, updated_at, revision, body FROM runs"
                              " WHERE id > ? ORDER BY id LIMIT ?", (last, BATCH)).fetchall()
            if not rows:
                break
            out = Rows()
            has_items = "transcripts" in tables
            for r in rows:
                items = [(str(i[0]), int(i[1]), int(i[2]), i[3].encode() if isinstance(i[3], str) else bytes(i[3]))
                         for i in db.execute("SELECT run_id, kind, seq, body FROM transcripts WHERE run_id = ?"
                                             " ORDER BY kind, seq", (r[0],))] if has_items else []
                out.runs.append(run_row(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], items))
                out.transcripts += items
            for run_id, *_ in rows:
                out.events += db.execute("SELECT run_id, seq, body FROM events WHERE run_id = ? ORDER BY seq",
                                         (run_id,)).fetchall()
            last = rows[-1][0]
            yield out
        # Trace lines of runs not stored (appended without a run) come along too.
        orphans = db.execute("SELECT run_id, seq, body FROM events WHERE run_id NOT IN (SELECT id FROM runs)").fetchall()
        out = Rows(events=orphans)
        out.ledger = [tuple(r) for r in db.execute("SELECT team, period, spent_micros FROM ledger")]
        if "spend" in tables:
            out.spend = [(_day(d), t, k, u, m, p, "", c, n) for d, t, k, u, m, p, c, n in db.execute(
                "SELECT day, team, key_id, user, model, policy, cost_micros, calls FROM spend")]
        out.responses = [tuple(r) for r in db.execute("SELECT id, team, created_at, body FROM responses")]
        if "outbox" in tables:
            out.outbox = [tuple(r) for r in db.execute(
                "SELECT id, body, period, created_at, state, attempts, due_at, '', error, done_at FROM outbox")]
        if "keys" in tables:
            out.keys = [tuple(r) for r in db.execute("SELECT id, team, revision, body, last_used_at FROM keys")]
            out.key_revision = int(db.execute("SELECT COALESCE(MAX(revision), 0) FROM keys").fetchone()[0])
            out.sessions = [tuple(r) for r in db.execute(
                "SELECT id_hash, key_id, idle_until, expires_at, body FROM console_sessions")]
            out.audit = [tuple(r) for r in db.execute(
                "SELECT seq, at, action, team, actor_team, hash, body FROM audit ORDER BY seq")]
            if out.audit:
                out.audit_head = (int(out.audit[-1][0]), str(out.audit[-1][5]))
        yield out

    async def close(self) -> None:
        self._db.close()


class RedisSource:
    """A Redis store's keys under one prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis.asyncio as aioredis

        self.url, self.prefix = url, prefix
        self._client: Any = aioredis.Redis.from_url(url, socket_timeout=30)  # replies vary by command

    def describe(self) -> str:
        from gateway.store.dsn import redact

        return f"redis:{redact(self.url)} prefix {self.prefix!r}"

    async def _hash(self, key: str) -> dict[str, Any]:
        raw = await self._client.hgetall(key)
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}

    async def batches(self) -> AsyncIterator[Rows]:
        p, client = self.prefix, self._client
        async for _ in client.scan_iter(match=f"{p}res:*", count=1000):
            held = await client.hget(_, "state")
            if held == b"held":
                raise StoreError("redis store: calls are in flight (reservations held); stop the gateways first")
        ids = [i.decode() for i in await client.zrange(f"{p}runs", 0, -1)]
        for start in range(0, len(ids), BATCH):
            out = Rows()
            for run_id in ids[start:start + BATCH]:
                h = await self._hash(f"{p}run:{run_id}")
                if "body" not in h:
                    continue
                body = bytes(h["body"])
                items = [(run_id, 0, i, bytes(m)) for i, m in
                         enumerate(await client.lrange(f"{p}transcript:{run_id}", 0, -1))]
                items += [(run_id, 1, i, bytes(t)) for i, t in
                          enumerate(await client.lrange(f"{p}per_turn:{run_id}", 0, -1))]
                score = await client.zscore(f"{p}runs", run_id)
                out.runs.append(run_row(run_id, _s(h.get("team")), _s(h.get("status")), _s(h.get("policy")),
                                        None if score is None else float(score), None,
                                        int(_s(h.get("revision")) or 0), body, items))
                out.transcripts += items
                lines = await client.lrange(f"{p}events:{run_id}", 0, -1)
                out.events += [(run_id, i + 1, bytes(line)) for i, line in enumerate(lines)]
            yield out
        out = Rows()
        async for key in client.scan_iter(match=f"{p}ledger:*", count=1000):
            scope = key.decode()[len(p) + len("ledger:"):]
            for name, value in (await self._hash(key.decode())).items():
                if name.startswith("spent:"):
                    out.ledger.append((scope, name[len("spent:"):], int(value)))
        for raw_day in await client.zrange(f"{p}spend:days", 0, -1):
            day = int(raw_day)
            figures: dict[str, list[int]] = {}
            for name, value in (await self._hash(f"{p}spend:{day}")).items():
                kind, _, who = name.partition(":")
                figures.setdefault(who, [0, 0])[0 if kind == "c" else 1] = int(value)
            for who, (micros, calls) in figures.items():
                team, _, attr = who.partition("\x1f")
                parts = (attr.split("\x1f") + ["", "", "", ""])[:4] if attr else ["", "", "", ""]
                out.spend.append((_day(spend_day(day * 86_400.0)), team, *parts, "", micros, calls))
        for raw in await client.zrange(f"{p}responses", 0, -1, withscores=True):
            rid = raw[0].decode()
            h = await self._hash(f"{p}response:{rid}")
            if "body" in h:
                out.responses.append((rid, _s(h.get("team")), float(raw[1]), bytes(h["body"])))
        due = {k.decode(): v / 1000 for k, v in await client.zrange(f"{p}outbox:due", 0, -1, withscores=True)}
        done = {k.decode(): v / 1000 for k, v in await client.zrange(f"{p}outbox:done", 0, -1, withscores=True)}
        async for key in client.scan_iter(match=f"{p}outbox:msg:*", count=1000):
            nid = key.decode()[len(p) + len("outbox:msg:"):]
            h = await self._hash(key.decode())
            at = done.get(nid, due.get(nid, 0.0))
            out.outbox.append((nid, bytes(h.get("body") or b""), _s(h.get("period")) or None, at,
                               _s(h.get("state")) or "pending", int(_s(h.get("attempts")) or 0), due.get(nid, at), "",
                               _s(h.get("error")), done.get(nid)))
        async for key in client.scan_iter(match=f"{p}key:*", count=1000):
            h = await self._hash(key.decode())
            if "body" in h:
                used = _s(h.get("last_used"))
                out.keys.append((key.decode()[len(p) + 4:], _s(h.get("team")), int(_s(h.get("revision"))),
                                 bytes(h["body"]), float(used) if used else None))
        out.key_revision = int(await client.get(f"{p}keys:revision") or 0)
        async for key in client.scan_iter(match=f"{p}session:*", count=1000):
            h = await self._hash(key.decode())
            if "body" in h:
                body = bytes(h["body"])
                out.sessions.append((key.decode()[len(p) + len("session:"):], str(orjson.loads(body)["key_id"]),
                                     float(_s(h.get("idle_until")) or 0), float(orjson.loads(body)["expires_at"]), body))
        from gateway.store.audit import AuditRecord

        for raw in await client.zrange(f"{p}audit", 0, -1):
            r = AuditRecord.from_stored(raw)
            out.audit.append((r.seq, r.at, r.action, r.team, r.actor_team, r.hash, bytes(raw)))
        head = await client.get(f"{p}audit:head")
        if head:
            seq, _, digest = head.decode().partition(" ")
            out.audit_head = (int(seq), digest)
        yield out

    async def close(self) -> None:
        await self._client.aclose()


def _s(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def add(totals: Totals, rows: Rows) -> None:
    totals.runs += len(rows.runs)
    totals.run_cost_micros += sum(int(r[8]) for r in rows.runs)
    totals.run_turns += sum(int(r[7]) for r in rows.runs)
    totals.transcript_items += len(rows.transcripts)
    totals.events += len(rows.events)
    totals.ledger_rows += len(rows.ledger)
    totals.ledger_micros += sum(int(r[2]) for r in rows.ledger)
    totals.spend_micros += sum(int(r[7]) for r in rows.spend)
    totals.spend_calls += sum(int(r[8]) for r in rows.spend)
    totals.responses += len(rows.responses)
    totals.outbox += len(rows.outbox)
    totals.keys += len(rows.keys)
    totals.key_revision = max(totals.key_revision, rows.key_revision)
    totals.sessions += len(rows.sessions)
    totals.audit += len(rows.audit)
    if rows.audit_head is not None:
        totals.audit_head = rows.audit_head[0]


async def copy(source: Source, dsn: str, schema: str, timeout_s: float = 60.0) -> tuple[Totals, Totals]:
    """Copy `source` into the empty `schema` of the database at `dsn` in one transaction;
    returns (what was read, what the target holds after). StoreError when the target is not
    empty or the two differ (then nothing is committed)."""
    import asyncpg

    from gateway.store.postgres import migrate
    from gateway.store.postgres_schema import quote

    await migrate(dsn, schema, timeout_s)
    conn = await asyncpg.connect(dsn, timeout=timeout_s, server_settings={"search_path": quote(schema)})
    read = Totals()
    try:
        async with conn.transaction():
            busy = await conn.fetchval("SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM keys)"
                                       " + (SELECT count(*) FROM ledger) + (SELECT count(*) FROM audit)")
            if busy:
                raise StoreError(f"postgres schema {schema} is not empty: copy into a new schema (store.schema)")
            async for rows in source.batches():
                add(read, rows)
                await _write(conn, rows)
            after = await totals(conn)
            wrong = read.differences(after)
            if wrong:
                raise StoreError("the copy does not match its source (nothing was written): " + "; ".join(wrong))
    finally:
        await conn.close()
    return read, after


async def _write(conn: Any, rows: Rows) -> None:
    for table, records in (("runs", rows.runs), ("transcripts", rows.transcripts), ("events", rows.events), ("ledger", rows.ledger),
                           ("spend_rows", rows.spend), ("responses", rows.responses), ("outbox", rows.outbox),
                           ("keys", rows.keys), ("console_sessions", rows.sessions), ("audit", rows.audit)):
        if records:
            await conn.copy_records_to_table(table, records=records, columns=list(COLUMNS[table]))
    if rows.events:
        await conn.execute("INSERT INTO event_heads (run_id, last_seq) SELECT run_id, max(seq) FROM events"
                           " GROUP BY run_id ON CONFLICT (run_id) DO UPDATE SET last_seq = excluded.last_seq")
    if rows.key_revision:
        await conn.execute("UPDATE counters SET value = GREATEST(value, $1) WHERE name = 'keys'", rows.key_revision)
    if rows.audit_head is not None:
        await conn.execute("UPDATE audit_head SET seq = $1, hash = $2", *rows.audit_head)


async def totals(conn: Any) -> Totals:
    """The target's counts and sums."""
    r = await conn.fetchrow("""
        SELECT (SELECT count(*) FROM runs), (SELECT COALESCE(sum(cost_micros), 0) FROM runs),
               (SELECT COALESCE(sum(turns), 0) FROM runs), (SELECT count(*) FROM transcripts),
               (SELECT count(*) FROM events),
               (SELECT count(DISTINCT (scope, period)) FROM ledger), (SELECT COALESCE(sum(spent_micros), 0) FROM ledger),
               (SELECT COALESCE(sum(cost_micros), 0) FROM spend_rows), (SELECT COALESCE(sum(calls), 0) FROM spend_rows),
               (SELECT count(*) FROM responses), (SELECT count(*) FROM outbox), (SELECT count(*) FROM keys),
               (SELECT value FROM counters WHERE name = 'keys'), (SELECT count(*) FROM console_sessions),
               (SELECT count(*) FROM audit), (SELECT seq FROM audit_head)""")
    return Totals(*(int(v) for v in r))


def parse_source(spec: str, prefix: str) -> Source:
    """`sqlite:PATH` or `redis://...` (with `prefix`) as a Source."""
    if spec.startswith("sqlite:"):
        return SqliteSource(spec[len("sqlite:"):])
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisSource(spec, prefix)
    if spec.startswith("redis:"):
        return RedisSource(spec[len("redis:"):], prefix)
    raise ValueError(f"--from: expected sqlite:PATH or a redis:// URL, got {spec!r}")


def report(read: Totals, written: Totals) -> Sequence[str]:
    return [f"{name:>16}  {getattr(read, name):>14}  {getattr(written, name):>14}"
            for name in read.__dataclass_fields__]
