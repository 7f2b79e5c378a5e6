"""The SQLite store's file: schema migrations, connection settings, transactions, errors.

`connect` opens a file in WAL mode with `synchronous=NORMAL` (every commit is in the WAL
before it returns: a SIGKILL loses nothing, only a power cut can lose the last commits)
and brings its schema up to date; `immediate` is one BEGIN IMMEDIATE transaction, atomic
across every process that opens the same file.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from types import TracebackType
from typing import Final

from gateway.store.errors import StoreError

_V2_COLUMNS: Final = ("id, team, period, amount_micros, expires_at, state, run_id, owner, scopes, clock_a, requests_s_a,"
                       " tokens_s_a, clock_b, requests_s_b, tokens_s_b, tokens, admitted_at")
"""The reservations' columns before the rate clocks moved onto their page."""

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
    # A run's booked turns and cost as columns, so that admitting a call checks its turn cap
    # and budget against them in the same statement that holds its slot.
    "ALTER TABLE runs ADD COLUMN turns INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE runs ADD COLUMN cost_micros INTEGER NOT NULL DEFAULT 0",
    """UPDATE runs SET turns = COALESCE(json_extract(CAST(body AS TEXT), '$.turns'), 0),
        cost_micros = CAST(ROUND(COALESCE(json_extract(CAST(body AS TEXT), '$.cost_usd'), 0) * 1000000) AS INTEGER)""",
    # A reservation is also the turn slot of its run's call, held by one process (its owner).
    "ALTER TABLE reservations ADD COLUMN run_id TEXT",
    "ALTER TABLE reservations ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    # Responses-API responses kept for previous_response_id and GET /v1/responses/{id}.
    "CREATE TABLE responses (id TEXT PRIMARY KEY, team TEXT NOT NULL, created_at REAL NOT NULL, body BLOB NOT NULL)",
    # Run ids are per team (stored as TEAM/ID): runs stored before keep their trace and are
    # found again under the id their clients know.
    """UPDATE events SET run_id = (SELECT runs.team || '/' || runs.id FROM runs WHERE runs.id = events.run_id)
        WHERE instr(run_id, '/') = 0 AND EXISTS (SELECT 1 FROM runs WHERE runs.id = events.run_id AND runs.team != '')""",
    "DELETE FROM leases",
    """UPDATE runs SET body = json_set(CAST(body AS TEXT), '$.run_id', team || '/' || id, '$.parent_run_id',
        CASE WHEN json_extract(CAST(body AS TEXT), '$.parent_run_id') IS NULL THEN NULL
             ELSE team || '/' || json_extract(CAST(body AS TEXT), '$.parent_run_id') END),
        id = team || '/' || id
        WHERE instr(id, '/') = 0 AND team != ''""",
    # Retention forgets stored responses by age.
    "CREATE INDEX responses_created ON responses (created_at)",
    # The outbox of webhook notices: written with the trace lines that caused them, claimed
    # by a delivery task with a lease (owner, due_at pushed past the lease), kept once done
    # until retention forgets them.
    """CREATE TABLE outbox (
        id TEXT PRIMARY KEY, body BLOB NOT NULL, period TEXT, created_at REAL NOT NULL,
        state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
        attempts INTEGER NOT NULL DEFAULT 0, due_at REAL NOT NULL, owner TEXT NOT NULL DEFAULT '',
        error TEXT NOT NULL DEFAULT '', done_at REAL) WITHOUT ROWID""",
    "CREATE INDEX outbox_due ON outbox (state, due_at)",
    "CREATE INDEX outbox_done ON outbox (done_at) WHERE done_at IS NOT NULL",
    # Rate limits. Each scope's GCRA clocks (requests, tokens) are a row of the ledger (team =
    # the scope, "team:a" or "key:<digest>", which no team name can be; period = ''): a
    # booking writes the ledger's page anyway, so reconciling a call's tokens there costs
    # no page more. A reservation lists the scopes whose calls in flight it counts in
    # (`scopes`: '|team:a|key:b|'), and the clocks its admission spends (up to two scopes,
    # a key's and its team's: `clock_a`/`clock_b`, their seconds per request and per token,
    # the call's counted `tokens`, `admitted_at`), which a trigger applies in the
    # admission's own INSERT: one statement, atomic across processes.
    "ALTER TABLE ledger ADD COLUMN requests_tat REAL",
    "ALTER TABLE ledger ADD COLUMN tokens_tat REAL",
    "ALTER TABLE reservations ADD COLUMN scopes TEXT",
    *(f"ALTER TABLE reservations ADD COLUMN {column}" for column in (
        "clock_a TEXT", "requests_s_a REAL", "tokens_s_a REAL", "clock_b TEXT", "requests_s_b REAL",
        "tokens_s_b REAL", "tokens INTEGER", "admitted_at REAL")),
    """CREATE TRIGGER reservations_spend_clocks AFTER INSERT ON reservations WHEN NEW.clock_a IS NOT NULL BEGIN
        UPDATE ledger SET
            requests_tat = COALESCE(MAX(COALESCE(requests_tat, 0), NEW.admitted_at) + NEW.requests_s_a, requests_tat),
            tokens_tat = COALESCE(MAX(COALESCE(tokens_tat, 0), NEW.admitted_at) + NEW.tokens * NEW.tokens_s_a,
                                  tokens_tat)
        WHERE team = NEW.clock_a AND period = '';
        UPDATE ledger SET
            requests_tat = COALESCE(MAX(COALESCE(requests_tat, 0), NEW.admitted_at) + NEW.requests_s_b, requests_tat),
            tokens_tat = COALESCE(MAX(COALESCE(tokens_tat, 0), NEW.admitted_at) + NEW.tokens * NEW.tokens_s_b,
                                  tokens_tat)
        WHERE team = NEW.clock_b AND period = '';
    END""",
    # Rate clocks on the reservations' page (2026-12). Spending a clock in the ledger wrote the
    # ledger's page on every admission besides the reservation's: a WAL frame more per
    # limited call (about 4 us). A scope's clocks are now a row of the reservations table
    # (id = the scope, "team:a" or "key:<digest>", which no reservation id can be; state
    # 'clock', never held: no count or sum of reservations reads it), which in a table of
    # the calls in flight is the page the admission's INSERT writes anyway. The table is
    # made again for its CHECK; its trigger goes with it and is made again below.
    """CREATE TABLE reservations_v3 (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, period TEXT NOT NULL, amount_micros INTEGER NOT NULL,
        expires_at REAL NOT NULL,
        state TEXT NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'expired', 'clock')),
        run_id TEXT, owner TEXT NOT NULL DEFAULT '', scopes TEXT, clock_a TEXT, requests_s_a REAL, tokens_s_a REAL,
        clock_b TEXT, requests_s_b REAL, tokens_s_b REAL, tokens INTEGER, admitted_at REAL,
        requests_tat REAL, tokens_tat REAL) WITHOUT ROWID""",
    f"INSERT INTO reservations_v3 ({_V2_COLUMNS}) SELECT {_V2_COLUMNS} FROM reservations",
    "DROP TABLE reservations",
    "ALTER TABLE reservations_v3 RENAME TO reservations",
    # The clocks so far, moved (docs/stores.md#upgrading: restart every process of the file).
    """INSERT INTO reservations (id, team, period, amount_micros, expires_at, state, requests_tat, tokens_tat)
        SELECT team, team, '', 0, 0, 'clock', requests_tat, tokens_tat FROM ledger WHERE period = ''""",
    "DELETE FROM ledger WHERE period = ''",
    """CREATE TRIGGER reservations_spend_clocks AFTER INSERT ON reservations WHEN NEW.clock_a IS NOT NULL BEGIN
        UPDATE reservations SET
            requests_tat = COALESCE(MAX(COALESCE(requests_tat, 0), NEW.admitted_at) + NEW.requests_s_a, requests_tat),
            tokens_tat = COALESCE(MAX(COALESCE(tokens_tat, 0), NEW.admitted_at) + NEW.tokens * NEW.tokens_s_a,
                                  tokens_tat)
        WHERE id = NEW.clock_a;
        UPDATE reservations SET
            requests_tat = COALESCE(MAX(COALESCE(requests_tat, 0), NEW.admitted_at) + NEW.requests_s_b, requests_tat),
            tokens_tat = COALESCE(MAX(COALESCE(tokens_tat, 0), NEW.admitted_at) + NEW.tokens * NEW.tokens_s_b,
                                  tokens_tat)
        WHERE id = NEW.clock_b;
    END""",
    # Keys as records (gateway.store.keys): the whole record as JSON, the revision every
    # process reads the changes since, the team for lists; last use beside it (no revision).
    """CREATE TABLE keys (id TEXT PRIMARY KEY, team TEXT NOT NULL, revision INTEGER NOT NULL, body BLOB NOT NULL,
        last_used_at REAL) WITHOUT ROWID""",
    "CREATE INDEX keys_revision ON keys (revision)",
    "CREATE INDEX keys_team ON keys (team, id)",
    # Console sessions, by the hash of their id.
    """CREATE TABLE console_sessions (id_hash TEXT PRIMARY KEY, key_id TEXT NOT NULL, idle_until REAL NOT NULL,
        expires_at REAL NOT NULL, body BLOB NOT NULL) WITHOUT ROWID""",
    # The audit log, numbered and chained (gateway.store.audit).
    """CREATE TABLE audit (seq INTEGER PRIMARY KEY, at REAL NOT NULL, action TEXT NOT NULL, team TEXT NOT NULL,
        actor_team TEXT NOT NULL, hash TEXT NOT NULL, body BLOB NOT NULL)""",
    "CREATE INDEX audit_at ON audit (at)",
    # Budgets besides the team's a reservation holds against (base.Hold: '|key:k#2026-12|user:t:u#2026-12|'),
    # whose ledgers are rows of `ledger` (team = the hold's scope, which no team name can be),
    # and whose spend it is (base.Attribution, encoded): its booking adds to the day's `spend` row.
    "ALTER TABLE reservations ADD COLUMN budgets TEXT",
    "ALTER TABLE reservations ADD COLUMN attrib TEXT",
    """CREATE TABLE spend (day TEXT NOT NULL, team TEXT NOT NULL, key_id TEXT NOT NULL, user TEXT NOT NULL,
        model TEXT NOT NULL, policy TEXT NOT NULL, cost_micros INTEGER NOT NULL, calls INTEGER NOT NULL,
        PRIMARY KEY (day, team, key_id, user, model, policy)) WITHOUT ROWID""",
    # Lease epochs (fencing tokens): a lease taken by another owner than the row's (or after a
    # release) gets the next epoch of its run, and every write made under a lease checks it
    # in its own transaction (base.Lease). A released lease keeps its row (expires_at 0), so
    # a run's epochs only ever grow.
    "ALTER TABLE leases ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0",
    # A run's transcript beside its head (run schema 5): `runs.body` holds the head (a few
    # KB, rewritten by each save) and counts what this table holds for it; each message
    # (kind 0, its JSON) and each turn's usage (kind 1, "prompt completion") is one row,
    # written once. One table for both (a turn's rows are one INSERT, on the table's last
    # page and one page of its index); a rowid table, since a message can be large (a tool's
    # result) and rows appended in rowid order keep its pages full. Runs saved before keep
    # their whole body (messages inside, nothing here) until their next save.
    """CREATE TABLE transcripts (
        run_id TEXT NOT NULL, kind INTEGER NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,
        PRIMARY KEY (run_id, kind, seq))""",
    # The last reload announced to every process sharing the file (base.ReloadMark; one row,
    # written by the first announcement): each process polls it to reload its own files too.
    """CREATE TABLE reloads (id INTEGER PRIMARY KEY CHECK (id = 1), generation INTEGER NOT NULL,
        origin TEXT NOT NULL)""",
)

