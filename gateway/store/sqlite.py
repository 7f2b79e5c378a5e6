"""The SQLite store: one file, WAL, durable against a crash of the process.

Every commit is in the WAL before it returns (`sqlite_schema.connect`): a SIGKILL right
after a save loses nothing. Checkpoints (the fsyncs) run in a thread of their own, off
the event loop (`sqlite_wal`). The stdlib driver is called synchronously from the async
methods on purpose: a statement takes microseconds, less than a hop to a thread would.
Every write is atomic across the processes that open the same file (one statement in
autocommit, or a BEGIN IMMEDIATE transaction), and runs at once when this store serves
one call at a time; while other calls of this process are in flight, which it tells by
the reservations it holds for them, the writes of one event-loop turn share one
transaction (`sqlite_batch`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import orjson

from gateway.harness.state import STATUSES, RunState
from gateway.store.audit import GENESIS, AuditEntry, AuditRecord, chain
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    Attribution,
    Hold,
    SpendRow,
    spend_day,
    EXPIRED_RETENTION_S,
    PRUNE_BATCH,
    Booking,
    Claim,
    ClockPush,
    Event,
    Figures,
    Grant,
    Lease,
    ReloadMark,
    Ledger,
    RateLimit,
    RateState,
    TokenCharge,
    check_list_args,
    check_ttl,
    from_micros,
    judge,
    new_reservation_id,
    optional_micros,
    RunWrite,
    new_run_write,
    parse_run,
    run_write,
    to_micros,
)
from gateway.store.errors import (
    AlreadyBooked,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    RunExists,
    RunNotFound,
    StaleKey,
    StaleRun,
    StoreError,
)
from gateway.store.keys import ConsoleSession, KeyRecord, check_key_revision
from gateway.store.outbox import Claimed, Notice, NoticeRule, check_notices, notices_of
from gateway.store.periods import ended_before as period_ended
from gateway.store.sqlite_batch import Step, WriteBatch
from gateway.store.sqlite_schema import (
    BUSY_TIMEOUT_S,
    LIVE,
    MIGRATIONS,
    Immediate,
    Translate,
    connect,
    migrate,
)
from gateway.store.sqlite_rates import (
    ADMIT_ARGS,
    RatePlan,
    in_flight_arg,
    numbered,
    rate_plan,
    spent,
    team_in_flight,
)
from gateway.store.sqlite_rates import in_flight as count_in_flight
from gateway.store.sqlite_wal import FENCE_FRAMES, PAGE_BYTES, Checkpointer

__all__ = ["MIGRATIONS", "SqliteStore", "connect", "migrate"]

log = logging.getLogger(__name__)
T = TypeVar("T")

JOURNAL_SIZE_LIMIT: Final = FENCE_FRAMES * PAGE_BYTES
"""A WAL that grew past this (32 MiB, where a fence starts) is truncated back to it when it restarts."""
FINISHED: Final = tuple(s for s in STATUSES if s != "running")
"""The statuses retention may prune: a `running` run is between calls or being driven."""
MAX_RATE_PLANS: Final = 1024
"""Admission statements kept by set of rate scopes (config makes one set per team and key)."""
RECLAIM_EVERY_S: Final = 1.0
"""How often a team's expired reservations are marked (and forgotten past the retention) by
`reserve`, at the latest; sooner when one this store made expires. The budget check itself
never counts an expired reservation, marked or not."""


_LIVE: Final = LIVE
_NOBODY: Final = Attribution()
_DAYS: dict[int, str] = {}


def _day() -> str:
    """Today (UTC) as a spend row's day, formatted once a day."""
    now = time.time()
    n = int(now // 86_400)
    day = _DAYS.get(n)
    if day is None:
        _DAYS.clear()
        day = _DAYS[n] = spend_day(now)
    return day
_ADMIT: Final = (
    "INSERT INTO reservations (id, team, period, amount_micros, expires_at, run_id, owner, scopes, budgets, attrib"
    "{clocks})"
    " SELECT :id, :team, :period, :amount, :expires, :run, :owner, :scopes, :budgets, :attrib{values}"
    " WHERE (:run IS NULL OR EXISTS (SELECT 1 FROM runs WHERE id = :run))"
    " AND (:max_turns IS NULL OR (SELECT turns FROM runs WHERE id = :run)"
    f"      + (SELECT COUNT(*) FROM reservations WHERE run_id = :run AND {_LIVE}) < :max_turns)"
    " AND (:max_in_flight IS NULL"
    f"      OR (SELECT COUNT(*) FROM reservations WHERE run_id = :run AND {_LIVE}) < :max_in_flight)"
    " AND (:run_budget IS NULL OR (SELECT cost_micros FROM runs WHERE id = :run)"
    f"      + (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations WHERE run_id = :run AND {_LIVE})"
    "       + :amount <= :run_budget)"
    " AND (:budget IS NULL OR (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = :team AND period = :period)"
    "      + (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations"
    f"         WHERE team = :team AND period = :period AND {_LIVE}) + :amount <= :budget)"
    # The team's calls in flight when that is all its rate limits check (a call whose request
    # and tokens were taken ahead): checked here, so that such a call shares this statement.
    f" AND (:team_in_flight IS NULL OR {team_in_flight(':team')} < :team_in_flight)"
    "{holds}"
)
"""Checks every condition of a `Claim` and holds it, in one statement (atomic on its own)."""
_HOLD: Final = (
    " AND (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = :hs{i} AND period = :hp{i})"
    " + (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations WHERE instr(budgets, :ht{i}) > 0 AND "
    + _LIVE.replace("{", "{{").replace("}", "}}") + ") + :amount <= :hb{i}")
"""A hold's budget check (base.Hold): its ledger row (team = its scope) and the live
reservations that list it in `budgets` (a scan of the calls in flight, as a key's calls in
flight are counted)."""


def _admit_template(holds: int) -> str:
    """The admission statement for a claim with `holds` holds (`{clocks}`, `{values}` left for the rate plan)."""
    return _ADMIT.replace("{holds}", "".join(_HOLD.format(i=i) for i in range(holds)))


def _hold_names(holds: int) -> tuple[str, ...]:
    return tuple(f"{k}{i}" for i in range(holds) for k in ("hs", "hp", "ht", "hb"))
_REVISION: Final = "(SELECT revision FROM runs WHERE id = :run)"
"""The run's stored revision, read back by the admission's RETURNING (`Grant.run_revision`):
a statement less than a SELECT after it (3 us a call)."""

_HELD: Final = "SELECT 1 FROM leases WHERE run_id = ? AND owner = ? AND epoch = ? AND expires_at > 0"
"""Whether a lease (run, owner, epoch) is still the last one taken on its run and not released."""
_READ_CLOCK: Final = "SELECT requests_tat, tokens_tat FROM reservations WHERE id = ?"
_CLOCK_ROW: Final = ("INSERT OR IGNORE INTO reservations (id, team, period, amount_micros, expires_at, state)"
                     " VALUES (?1, ?1, '', 0, 0, 'clock')")
"""A scope's clock row (sqlite_schema: a row of the reservations table, id = the scope)."""
_PUSH_CLOCKS: Final = (
    "UPDATE reservations SET"
    " requests_tat = CASE WHEN ?2 = 0 THEN requests_tat ELSE MAX(COALESCE(requests_tat, 0), ?1) + ?2 END,"
    " tokens_tat = CASE WHEN ?3 = 0 THEN tokens_tat ELSE MAX(COALESCE(tokens_tat, 0), ?1) + ?3 END"
    " WHERE id = ?4 AND state = 'clock'")
"""Moves a scope's clocks (`Store.push_clocks`, and a booking's token reconcile): ?1 now, ?2
and ?3 the seconds to push each kind by (0: left as it is), ?4 the scope."""
_FIGURES: Final = (
    "SELECT (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = :team AND period = :period),"
    f" (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations WHERE team = :team AND period = :period AND {_LIVE}),"
    " (SELECT turns FROM runs WHERE id = :run), (SELECT cost_micros FROM runs WHERE id = :run),"
    f" (SELECT COUNT(*) FROM reservations WHERE run_id = :run AND {_LIVE}),"
    f" (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations WHERE run_id = :run AND {_LIVE})"
)

_HOLD_FIGURES: Final = (
    "SELECT (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = :scope AND period = :period),"
    f" (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations WHERE instr(budgets, :tag) > 0 AND {_LIVE})")
_SPEND: Final = (
    "INSERT INTO spend (day, team, key_id, user, model, policy, cost_micros, calls) VALUES (?, ?, ?, ?, ?, ?, ?, 1)"
    " ON CONFLICT (day, team, key_id, user, model, policy) DO UPDATE"
    " SET cost_micros = cost_micros + excluded.cost_micros, calls = calls + 1")
"""A booking's spend added to its day's row (base.SpendRow)."""


def _size(written: RunWrite) -> int:
    return len(written.head) + sum(len(m) for m in written.messages)


def _write_transcript(db: sqlite3.Connection, run_id: str, written: RunWrite) -> None:
    """A save's transcript rows (`RunWrite`), in the caller's transaction: messages are rows
    of kind 0, `per_turn` entries rows of kind 1 ("prompt completion", or JSON holding the
    turn's call ids: `base.turn_item`), as TEXT."""
    if written.truncates:
        db.execute("DELETE FROM transcripts WHERE run_id = ?1 AND (kind = 0 AND seq >= ?2 OR kind = 1 AND seq >= ?3)",
                   (run_id, written.messages_from, written.per_turn_from))
    rows: list[tuple[str, int, int, bytes | str]] = [
        (run_id, 0, written.messages_from + i, m) for i, m in enumerate(written.messages)]
    rows += [(run_id, 1, written.per_turn_from + i, t.decode()) for i, t in enumerate(written.per_turn)]
    if len(rows) <= len(_INSERT_ITEMS):  # a turn's few rows: one statement, no executemany iterator
        if rows:
            db.execute(_INSERT_ITEMS[len(rows) - 1], [v for row in rows for v in row])
    else:
        db.executemany(_INSERT_ITEMS[0], rows)


_INSERT_ITEMS: Final = tuple("INSERT INTO transcripts (run_id, kind, seq, body) VALUES " + ", ".join(["(?, ?, ?, ?)"] * n)
                             for n in range(1, 9))
"""The INSERT of 1 to 8 transcript rows in one statement."""


def _read_run(db: sqlite3.Connection, run_id: str, body: bytes | str) -> RunState:
    """A run from its head and the rows beside it, in the caller's read transaction (a body
    of schema 1 to 4 holds its transcript itself: no rows)."""
    if b'"transcript":{' not in (body.encode() if isinstance(body, str) else body):  # migrated bodies are TEXT
        return parse_run(run_id, body)
    messages: list[bytes] = []
    entries: list[bytes | str] = []
    for kind, item in db.execute("SELECT kind, body FROM transcripts WHERE run_id = ? ORDER BY kind, seq", (run_id,)):
        if kind == 0:
            messages.append(item)
        else:
            entries.append(item)
    return parse_run(run_id, body, (messages, entries))


class _Snapshot:
    """`with _Snapshot(db):` one read transaction (a head and its rows from the same commit),
    unless the connection is in one already."""

    __slots__ = ("db", "began")

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.began = False

    def __enter__(self) -> None:
        if not self.db.in_transaction:
            self.db.execute("BEGIN")
            self.began = True

    def __exit__(self, *exc: object) -> None:
        if self.began:
            self.db.execute("COMMIT")


def _fence(db: sqlite3.Connection, lease: Lease | None) -> None:
    """LeaseLost (nothing written yet) unless `lease`, when given, is still its run's last
    lease taken (a released one has expires_at 0)."""
    if lease is not None and db.execute(_HELD, (lease.run_id, lease.owner, lease.epoch)).fetchone() is None:
        raise LeaseLost(lease.run_id, lease.epoch)


class SqliteStore:
    """The store in one SQLite file; several processes may open the same file."""

    lookup_in_admission = False  # a look-up is cheap here

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._errors = Translate(self.path)
        self._conn: sqlite3.Connection | None = connect(self.path)
        self._reclaim_due: dict[str, float] = {}
        self._held: dict[str, float] = {}  # reservations this store made and nobody settled yet -> expiry
        self._plain: dict[tuple[bool, int], str] = {}  # without rate limits: by (without a run, holds)
        self._rate_plans: dict[tuple[tuple[RateLimit, ...], int], RatePlan] = {}  # by rate scopes and holds
        self._clock_rows: set[str] = set()  # scopes whose clock row this store made sure of
        self.notice_rule: NoticeRule | None = None
        self._batch = WriteBatch(self._db, self._translate, (StaleRun, RunNotFound, RunExists, AlreadyBooked,
                                                             KeyExists, KeyNotFound, StaleKey, LeaseLost))
        try:
            with self._errors:
                self._conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpointer's thread does it
                self._conn.execute(f"PRAGMA journal_size_limit = {int(JOURNAL_SIZE_LIMIT)}")
                self._wal = Checkpointer(self.path, BUSY_TIMEOUT_S)
        except BaseException:
            self._conn.close()
            raise

    def _translate(self, exc: Exception) -> Exception:
        if isinstance(exc, sqlite3.Error):
            error = StoreError(f"sqlite store {self.path}: {exc}")
            error.__cause__ = exc
            return error
        return exc

    async def _write(self, step: Step[T], *, atomic: bool, mine: str | None = None,
                     skip_if_cancelled: bool = False, size: int = 0) -> T:
        """Run a write: at once when no other call of this process is in flight (no
        reservation held but `mine`), else in this loop turn's batch. Alone, a step that is
        not `atomic` (each of its statements is, and it needs no more) runs in autocommit,
        which spares a BEGIN and a COMMIT round trip. `size`: about how many bytes it stores,
        when that can be large (a run's transcript, trace lines), for the WAL's bound."""
        fence = self._wal.write(size)
        if fence is not None:  # rarely: the checkpointer needs the WAL still (see sqlite_wal)
            await asyncio.shield(fence)
        if not self._batch.pending and len(self._held) <= (1 if mine in self._held else 0):
            if not atomic:
                with self._errors:
                    return step(self._db())
            with self._errors, self._immediate() as db:
                return step(db)
        return await self._batch.submit(step, skip_if_cancelled=skip_if_cancelled)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"sqlite store {self.path} is closed")
        return self._conn

    def _immediate(self) -> Immediate:
        """`with self._immediate() as db:` one BEGIN IMMEDIATE transaction, rolled back on any error."""
        return Immediate(self._db())

    async def create_run(self, state: RunState) -> None:
        written = new_run_write(state)
        await self._write(self._inserter(state, written), atomic=True, size=_size(written))
        state.mark_stored()

    @staticmethod
    def _inserter(state: RunState, written: RunWrite | None = None) -> Step[None]:
        """The step that stores a new run (RunExists, nothing written, if the id is taken);
        `written`: its rows, when the caller made them already."""
        written = new_run_write(state) if written is None else written
        row = (state.run_id, state.team, state.status, state.policy, state.created_at, state.updated_at,
               state.revision, written.head, state.turns, to_micros(state.cost_usd, "cost_usd"))

        def step(db: sqlite3.Connection) -> None:
            try:
                db.execute("INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, body, turns,"
                           " cost_micros) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            except sqlite3.IntegrityError as exc:
                raise RunExists(state.run_id) from exc
            _write_transcript(db, state.run_id, written)

        return step

    async def load_run(self, run_id: str) -> RunState | None:
        with self._errors:
            db = self._db()
            with _Snapshot(db):
                row = db.execute("SELECT body FROM runs WHERE id = ?", (run_id,)).fetchone()
                return None if row is None else _read_run(db, run_id, row[0])

    async def save_run(self, state: RunState, *, lease: Lease | None = None) -> None:
        now = time.time()
        revision = state.revision + 1
        written = run_write(state, revision, now)

        def step(db: sqlite3.Connection) -> None:
            _fence(db, lease)
            self._update_run(db, state, revision, now, written)

        # The head's UPDATE is conditional on the revision; a transaction keeps the
        # transcript's rows with it (and the lease's check, when there is one).
        await self._write(step, atomic=lease is not None or bool(written.messages or written.per_turn
                                                                  or written.truncates), size=_size(written))
        state.revision = revision
        state.updated_at = now
        state.mark_stored()

    @classmethod
    def _update_run(cls, db: sqlite3.Connection, state: RunState, revision: int, now: float,
                    written: RunWrite) -> None:
        cls._update_head(db, state, revision, now, written.head)
        _write_transcript(db, state.run_id, written)

    @staticmethod
    def _update_head(db: sqlite3.Connection, state: RunState, revision: int, now: float, body: bytes) -> None:
        # SQLite rewrites an index whenever its column is SET, changed or not: the usual save
        # (same team, status and policy) leaves them out, which keeps the two run indexes clean.
        cost = to_micros(state.cost_usd, "cost_usd")
        cur = db.execute(
            "UPDATE runs SET updated_at = ?, revision = ?, body = ?, turns = ?, cost_micros = ?"
            " WHERE id = ? AND revision = ? AND team = ? AND status = ? AND policy = ?",
            (now, revision, body, state.turns, cost, state.run_id, state.revision, state.team, state.status,
             state.policy),
        )
        if cur.rowcount == 1:
            return
        cur = db.execute(
            "UPDATE runs SET team = ?, status = ?, policy = ?, updated_at = ?, revision = ?, body = ?, turns = ?,"
            " cost_micros = ? WHERE id = ? AND revision = ?",
            (state.team, state.status, state.policy, now, revision, body, state.turns, cost, state.run_id,
             state.revision),
        )
        if cur.rowcount != 1:
            row = db.execute("SELECT revision FROM runs WHERE id = ?", (state.run_id,)).fetchone()
            if row is None:
                raise RunNotFound(state.run_id)
            raise StaleRun(state.run_id, state.revision, int(row[0]))

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None,
                          audit: Sequence[AuditEntry] = (), *, lease: Lease | None = None) -> Ledger | None:
        actual = 0 if booking is None else to_micros(booking.actual_usd, "actual_usd")
        now = time.time()
        revision = state.revision + 1
        written = run_write(state, revision, now)
        encoded = [orjson.dumps(e) for e in events]
        notices = self._notices(state.run_id, events)
        mine = None if booking is None else booking.reservation_id

        def step(db: sqlite3.Connection) -> Ledger | None:  # a refusal undoes all of it
            _fence(db, lease)
            if booking is not None and booking.if_held and booking.reservation_id is not None and db.execute(
                    "SELECT 1 FROM reservations WHERE id = ?", (booking.reservation_id,)).fetchone() is None:
                raise AlreadyBooked(booking.reservation_id)
            self._update_run(db, state, revision, now, written)
            if encoded:
                self._insert_events(db, state.run_id, encoded)
            if notices:
                self._insert_notices(db, notices)
            if audit:
                self._insert_audit(db, audit)
            if booking is None:
                return None
            if booking.reservation_id is not None:
                self._settle(db, booking.reservation_id, actual, booking.tokens)
            elif actual:
                self._book(db, booking.team, booking.period, actual, booking.attribution)
            return self._spend(db, booking.team, booking.period)

        try:
            ledger = await self._write(step, atomic=True, mine=mine,
                                       size=_size(written) + sum(len(e) for e in encoded))
        except asyncio.CancelledError:
            self._held.pop(mine or "", None)  # the batch commits it all the same
            raise
        self._held.pop(mine or "", None)
        state.revision = revision
        state.updated_at = now
        state.mark_stored()
        return ledger

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100,
                        policies: Collection[str] | None = None) -> list[RunState]:
        check_list_args(status, limit, policies)
        where: list[str] = []
        params: list[Any] = []
        if policies is not None:
            if not policies:
                return []
            names = sorted(set(policies))
            where.append(f"policy IN ({', '.join('?' * len(names))})")
            params.extend(names)
        if team is not None:
            where.append("team = ?")
            params.append(team)
        if status is not None:
            where.append("status = ?")
            params.append(status)
        sql = "SELECT id, body FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        with self._errors:
            db = self._db()
            with _Snapshot(db):
                rows = db.execute(sql, (*params, limit)).fetchall()
                return [_read_run(db, run_id, body) for run_id, body in rows]

    async def append_events(self, run_id: str, events: list[Event], *, lease: Lease | None = None) -> None:
        if not events:
            return
        encoded = [orjson.dumps(e) for e in events]
        notices = self._notices(run_id, events)

        def step(db: sqlite3.Connection) -> None:
            _fence(db, lease)
            self._insert_events(db, run_id, encoded)
            if notices:
                self._insert_notices(db, notices)

        await self._write(step, atomic=len(encoded) > 1 or bool(notices) or lease is not None,
                          size=sum(len(e) for e in encoded))

    def _notices(self, run_id: str, events: list[Event]) -> Sequence[Notice]:
        return notices_of(self.notice_rule, run_id, events)

    @staticmethod
    def _insert_notices(db: sqlite3.Connection, notices: Sequence[Notice]) -> int:
        now = time.time()
        added = 0
        for n in notices:
            added += db.execute("INSERT OR IGNORE INTO outbox (id, body, period, created_at, due_at)"
                                " VALUES (?, ?, ?, ?, ?)", (n.id, n.body, n.period, now, now)).rowcount
        return added

    async def enqueue_notices(self, notices: Sequence[Notice]) -> int:
        check_notices(notices)
        if not notices:
            return 0
        return await self._write(lambda db: self._insert_notices(db, notices), atomic=len(notices) > 1)

    async def claim_notices(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        lease = check_ttl(lease_s, "lease_s", allow_zero=False)
        with self._errors:  # a read first: an idle outbox never takes the write lock
            if self._db().execute("SELECT 1 FROM outbox WHERE state = 'pending' AND due_at <= ? LIMIT 1",
                                  (time.time(),)).fetchone() is None:
                return []

        def step(db: sqlite3.Connection) -> list[Claimed]:
            now = time.time()
            rows = db.execute(
                "UPDATE outbox SET due_at = ?, owner = ? WHERE id IN (SELECT id FROM outbox"
                " WHERE state = 'pending' AND due_at <= ? ORDER BY due_at LIMIT ?) RETURNING id, body, attempts",
                (now + lease, owner, now, limit)).fetchall()
            return [Claimed(str(i), bytes(b), int(a)) for i, b, a in rows]

        return await self._write(step, atomic=False)  # one statement

    async def notice_sent(self, notice_id: str) -> None:
        def step(db: sqlite3.Connection) -> None:
            db.execute("UPDATE outbox SET state = 'delivered', done_at = ?, attempts = attempts + 1, owner = ''"
                       " WHERE id = ? AND state = 'pending'", (time.time(), notice_id))

        await self._write(step, atomic=False)

    async def notice_failed(self, notice_id: str, owner: str, retry_in_s: float | None, error: str) -> None:
        retry = None if retry_in_s is None else check_ttl(retry_in_s, "retry_in_s", allow_zero=True)

        def step(db: sqlite3.Connection) -> None:
            now = time.time()
            if retry is None:
                db.execute("UPDATE outbox SET state = 'failed', done_at = ?, attempts = attempts + 1, owner = '',"
                           " error = ? WHERE id = ? AND state = 'pending' AND owner = ?", (now, error, notice_id, owner))
            else:
                db.execute("UPDATE outbox SET due_at = ?, attempts = attempts + 1, owner = '', error = ?"
                           " WHERE id = ? AND state = 'pending' AND owner = ?", (now + retry, error, notice_id, owner))

        await self._write(step, atomic=False)

    async def outbox_depth(self) -> int:
        with self._errors:
            return int(self._db().execute("SELECT COUNT(*) FROM outbox WHERE state = 'pending'").fetchone()[0])

    async def prune_outbox(self, done_before: float) -> int:
        def step(db: sqlite3.Connection) -> int:
            rows = db.execute("SELECT id, period FROM outbox WHERE done_at < ?", (done_before,)).fetchall()
            old = [(i,) for i, period in rows if period is None or period_ended(str(period), done_before)]
            db.executemany("DELETE FROM outbox WHERE id = ?", old)
            return len(old)

        return await self._write(step, atomic=True)

    @staticmethod
    def _insert_events(db: sqlite3.Connection, run_id: str, encoded: list[bytes]) -> None:
        # Each line takes the next number (inside the caller's write transaction).
        sql = "INSERT INTO events (run_id, seq, body) SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2 FROM events WHERE run_id = ?1"
        if len(encoded) == 1:  # the usual turn: one line, without executemany's iterator
            db.execute(sql, (run_id, encoded[0]))
        else:
            db.executemany(sql, [(run_id, raw) for raw in encoded])

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        with self._errors:
            rows = self._db().execute(
                "SELECT seq, body FROM events WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, after)
            ).fetchall()
        return [(int(seq), orjson.loads(body)) for seq, body in rows]

    async def reserve(
        self, team: str, period: str, amount_usd: float, budget_usd: float, ttl_s: float = DEFAULT_RESERVATION_TTL_S
    ) -> str | None:
        to_micros(budget_usd, "budget_usd")
        return (await self.admit(Claim(team, period, amount_usd, budget_usd, ttl_s=ttl_s))).reservation_id

    async def admit(self, claim: Claim) -> Grant:
        amount = to_micros(claim.amount_usd, "amount_usd")
        budget = optional_micros(claim.budget_usd, "budget_usd")
        run_budget = optional_micros(claim.run_budget_usd, "run_budget_usd")
        holds = len(claim.holds)
        shape = (claim.run_id is None, holds)
        sql = self._plain.get(shape) or self._plain_sql(*shape)
        plan, team_in_flight = None, None
        missing: tuple[tuple[str], ...] = ()
        if claim.rates:
            plan = self._rate_plans.get((claim.rates, holds))
            if plan is None:
                if len(self._rate_plans) >= MAX_RATE_PLANS:  # claims made up by hand, not from config
                    self._rate_plans.clear()
                plan = self._rate_plans[(claim.rates, holds)] = rate_plan(
                    claim.rates, _admit_template(holds), _REVISION, (*ADMIT_ARGS, *_hold_names(holds)))
            if plan.own_team == claim.team:
                team_in_flight = plan.own_in_flight  # the statement without rate limits checks it
            else:
                sql = plan.sql
            if not self._clock_rows.issuperset(plan.clocked):
                missing = tuple((scope,) for scope in plan.clocked if scope not in self._clock_rows)
        ttl = check_ttl(claim.ttl_s, "ttl_s", allow_zero=True)
        returning = claim.run_id is not None or (plan is not None and team_in_flight is None)
        granted: list[tuple[str, float]] = []
        create = None if claim.create is None else self._inserter(claim.create)
        attrib = None if claim.attribution is None else claim.attribution.encoded()
        budgets, held = None, cast(tuple[Any, ...], ())
        if claim.holds:
            budgets = "".join(h.tag for h in claim.holds)
            held = tuple(v for h in claim.holds for v in (h.scope, h.period, h.tag, to_micros(h.budget_usd, "budget")))

        def step(db: sqlite3.Connection) -> Grant:
            if create is not None:  # first, so that a taken id refuses before anything is written
                create(db)
            now = time.time()
            due = self._reclaim_due.get(claim.team, 0.0)
            if now >= due:
                self._reclaim(db, claim.team, now)
                due = now + RECLAIM_EVERY_S
            if missing:  # once per scope and store: the row the clocks live in
                db.executemany(_CLOCK_ROW, missing)
                self._clock_rows.update(scope for scope, in missing)
            rid = new_reservation_id()
            args: tuple[Any, ...] = (rid, claim.team, claim.period, amount, now + ttl, claim.run_id, claim.owner,
                                     None if plan is None else plan.scopes, now, claim.max_turns,
                                     claim.max_in_flight, run_budget, budget, team_in_flight, budgets,
                                     attrib)  # ADMIT_ARGS
            if held:
                args += held
            if plan is not None and plan.args is not None and team_in_flight is None:
                args += (claim.tokens, *plan.args)
            cursor = db.execute(sql, args)
            rows = cursor.fetchall() if returning else None  # all: it ends the statement (and its write)
            inserted = bool(rows) if rows is not None else cursor.rowcount == 1
            self._reclaim_due[claim.team] = min(due, now + ttl) if inserted else due
            if not inserted:
                # Why, from figures read right after; another process may have moved them
                # since (then "busy": a retry may pass).
                figures, run_exists = self._figures(db, claim.team, claim.period, claim.run_id, now, claim.holds)
                rates = tuple(self._rate_state(db, r, now) for r in claim.rates)
                return Grant(None, judge(claim, figures, run_exists, rates) or "busy", figures, rates)
            granted.append((rid, now + ttl))
            row = rows[0] if rows else None
            revision = None if row is None or claim.run_id is None else int(row[-1])  # RETURNING ends with it
            if plan is None:
                return Grant(rid, run_revision=revision)
            if team_in_flight is not None:  # one scope, no clocks
                return Grant(rid, rates=(RateState(claim.rates[0].scope, now),), run_revision=revision)
            return Grant(rid, rates=spent(plan, claim.rates, row, now, claim.tokens), run_revision=revision)

        try:
            # One INSERT checks and holds at once (its trigger spends the rate clocks); marking
            # expired ones needs no atomicity. With a new run, its INSERT and the reservation's
            # share one transaction (one commit).
            grant = await self._write(step, atomic=create is not None, skip_if_cancelled=True)
        except asyncio.CancelledError:
            if granted:  # a batch made it for a caller who left meanwhile: give it back
                self._give_back(granted[0][0])
            raise
        if grant.reservation_id is not None:
            self._held[grant.reservation_id] = granted[0][1]
        if claim.create is not None:  # stored, granted or not
            claim.create.mark_stored()
        return grant

    def _plain_sql(self, without_run: bool, holds: int) -> str:
        """The admission statement of a claim without rate limits (numbered), made once per shape."""
        plain = _admit_template(holds).format(clocks="", values="")
        sql = numbered(plain if without_run else plain + " RETURNING " + _REVISION, (*ADMIT_ARGS, *_hold_names(holds)))
        self._plain[(without_run, holds)] = sql
        return sql

    @staticmethod
    def _rate_state(db: sqlite3.Connection, limit: RateLimit, now: float) -> RateState:
        row = db.execute(_READ_CLOCK, (limit.scope,)).fetchone()
        in_flight = 0
        if limit.max_in_flight is not None:
            in_flight = int(db.execute("SELECT " + count_in_flight(limit.scope, ":arg"),
                                       {"arg": in_flight_arg(limit.scope), "now": now}).fetchone()[0])
        requests_tat, tokens_tat = row or (0.0, 0.0)
        return RateState(limit.scope, now, requests_tat or 0.0, tokens_tat or 0.0, in_flight)

    async def figures(self, team: str, period: str, run_id: str | None = None,
                      holds: Sequence[Hold] = ()) -> Figures:
        with self._errors:
            return self._figures(self._db(), team, period, run_id, time.time(), holds)[0]

    @staticmethod
    def _figures(db: sqlite3.Connection, team: str, period: str, run_id: str | None,
                 now: float, holds: Sequence[Hold] = ()) -> tuple[Figures, bool]:
        spent, reserved, turns, cost, in_flight, held = db.execute(_FIGURES, {
            "team": team, "period": period, "run": run_id, "now": now}).fetchone()
        of_holds = tuple(
            (from_micros(int(s)), from_micros(int(r))) for s, r in (db.execute(_HOLD_FIGURES, {
                "scope": h.scope, "period": h.period, "tag": h.tag, "now": now}).fetchone() for h in holds))
        figures = Figures(from_micros(int(spent)), from_micros(int(reserved)), int(turns or 0), int(in_flight),
                          from_micros(int(cost or 0)), from_micros(int(held)), of_holds)
        return figures, turns is not None

    async def renew(self, reservation_ids: Sequence[str], ttl_s: float) -> None:
        if not reservation_ids:
            return
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)
        ids = list(reservation_ids)

        def step(db: sqlite3.Connection) -> None:
            until = time.time() + ttl
            db.executemany("UPDATE reservations SET expires_at = MAX(expires_at, ?) WHERE id = ? AND state = 'held'",
                           [(until, rid) for rid in ids])
            for rid in ids:
                if rid in self._held:
                    self._held[rid] = max(self._held[rid], until)

        await self._write(step, atomic=True)

    async def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        kept = orjson.dumps(sorted(keep)).decode()

        def step(db: sqlite3.Connection) -> int:
            db.execute("UPDATE leases SET expires_at = 0 WHERE owner = ? AND owner != ''", (owner,))
            db.execute("UPDATE outbox SET due_at = ?, owner = '' WHERE state = 'pending' AND owner = ? AND owner != ''",
                       (time.time(), owner))
            return int(db.execute("DELETE FROM reservations WHERE owner = ? AND owner != '' AND state = 'held'"
                                  " AND id NOT IN (SELECT value FROM json_each(?))", (owner, kept)).rowcount)

        return await self._write(step, atomic=True)

    def _reclaim(self, db: sqlite3.Connection, team: str, now: float) -> None:
        db.execute("UPDATE reservations SET state = 'expired' WHERE team = ? AND state = 'held' AND expires_at <= ?",
                   (team, now))
        db.execute("DELETE FROM reservations WHERE team = ? AND state = 'expired' AND expires_at <= ?",
                   (team, now - EXPIRED_RETENTION_S))
        for rid, expires in list(self._held.items()):  # a call that never came back counts no more
            if expires <= now:
                del self._held[rid]

    def _give_back(self, reservation_id: str) -> None:
        try:
            with self._errors:
                self._db().execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))
        except StoreError:  # it expires on its own
            log.exception("cannot give back reservation %s", reservation_id)

    async def settle(self, reservation_id: str, actual_usd: float, tokens: Sequence[TokenCharge] = ()) -> None:
        actual = to_micros(actual_usd, "actual_usd")
        self._held.pop(reservation_id, None)
        await self._write(lambda db: self._settle(db, reservation_id, actual, tokens), atomic=True)

    @classmethod
    def _settle(cls, db: sqlite3.Connection, reservation_id: str, actual: int,
                tokens: Sequence[TokenCharge] = ()) -> None:
        rows = db.execute("DELETE FROM reservations WHERE id = ? RETURNING team, period, budgets, attrib",
                          (reservation_id,)).fetchall()
        if rows:  # else already settled or released: nothing more to book
            team, period, budgets, attrib = rows[0]
            cls._book(db, team, period, actual, Attribution.decoded(attrib))
            if budgets:
                for tag in budgets.strip("|").split("||"):
                    scope, _, hold_period = tag.rpartition("#")
                    cls._ledger(db, scope, hold_period, actual)
            if tokens:  # the clock rows are on the page the DELETE wrote (sqlite_schema)
                now = time.time()
                for c in tokens:  # one or two: execute spares executemany's iterator
                    db.execute(_PUSH_CLOCKS, (now, 0.0, c.tokens * c.tokens_s, c.scope))

    @classmethod
    def _book(cls, db: sqlite3.Connection, team: str, period: str, micros: int,
              attribution: Attribution | None) -> None:
        """A team's booking: its ledger, and the day's spend row of `attribution`."""
        cls._ledger(db, team, period, micros)
        who = attribution or _NOBODY
        db.execute(_SPEND, (_day(), team, who.key, who.user, who.model, who.policy, micros))

    @staticmethod
    def _ledger(db: sqlite3.Connection, team: str, period: str, micros: int) -> None:
        db.execute(
            "INSERT INTO ledger (team, period, spent_micros) VALUES (?, ?, ?)"
            " ON CONFLICT (team, period) DO UPDATE SET spent_micros = spent_micros + excluded.spent_micros",
            (team, period, micros),
        )

    async def push_clocks(self, pushes: Sequence[ClockPush]) -> None:
        now = time.time()
        rows = [(now, p.requests_s, p.tokens_s, p.scope) for p in pushes]  # no clock row: nothing to push
        await self._write(lambda db: db.executemany(_PUSH_CLOCKS, rows), atomic=True)

    async def release(self, reservation_id: str) -> None:
        self._held.pop(reservation_id, None)
        await self._write(lambda db: self._exec(db, "DELETE FROM reservations WHERE id = ?", reservation_id),
                          atomic=False)

    async def team_spend(self, team: str, period: str) -> tuple[float, float]:
        with self._errors:
            return self._spend(self._db(), team, period)

    @staticmethod
    def _spend(db: sqlite3.Connection, team: str, period: str) -> Ledger:
        spent, reserved = db.execute(
            "SELECT (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = ?1 AND period = ?2),"
            " (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations"
            "  WHERE team = ?1 AND period = ?2 AND state = 'held' AND expires_at > ?3)",
            (team, period, time.time()),
        ).fetchone()
        return from_micros(int(spent)), from_micros(int(reserved))

    async def charge(self, team: str, period: str, amount_usd: float, attribution: Attribution | None = None) -> None:
        amount = to_micros(amount_usd, "amount_usd")
        await self._write(lambda db: self._book(db, team, period, amount, attribution), atomic=True)

    async def spend(self, first_day: str, last_day: str, team: str | None = None) -> list[SpendRow]:
        sql = ("SELECT day, team, key_id, user, model, policy, cost_micros, calls FROM spend WHERE day >= ? AND day <= ?")
        params: list[Any] = [first_day, last_day]
        if team is not None:
            sql += " AND team = ?"
            params.append(team)
        with self._errors:
            rows = self._db().execute(sql + " ORDER BY day", params).fetchall()
        return [SpendRow(str(d), str(t), str(k), str(u), str(m), str(p), int(c), int(n)) for d, t, k, u, m, p, c, n in rows]

    async def prune_spend(self, before_day: str) -> int:
        def step(db: sqlite3.Connection) -> int:
            days = int(db.execute("SELECT COUNT(DISTINCT day) FROM spend WHERE day < ?", (before_day,)).fetchone()[0])
            db.execute("DELETE FROM spend WHERE day < ?", (before_day,))
            return days

        return await self._write(step, atomic=True)

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)

        def step(db: sqlite3.Connection) -> Lease | None:
            now = time.time()
            row = db.execute(
                "INSERT INTO leases (run_id, owner, expires_at, epoch) VALUES (?1, ?2, ?3, 1)"
                " ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at,"
                " epoch = CASE WHEN leases.owner = excluded.owner AND leases.expires_at > 0 THEN leases.epoch"
                " ELSE leases.epoch + 1 END"
                " WHERE leases.owner = excluded.owner OR leases.expires_at <= ?4 RETURNING epoch",
                (run_id, owner, now + ttl, now),
            ).fetchone()
            return None if row is None else Lease(run_id, owner, int(row[0]))

        return await self._write(step, atomic=False)  # one statement

    async def prune_runs(self, updated_before: float, *, events_only: bool = False) -> int:
        # created_at <= updated_at, so the (status, created_at) index narrows the scan.
        having = " AND EXISTS (SELECT 1 FROM events WHERE run_id = runs.id)" if events_only else ""
        select = f"SELECT id FROM runs WHERE status = ? AND created_at < ? AND updated_at < ?{having} LIMIT ?"

        def step(db: sqlite3.Connection, status: str) -> int:
            ids = [(row[0],) for row in db.execute(select, (status, updated_before, updated_before, PRUNE_BATCH))]
            db.executemany("DELETE FROM events WHERE run_id = ?", ids)
            if not events_only:
                db.executemany("DELETE FROM runs WHERE id = ?", ids)
                db.executemany("DELETE FROM transcripts WHERE run_id = ?", ids)
                db.executemany("DELETE FROM leases WHERE run_id = ?", ids)
            return len(ids)

        total = 0
        for status in FINISHED:
            while True:
                n = await self._write(partial(step, status=status), atomic=True)
                total += n
                if n < PRUNE_BATCH:
                    break
                await asyncio.sleep(0)  # let the calls in flight write between two batches
        return total

    async def prune_ledgers(self, ended_before: float) -> int:
        def step(db: sqlite3.Connection) -> int:
            rows = db.execute("SELECT team, period FROM ledger WHERE period != ''").fetchall()  # '': clocks, before 2026-12
            old = [(team, period) for team, period in rows if period_ended(period, ended_before)]
            db.executemany("DELETE FROM ledger WHERE team = ? AND period = ?", old)
            return len(old)

        return await self._write(step, atomic=True)

    async def release_lease(self, run_id: str, owner: str) -> None:
        # Expired rather than deleted: the run's next lease takes the next epoch.
        await self._write(lambda db: self._exec(db, "UPDATE leases SET expires_at = 0 WHERE run_id = ? AND owner = ?",
                                                  run_id, owner), atomic=False)

    @staticmethod
    def _exec(db: sqlite3.Connection, sql: str, *params: str) -> None:
        db.execute(sql, params)

    async def put_response(self, response_id: str, team: str, body: bytes) -> None:
        row = (response_id, team, time.time(), body)

        def step(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO responses (id, team, created_at, body) VALUES (?, ?, ?, ?)", row)

        await self._write(step, atomic=False)

    async def get_response(self, response_id: str) -> tuple[str, bytes] | None:
        with self._errors:
            row = self._db().execute("SELECT team, body FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else (str(row[0]), bytes(row[1]))

    async def delete_response(self, response_id: str) -> bool:
        def step(db: sqlite3.Connection) -> bool:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 1

        return await self._write(step, atomic=False)

    async def prune_responses(self, created_before: float) -> int:
        def step(db: sqlite3.Connection) -> int:
            return int(db.execute("DELETE FROM responses WHERE created_at < ?", (created_before,)).rowcount)

        return await self._write(step, atomic=False)

    # --- keys, sessions, audit ------------------------------------------------------------

    async def put_key(self, record: KeyRecord, expected_revision: int | None,
                      audit: Sequence[AuditEntry] = ()) -> KeyRecord:
        body = record.stored()

        def step(db: sqlite3.Connection) -> tuple[int, float | None]:
            row = db.execute("SELECT revision, last_used_at FROM keys WHERE id = ?", (record.id,)).fetchone()
            check_key_revision(record.id, expected_revision, None if row is None else int(row[0]))
            revision = int(db.execute("SELECT COALESCE(MAX(revision), 0) FROM keys").fetchone()[0]) + 1
            db.execute("INSERT INTO keys (id, team, revision, body) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE"
                       " SET revision = excluded.revision, body = excluded.body", (record.id, record.team, revision,
                                                                                    body))
            self._insert_audit(db, audit)
            return revision, None if row is None else row[1]

        revision, used = await self._write(step, atomic=True)
        return replace(record, revision=revision, last_used_at=used)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        with self._errors:
            row = self._db().execute("SELECT revision, body, last_used_at FROM keys WHERE id = ?",
                                     (key_id,)).fetchone()
        return None if row is None else KeyRecord.from_stored(row[1], int(row[0]), row[2])

    async def list_keys(self, team: str | None = None, *, after: str = "", limit: int = 100) -> list[KeyRecord]:
        sql = "SELECT revision, body, last_used_at FROM keys WHERE id > ?"
        params: list[Any] = [after]
        if team is not None:
            sql += " AND team = ?"
            params.append(team)
        with self._errors:
            rows = self._db().execute(sql + " ORDER BY id LIMIT ?", (*params, max(limit, 0))).fetchall()
        return [KeyRecord.from_stored(body, int(rev), used) for rev, body, used in rows]

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        with self._errors:
            db = self._db()
            last = int(db.execute("SELECT COALESCE(MAX(revision), 0) FROM keys").fetchone()[0])
            if last <= revision:
                return [], last
            rows = db.execute("SELECT revision, body, last_used_at FROM keys WHERE revision > ?",
                              (revision,)).fetchall()
        return [KeyRecord.from_stored(body, int(rev), used) for rev, body, used in rows], last

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        rows = [(at, key_id) for key_id, at in used.items()]
        if not rows:
            return
        await self._write(lambda db: db.executemany(
            "UPDATE keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?", rows), atomic=True)

    async def put_session(self, session: ConsoleSession, audit: Sequence[AuditEntry] = ()) -> None:
        row = (session.id_hash, session.key_id, session.idle_until, session.expires_at, session.stored())

        def step(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO console_sessions (id_hash, key_id, idle_until, expires_at, body)"
                       " VALUES (?, ?, ?, ?, ?)", row)
            self._insert_audit(db, audit)

        await self._write(step, atomic=True)

    async def get_session(self, id_hash: str) -> ConsoleSession | None:
        with self._errors:
            row = self._db().execute("SELECT body, idle_until FROM console_sessions WHERE id_hash = ? AND expires_at > ?",
                                     (id_hash, time.time())).fetchone()
        return None if row is None else ConsoleSession.from_stored(id_hash, row[0], row[1])

    async def touch_session(self, id_hash: str, idle_until: float) -> None:
        await self._write(lambda db: db.execute(
            "UPDATE console_sessions SET idle_until = MAX(idle_until, ?) WHERE id_hash = ?", (idle_until, id_hash)),
            atomic=False)

    async def delete_session(self, id_hash: str, audit: Sequence[AuditEntry] = ()) -> bool:
        def step(db: sqlite3.Connection) -> bool:
            found = db.execute("DELETE FROM console_sessions WHERE id_hash = ?", (id_hash,)).rowcount == 1
            self._insert_audit(db, audit)
            return found

        return await self._write(step, atomic=True)

    async def prune_sessions(self, now: float) -> int:
        return await self._write(lambda db: int(db.execute(
            "DELETE FROM console_sessions WHERE idle_until <= ? OR expires_at <= ?", (now, now)).rowcount),
            atomic=False)

    @staticmethod
    def _insert_audit(db: sqlite3.Connection, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        if not entries:
            return []
        head = db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        records = chain(int(head[0]) if head else 0, str(head[1]) if head else GENESIS, entries, time.time())
        db.executemany("INSERT INTO audit (seq, at, action, team, actor_team, hash, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       [(r.seq, r.at, r.action, r.team, r.actor_team, r.hash, r.stored()) for r in records])
        return records

    async def append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        if not entries:
            return []
        return await self._write(lambda db: self._insert_audit(db, entries), atomic=True)

    async def audit_log(self, *, after_seq: int = 0, limit: int = 100, since: float | None = None,
                        action: str | None = None, team: str | None = None) -> list[AuditRecord]:
        sql = "SELECT body FROM audit WHERE seq > ?"
        params: list[Any] = [after_seq]
        if since is not None:
            sql += " AND at >= ?"
            params.append(since)
        if action is not None:
            sql += " AND action = ?"
            params.append(action)
        if team is not None:
            sql += " AND (team = ? OR actor_team = ?)"
            params += [team, team]
        with self._errors:
            rows = self._db().execute(sql + " ORDER BY seq LIMIT ?", (*params, max(limit, 0))).fetchall()
        return [AuditRecord.from_stored(body) for body, in rows]

    async def prune_audit(self, before: float) -> int:
        return await self._write(lambda db: int(db.execute(
            "DELETE FROM audit WHERE at < ? AND seq < (SELECT MAX(seq) FROM audit)", (before,)).rowcount),
            atomic=False)

    # --- reloads across replicas -----------------------------------------------------------

    async def reload_mark(self) -> ReloadMark:
        with self._errors:
            row = self._db().execute("SELECT generation, origin FROM reloads WHERE id = 1").fetchone()
        return ReloadMark(0, "") if row is None else ReloadMark(int(row[0]), str(row[1]))

    async def announce_reload(self, origin: str) -> ReloadMark:
        def step(db: sqlite3.Connection) -> ReloadMark:
            row = db.execute("INSERT INTO reloads (id, generation, origin) VALUES (1, 1, ?) ON CONFLICT (id) DO UPDATE"
                             " SET generation = generation + 1, origin = excluded.origin RETURNING generation",
                             (origin,)).fetchone()
            return ReloadMark(int(row[0]), origin)

        return await self._write(step, atomic=True)

    async def close(self) -> None:
        self._wal.close()  # first: the last connection to close checkpoints and removes the WAL
        conn, self._conn = self._conn, None
        if conn is not None:
            with self._errors:
                conn.close()
