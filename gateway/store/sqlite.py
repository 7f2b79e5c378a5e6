"""The SQLite store: one file, WAL, durable against a crash of the process.

`synchronous=NORMAL` in WAL mode writes every commit to the WAL before returning (no fsync):
a SIGKILL right after a save loses nothing; only a power cut can lose the last commits.
Checkpoints (the fsyncs) run in a thread of their own, off the event loop (`sqlite_wal`).
The stdlib driver is called synchronously from the async methods on purpose: a statement
takes tens of microseconds, less than a hop to a thread would. Transactions that read then
write (reserve, settle, event numbering) use BEGIN IMMEDIATE, so they are atomic across
every process that opens the same file.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import orjson

from gateway.harness.state import RunState
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    EXPIRED_RETENTION_S,
    Booking,
    Event,
    Ledger,
    check_list_args,
    check_ttl,
    from_micros,
    new_reservation_id,
    parse_run,
    stamped_body,
    to_micros,
)
from gateway.store.errors import RunExists, RunNotFound, StaleRun, StoreError
from gateway.store.sqlite_wal import Checkpointer

MIGRATIONS: Final[tuple[str, ...]] = (
    # Append only: `PRAGMA user_version` counts the entries already applied to a file.
    """CREATE TABLE runs (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, status TEXT NOT NULL, policy TEXT NOT NULL,
        created_at REAL NOT NULL, updated_at REAL NOT NULL, revision INTEGER NOT NULL, body BLOB NOT NULL)""",
    "CREATE INDEX runs_created ON runs (created_at)",
    "CREATE INDEX runs_team_created ON runs (team, created_at)",
    "CREATE INDEX runs_status_created ON runs (status, created_at)",
    """CREATE TABLE events (
        run_id TEXT NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,
        PRIMARY KEY (run_id, seq)) WITHOUT ROWID""",
    """CREATE TABLE ledger (
        team TEXT NOT NULL, period TEXT NOT NULL, spent_micros INTEGER NOT NULL,
        PRIMARY KEY (team, period)) WITHOUT ROWID""",
    """CREATE TABLE reservations (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, period TEXT NOT NULL, amount_micros INTEGER NOT NULL,
        expires_at REAL NOT NULL, state TEXT NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'expired')))""",
    "CREATE INDEX reservations_team_state ON reservations (team, state, expires_at)",
    "CREATE INDEX reservations_team_period ON reservations (team, period, state)",
    "CREATE TABLE leases (run_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at REAL NOT NULL)",
    # Reservations keyed by their id alone (no rowid): a reserve or a settle writes fewer pages.
    """CREATE TABLE reservations_v2 (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, period TEXT NOT NULL, amount_micros INTEGER NOT NULL,
        expires_at REAL NOT NULL, state TEXT NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'expired')))
        WITHOUT ROWID""",
    "INSERT INTO reservations_v2 SELECT id, team, period, amount_micros, expires_at, state FROM reservations",
    "DROP TABLE reservations",
    "ALTER TABLE reservations_v2 RENAME TO reservations",
    "CREATE INDEX reservations_team_state ON reservations (team, state, expires_at)",
    # The table only holds reservations in flight (plus, for a day, those of processes that
    # died), so scanning it costs less than keeping an index page up to date on every
    # reserve and every settle.
    "DROP INDEX reservations_team_state",
)

BUSY_TIMEOUT_S: Final = 10.0
JOURNAL_SIZE_LIMIT: Final = 64 * 1024 * 1024
"""A WAL that grew past this is truncated back to it when it restarts."""
RECLAIM_EVERY_S: Final = 1.0
"""How often a team's expired reservations are marked (and forgotten past the retention) by
`reserve`, at the latest; sooner when one this store made expires. The budget check itself
never counts an expired reservation, marked or not."""


class _Translate:
    """Turns driver errors into StoreError naming the file (a with-block, cheaper than a decorator)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"sqlite store {self.path}: {exc}") from exc


class _Immediate:
    """A write transaction (a class, not @contextmanager: it runs twice per call on the hot path)."""

    __slots__ = ("db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self.db.execute("COMMIT")
                return
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")


def migrate(conn: sqlite3.Connection, path: str) -> int:
    """Apply the migrations the file lacks, in one transaction; returns the schema version.

    An up-to-date file is only read, so re-opening takes no write lock.
    """
    target = len(MIGRATIONS)
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version == target:
        return version
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])  # another process may have won
        if version > target:
            raise StoreError(
                f"sqlite store {path}: schema version {version} is newer than this gateway knows ({target}); "
                "upgrade the gateway"
            )
        for sql in MIGRATIONS[version:]:
            conn.execute(sql)
        conn.execute(f"PRAGMA user_version = {target}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return target


def connect(path: str) -> sqlite3.Connection:
    """Open `path` in WAL mode with the durability and locking this store relies on."""
    if path == ":memory:" or path.startswith("file:"):
        raise StoreError(f"sqlite store path {path!r} must be a file path (use kind: memory for a throwaway store)")
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"sqlite store {path}: cannot create directory {parent}: {exc}") from exc
    with _Translate(path):
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"sqlite store {path}: cannot use WAL journaling here (got {mode!r})")
            conn.execute("PRAGMA synchronous = NORMAL")
            migrate(conn, path)
        except BaseException:
            conn.close()
            raise
    return conn