BUSY_TIMEOUT_S: Final = 10.0
LIVE: Final = "state = 'held' AND expires_at > :now"
"""A reservation that still holds (bound: `:now`)."""


class Translate:
    """Turns driver errors into StoreError naming the file (a with-block, cheaper than a decorator)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"sqlite store {self.path}: {exc}") from exc


class Immediate:
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


def _wal(conn: sqlite3.Connection) -> str:
    """Switch the file to WAL journaling (kept in the file: a no-op once done); returns the mode.

    Two processes opening a new file at once (replicas started together) both switch it, and
    SQLite refuses the one that finds the other's lock at once, without the busy timeout
    (about one start in five, with three): it is tried again for as long as that timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)  # the other process holds the file for the few ms its switch takes


def connect(path: str) -> sqlite3.Connection:
    """Open `path` in WAL mode with the durability and locking this store relies on."""
    if path == ":memory:" or path.startswith("file:"):
        raise StoreError(f"sqlite store path {path!r} must be a file path (use kind: memory for a throwaway store)")
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"sqlite store {path}: cannot create directory {parent}: {exc}") from exc
    with Translate(path):
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            mode = _wal(conn)
            if str(mode).lower() != "wal":
                raise StoreError(f"sqlite store {path}: cannot use WAL journaling here (got {mode!r})")
            conn.execute("PRAGMA synchronous = NORMAL")
            migrate(conn, path)
        except BaseException:
            conn.close()
            raise
    return conn