class SqliteStore:
    """The store in one SQLite file; several processes may open the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._errors = _Translate(self.path)
        self._conn: sqlite3.Connection | None = connect(self.path)
        self._reclaim_due: dict[str, float] = {}
        try:
            with self._errors:
                self._conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpointer's thread does it
                self._conn.execute(f"PRAGMA journal_size_limit = {int(JOURNAL_SIZE_LIMIT)}")
                self._wal = Checkpointer(self.path, BUSY_TIMEOUT_S)
        except BaseException:
            self._conn.close()
            raise

    async def _writable(self) -> None:
        """Count the write; wait first if the checkpointer holds writes (rarely; see sqlite_wal)."""
        fence = self._wal.write()
        if fence is not None:
            await asyncio.shield(fence)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"sqlite store {self.path} is closed")
        return self._conn

    def _immediate(self) -> _Immediate:
        """`with self._immediate() as db:` one BEGIN IMMEDIATE transaction, rolled back on any error."""
        return _Immediate(self._db())

    async def create_run(self, state: RunState) -> None:
        await self._writable()
        with self._errors:
            try:
                self._db().execute(
                    "INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, body)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (state.run_id, state.team, state.status, state.policy, state.created_at, state.updated_at,
                     state.revision, state.dumps()),
                )
            except sqlite3.IntegrityError as exc:
                raise RunExists(state.run_id) from exc

    async def load_run(self, run_id: str) -> RunState | None:
        with self._errors:
            row = self._db().execute("SELECT body FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else parse_run(run_id, row[0])

    async def save_run(self, state: RunState) -> None:
        await self._writable()
        now = time.time()
        revision = state.revision + 1
        body = orjson.dumps(stamped_body(state, revision, now))
        with self._errors:
            self._update_run(self._db(), state, revision, now, body)
        state.revision = revision
        state.updated_at = now

    @staticmethod
    def _update_run(db: sqlite3.Connection, state: RunState, revision: int, now: float, body: bytes) -> None:
        # SQLite rewrites an index whenever its column is SET, changed or not: the usual save
        # (same team, status and policy) leaves them out, which keeps the two run indexes clean.
        cur = db.execute(
            "UPDATE runs SET updated_at = ?, revision = ?, body = ?"
            " WHERE id = ? AND revision = ? AND team = ? AND status = ? AND policy = ?",
            (now, revision, body, state.run_id, state.revision, state.team, state.status, state.policy),
        )
        if cur.rowcount == 1:
            return
        cur = db.execute(
            "UPDATE runs SET team = ?, status = ?, policy = ?, updated_at = ?, revision = ?, body = ?"
            " WHERE id = ? AND revision = ?",
            (state.team, state.status, state.policy, now, revision, body, state.run_id, state.revision),
        )
        if cur.rowcount != 1:
            row = db.execute("SELECT revision FROM runs WHERE id = ?", (state.run_id,)).fetchone()
            if row is None:
                raise RunNotFound(state.run_id)
            raise StaleRun(state.run_id, state.revision, int(row[0]))

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None) -> Ledger | None:
        await self._writable()
        actual = 0 if booking is None else to_micros(booking.actual_usd, "actual_usd")
        now = time.time()
        revision = state.revision + 1
        body = orjson.dumps(stamped_body(state, revision, now))
        encoded = [orjson.dumps(e) for e in events]
        ledger: Ledger | None = None
        with self._errors, self._immediate() as db:  # a refusal rolls all of it back
            self._update_run(db, state, revision, now, body)
            if encoded:
                self._insert_events(db, state.run_id, encoded)
            if booking is not None:
                if booking.reservation_id is not None:
                    self._settle(db, booking.reservation_id, actual)
                elif actual:
                    self._book(db, booking.team, booking.period, actual)
                ledger = self._spend(db, booking.team, booking.period)
        state.revision = revision
        state.updated_at = now
        return ledger

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100) -> list[RunState]:
        check_list_args(status, limit)
        where: list[str] = []
        params: list[Any] = []
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
            rows = self._db().execute(sql, (*params, limit)).fetchall()
        return [parse_run(run_id, body) for run_id, body in rows]

    async def append_events(self, run_id: str, events: list[Event]) -> None:
        await self._writable()
        if not events:
            return
        encoded = [orjson.dumps(e) for e in events]
        with self._errors, self._immediate() as db:
            self._insert_events(db, run_id, encoded)

    @staticmethod
    def _insert_events(db: sqlite3.Connection, run_id: str, encoded: list[bytes]) -> None:
        db.executemany(  # each line takes the next number (inside the caller's write transaction)
            "INSERT INTO events (run_id, seq, body) SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2 FROM events WHERE run_id = ?1",
            [(run_id, raw) for raw in encoded],
        )

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        with self._errors:
            rows = self._db().execute(
                "SELECT seq, body FROM events WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, after)
            ).fetchall()
        return [(int(seq), orjson.loads(body)) for seq, body in rows]

    async def reserve(
        self, team: str, period: str, amount_usd: float, budget_usd: float, ttl_s: float = DEFAULT_RESERVATION_TTL_S
    ) -> str | None:
        await self._writable()
        amount = to_micros(amount_usd, "amount_usd")
        budget = to_micros(budget_usd, "budget_usd")
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=True)
        with self._errors, self._immediate() as db:
            now = time.time()
            due = self._reclaim_due.get(team, 0.0)
            if now >= due:
                db.execute(
                    "UPDATE reservations SET state = 'expired' WHERE team = ? AND state = 'held' AND expires_at <= ?",
                    (team, now),
                )
                db.execute(
                    "DELETE FROM reservations WHERE team = ? AND state = 'expired' AND expires_at <= ?",
                    (team, now - EXPIRED_RETENTION_S),
                )
                due = now + RECLAIM_EVERY_S
            rid = new_reservation_id()
            granted = db.execute(  # inserted only if spent + live reservations + amount <= budget
                "INSERT INTO reservations (id, team, period, amount_micros, expires_at) SELECT ?1, ?2, ?3, ?4, ?5"
                " WHERE (SELECT COALESCE(SUM(spent_micros), 0) FROM ledger WHERE team = ?2 AND period = ?3)"
                " + (SELECT COALESCE(SUM(amount_micros), 0) FROM reservations"
                "    WHERE team = ?2 AND period = ?3 AND state = 'held' AND expires_at > ?7) + ?4 <= ?6",
                (rid, team, period, amount, now + ttl, budget, now),
            ).rowcount
            self._reclaim_due[team] = min(due, now + ttl) if granted == 1 else due
            return rid if granted == 1 else None

    async def settle(self, reservation_id: str, actual_usd: float) -> None:
        await self._writable()
        actual = to_micros(actual_usd, "actual_usd")
        with self._errors, self._immediate() as db:
            self._settle(db, reservation_id, actual)

    @classmethod
    def _settle(cls, db: sqlite3.Connection, reservation_id: str, actual: int) -> None:
        rows = db.execute("DELETE FROM reservations WHERE id = ? RETURNING team, period", (reservation_id,)).fetchall()
        if rows:  # else already settled or released: nothing more to book
            cls._book(db, rows[0][0], rows[0][1], actual)

    @staticmethod
    def _book(db: sqlite3.Connection, team: str, period: str, micros: int) -> None:
        db.execute(
            "INSERT INTO ledger (team, period, spent_micros) VALUES (?, ?, ?)"
            " ON CONFLICT (team, period) DO UPDATE SET spent_micros = spent_micros + excluded.spent_micros",
            (team, period, micros),
        )

    async def release(self, reservation_id: str) -> None:
        await self._writable()
        with self._errors:
            self._db().execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))

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

    async def charge(self, team: str, period: str, amount_usd: float) -> None:
        await self._writable()
        amount = to_micros(amount_usd, "amount_usd")
        with self._errors:
            self._book(self._db(), team, period, amount)

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> bool:
        await self._writable()
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)
        now = time.time()
        with self._errors:
            cur = self._db().execute(
                "INSERT INTO leases (run_id, owner, expires_at) VALUES (?1, ?2, ?3)"
                " ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at"
                " WHERE leases.owner = excluded.owner OR leases.expires_at <= ?4",
                (run_id, owner, now + ttl, now),
            )
        return cur.rowcount == 1

    async def release_lease(self, run_id: str, owner: str) -> None:
        await self._writable()
        with self._errors:
            self._db().execute("DELETE FROM leases WHERE run_id = ? AND owner = ?", (run_id, owner))

    async def close(self) -> None:
        self._wal.close()  # first: the last connection to close checkpoints and removes the WAL
        conn, self._conn = self._conn, None
        if conn is not None:
            with self._errors:
                conn.close()
