"""The PostgreSQL store: the system of record for replicas on several machines.

Every step is one round trip where it matters: an admission is one call of `gw_admit`, a
turn's commit (save, trace lines, notices, booking) one call of `gw_commit_turn`, a settle
one call of `gw_settle` (postgres_schema). Each runs in its own READ COMMITTED
transaction, serialized where it must be by row locks taken in one global order (the
run's row, the reservation, the ledger rows by scope and period, the rate clocks by
scope), so concurrent admissions from any number of replicas are exact, wait on each
other only when they share a row, never deadlock, and never need a SERIALIZABLE retry.

A team's `reserved` is not a counter: it is the sum of its live reservations (those whose
`expires_at`, on the database's clock, is still ahead), read under the lock of the team's
ledger row. So a process that dies frees its holds by their expiry alone, and a booking
is one DELETE of its reservation and one UPDATE of each ledger row it spends on.

Every call has a deadline (`timeout_s`, also the server's `statement_timeout`): a database
that is down, frozen or failing over is a StoreError within it (503 `store_unavailable`
above), never a hung call. A call is never retried here: a commit whose answer was lost
may have been applied, and the spool's `Booking(if_held=True)` books it exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final, TypeVar, cast

import asyncpg
import orjson

from gateway.harness.state import RunState
from gateway.store.audit import AuditEntry, AuditRecord, chain
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    EXPIRED_RETENTION_S,
    PRUNE_BATCH,
    Attribution,
    Booking,
    Claim,
    ClockPush,
    Event,
    Figures,
    Grant,
    Hold,
    Lease,
    ReloadMark,
    Ledger,
    RateLimit,
    RateState,
    Refusal,
    RunWrite,
    SpendRow,
    TokenCharge,
    check_list_args,
    check_ttl,
    from_micros,
    new_reservation_id,
    new_run_write,
    optional_micros,
    parse_run,
    run_write,
    to_micros,
)
from gateway.store.dsn import redact
from gateway.store.errors import (
    AlreadyBooked,
    LeaseLost,
    RunExists,
    RunNotFound,
    StaleRun,
    StoreError,
)
from gateway.store.keys import ConsoleSession, KeyRecord, check_key_revision
from gateway.store.outbox import Claimed, Notice, NoticeRule, check_notices, notices_of
from gateway.store.periods import ended_before as period_ended
from gateway.store.postgres_notify import Listener
from gateway.store.postgres_schema import LOCK_NAMESPACE, MIGRATIONS, Migration, bootstrap, quote

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_SCHEMA: Final = "gateway"
DEFAULT_TIMEOUT_S: Final = 2.0
DEFAULT_POOL: Final = (1, 10)
LEDGER_SLOTS: Final = 8
"""Rows a team's ledger of a period is split into (gw_admit): concurrent admissions of one team
lock one of them each while they fit its share of the budget (benchmarks/pg_hot_team.py)."""
SIGNALLED: Final = frozenset({"cancel_requested", "approval_decided"})
"""Trace lines another replica waits for (a cancel watcher, a decision): their write NOTIFYs
the run's channel (postgres_notify)."""
NOW: Final = "extract(epoch FROM clock_timestamp())"

_ADMIT: Final = ("SELECT * FROM gw_admit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,"
                 " $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37, $38,"
                 " $39)")
_COMMIT: Final = ("SELECT * FROM gw_commit_turn($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,"
                  " $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33,"
                  " $34, $35, $36, $37)")
_SETTLE: Final = f"SELECT gw_settle($1, $2, $3, $4, $5, {NOW})"
_APPEND: Final = f"SELECT gw_append($1, $2, $3, $4, $5, $6, {NOW}, $7, $8)"
_LIVE_RESERVED: Final = (f"(SELECT COALESCE(sum(amount_micros), 0)::bigint FROM reservations WHERE team = $1 AND period = $2"
                         f" AND expires_at > {NOW})")
_TEAM_SPEND: Final = (f"SELECT (SELECT COALESCE(sum(spent_micros), 0)::bigint FROM ledger WHERE scope = $1 AND period = $2),"
                      f" {_LIVE_RESERVED}")
_FIGURES: Final = f"""
WITH t AS (SELECT {NOW} AS now)
SELECT (SELECT COALESCE(sum(spent_micros), 0)::bigint FROM ledger WHERE scope = $1 AND period = $2),
       (SELECT COALESCE(sum(amount_micros), 0)::bigint FROM reservations, t WHERE team = $1 AND period = $2
        AND expires_at > t.now),
       (SELECT turns FROM runs WHERE id = $3), (SELECT cost_micros FROM runs WHERE id = $3),
       (SELECT count(*) FROM reservations, t WHERE run_id = $3 AND expires_at > t.now),
       (SELECT COALESCE(sum(amount_micros), 0)::bigint FROM reservations, t WHERE run_id = $3 AND expires_at > t.now),
       ARRAY(SELECT (SELECT COALESCE(sum(spent_micros), 0)::bigint FROM ledger WHERE scope = h.s AND period = h.p)
             FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS h(s, p, i) ORDER BY h.i),
       ARRAY(SELECT (SELECT COALESCE(sum(amount_micros), 0)::bigint FROM reservations, t WHERE team = $1
                     AND expires_at > t.now AND budgets @> ARRAY[h.s || '#' || h.p])
             FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS h(s, p, i) ORDER BY h.i)
"""


def _one_line(record: logging.LogRecord) -> bool:
    """asyncpg's pool logs a traceback each time it cannot reconnect (the database is down):
    one line with the reason instead, as the store's own errors are."""
    if record.exc_info and record.exc_info[1] is not None:
        record.msg, record.args = f"{record.getMessage()}: {_reason(record.exc_info[1])}", ()
        record.exc_info, record.exc_text = None, None
    return True


async def _no_reset(_conn: Any) -> None:
    """A pooled connection carries no session state of ours (LISTEN has a connection of its
    own): asyncpg's default reset would cost a round trip on every release."""


class PostgresStore:
    """The store in a PostgreSQL schema; every replica pointing at the same database and
    schema shares it. Connects (and migrates) on first use."""

    lookup_in_admission = True  # a look-up is a round trip; gw_admit reports a stored run

    def __init__(self, dsn: str, schema: str = DEFAULT_SCHEMA, *, pool_min: int = DEFAULT_POOL[0],
                 pool_max: int = DEFAULT_POOL[1], timeout_s: float = DEFAULT_TIMEOUT_S, migrate: bool = True) -> None:
        self.dsn = dsn
        self.schema = schema
        self.timeout_s = timeout_s
        self._pool_size = (pool_min, pool_max)
        self._migrate = migrate
        self._pool: asyncpg.Pool | None = None
        self._opening: asyncio.Future[asyncpg.Pool] | None = None
        self._closed = False
        self.ledger_slots = LEDGER_SLOTS
        self.notice_rule: NoticeRule | None = None
        self.signals = Listener(self._listen_connection, schema)
        pool_log = logging.getLogger("asyncpg.pool")
        if _one_line not in pool_log.filters:
            pool_log.addFilter(_one_line)

    def _where(self) -> str:
        return f"postgres store {redact(self.dsn)} (schema {self.schema})"

    def _settings(self) -> dict[str, str]:
        return {"search_path": quote(self.schema), "application_name": "gateway",
                "statement_timeout": str(max(1, round(self.timeout_s * 1000))),
                "idle_in_transaction_session_timeout": str(max(1000, round(self.timeout_s * 4000)))}

    async def _listen_connection(self) -> Any:
        return await asyncpg.connect(self.dsn, timeout=self.timeout_s, server_settings=self._settings())

    # --- connections --------------------------------------------------------------------------

    async def _ready(self) -> asyncpg.Pool:
        if self._closed:
            raise StoreError(f"{self._where()} is closed")
        if self._pool is not None:
            return self._pool
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and opening.exception() is not None and self._opening is opening:
                self._opening = None  # the next call tries again

    async def _open(self) -> asyncpg.Pool:
        try:
            if self._migrate:
                await migrate(self.dsn, self.schema, self.timeout_s)
            async with asyncio.timeout(self.timeout_s * 2):
                pool = await asyncpg.create_pool(
                    self.dsn, min_size=self._pool_size[0], max_size=self._pool_size[1], timeout=self.timeout_s,
                    command_timeout=self.timeout_s, server_settings=self._settings(), reset=_no_reset,
                    max_inactive_connection_lifetime=60.0)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise StoreError(f"{self._where()}: cannot connect: {_reason(exc)}") from exc
        if self._closed:
            await pool.close()
            raise StoreError(f"{self._where()} is closed")
        self._pool = pool
        return pool

    async def _with(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """`work` on a pooled connection within the store's deadline; driver errors become
        StoreError. A connection whose call timed out or was cancelled is closed, not pooled:
        its state is unknown, and a frozen server would hold up its reset."""
        pool = await self._ready()
        conn: asyncpg.Connection | None = None
        ok = False
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await pool.acquire()
                result = await work(conn)
            ok = True
            return result
        # InternalClientError: a connection the server dropped mid-call, caught by asyncpg's own
        # state check ("cannot switch to state ..."), is an outage like the others, not a 500
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                TimeoutError) as exc:
            raise StoreError(f"{self._where()}: {_reason(exc)}") from exc
        finally:
            if conn is not None:
                # A connection the server closed is back in the pool already (asyncpg frees it).
                with contextlib.suppress(asyncpg.InterfaceError):
                    if not ok:
                        conn.terminate()
                    await pool.release(conn, timeout=self.timeout_s)

    async def _fetchrow(self, sql: str, *args: Any) -> Any:
        return await self._with(lambda c: c.fetchrow(sql, *args))

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        return await self._with(lambda c: c.fetchval(sql, *args))

    async def _fetch(self, sql: str, *args: Any) -> list[Any]:
        return cast(list[Any], await self._with(lambda c: c.fetch(sql, *args)))

    async def _execute(self, sql: str, *args: Any) -> str:
        return cast(str, await self._with(lambda c: c.execute(sql, *args)))

    async def _transaction(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async def run(conn: asyncpg.Connection) -> T:
            async with conn.transaction():
                return await work(conn)

        return await self._with(run)

    async def ping(self) -> None:
        """One round trip (health checks)."""
        await self._fetchval("SELECT 1")

    async def start(self) -> None:
        """Connect and migrate now (`gateway serve` calls it before serving): a schema newer
        than this gateway knows is StoreError here, at start, not on the first call."""
        await self._ready()

    # --- runs ---------------------------------------------------------------------------------

    async def create_run(self, state: RunState) -> None:
        # One statement: the run's row, and its transcript's rows only if the row was new.
        written = new_run_write(state)
        created = await self._fetchval(
            "WITH r AS (INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, turns,"
            " cost_micros, prompt_tokens, completion_tokens, body) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,"
            " $11, $12) ON CONFLICT (id) DO NOTHING RETURNING id),"
            " t AS (SELECT gw_transcript(r.id, false, 0, $13, 0, $14) FROM r)"
            " SELECT count(*) FROM r, t", *_run_row(state, written), *_items(written))
        if not created:
            raise RunExists(state.run_id)
        state.mark_stored()

    async def load_run(self, run_id: str) -> RunState | None:
        # One statement: the head and its rows from one snapshot.
        row = await self._fetchrow(f"SELECT body, {_TRANSCRIPT} FROM runs r WHERE id = $1", run_id)
        return None if row is None else _parse(run_id, row)

    async def save_run(self, state: RunState, *, lease: Lease | None = None) -> None:
        await self.commit_turn(state, [], lease=lease)

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None,
                          audit: Sequence[AuditEntry] = (), *, lease: Lease | None = None) -> Ledger | None:
        actual = 0 if booking is None else to_micros(booking.actual_usd, "actual_usd")
        now = time.time()
        revision = state.revision + 1
        written = run_write(state, revision, now)
        notices = self._notices(state.run_id, events)
        charges = () if booking is None else booking.tokens
        args = (state.run_id, state.revision, revision, state.team, state.status, state.policy, now, state.turns,
                to_micros(state.cost_usd, "cost_usd"), state.usage.prompt_tokens, state.usage.completion_tokens,
                written.head, [orjson.dumps(e) for e in events], *_notice_columns(notices), _signal(events),
                booking is not None, None if booking is None else booking.reservation_id,
                booking is not None and booking.if_held, actual, None if booking is None else booking.team,
                None if booking is None else booking.period, *_charge_columns(charges), *_lease_columns(lease),
                written.truncates, written.messages_from, written.messages, written.per_turn_from,
                written.per_turn, *(booking.attribution if booking is not None and booking.attribution
                                        else Attribution()))
        if audit:
            async def step(conn: asyncpg.Connection) -> Any:
                row = await conn.fetchrow(_COMMIT, *args)
                if row["o_code"] == 1:
                    await _insert_audit(conn, audit)
                else:
                    raise _Refused(row)
                return row

            try:
                row = await self._transaction(step)
            except _Refused as refused:
                row = refused.row
        else:
            row = await self._fetchrow(_COMMIT, *args)
        code = row["o_code"]
        if code == 4:
            assert lease is not None
            raise LeaseLost(state.run_id, lease.epoch)
        if code == 0:
            raise RunNotFound(state.run_id)
        if code == 2:
            raise StaleRun(state.run_id, state.revision, int(row["o_stored"]))
        if code == 3:
            raise AlreadyBooked(booking.reservation_id if booking is not None and booking.reservation_id else "")
        state.revision = revision
        state.updated_at = now
        state.mark_stored()
        if booking is None:
            return None
        return from_micros(int(row["o_spent"])), from_micros(int(row["o_reserved"]))

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100,
                        policies: Collection[str] | None = None) -> list[RunState]:
        check_list_args(status, limit, policies)
        where: list[str] = []
        params: list[Any] = []
        if policies is not None:
            if not policies:
                return []
            params.append(sorted(set(policies)))
            where.append(f"policy = ANY(${len(params)}::text[])")
        if team is not None:
            params.append(team)
            where.append(f"team = ${len(params)}")
        if status is not None:
            params.append(status)
            where.append(f"status = ${len(params)}")
        params.append(limit)
        sql = f"SELECT id, body, {_TRANSCRIPT} FROM runs r" + (" WHERE " + " AND ".join(where) if where else "")
        rows = await self._fetch(sql + f" ORDER BY created_at DESC, ord DESC LIMIT ${len(params)}", *params)
        return [_parse(r["id"], r) for r in rows]

    def _notices(self, run_id: str, events: list[Event]) -> Sequence[Notice]:
        return notices_of(self.notice_rule, run_id, events)

    async def append_events(self, run_id: str, events: list[Event], *, lease: Lease | None = None) -> None:
        if not events:
            return
        notices = self._notices(run_id, events)
        added = await self._fetchval(_APPEND, run_id, [orjson.dumps(e) for e in events], *_notice_columns(notices),
                                     _signal(events), *_lease_columns(lease))
        if added == -1:
            assert lease is not None
            raise LeaseLost(run_id, lease.epoch)

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        rows = await self._fetch("SELECT seq, body FROM events WHERE run_id = $1 AND seq > $2 ORDER BY seq",
                                 run_id, max(after, 0))
        return [(int(r["seq"]), orjson.loads(r["body"])) for r in rows]

    # --- admission and booking ----------------------------------------------------------------

    async def reserve(self, team: str, period: str, amount_usd: float, budget_usd: float,
                      ttl_s: float = DEFAULT_RESERVATION_TTL_S) -> str | None:
        to_micros(budget_usd, "budget_usd")
        return (await self.admit(Claim(team, period, amount_usd, budget_usd, ttl_s=ttl_s))).reservation_id

    async def admit(self, claim: Claim) -> Grant:
        amount = to_micros(claim.amount_usd, "amount_usd")
        budget = optional_micros(claim.budget_usd, "budget_usd")
        run_budget = optional_micros(claim.run_budget_usd, "run_budget_usd")
        ttl = check_ttl(claim.ttl_s, "ttl_s", allow_zero=True)
        rid = new_reservation_id()
        who = claim.attribution or Attribution()
        created = claim.create
        run_id = claim.run_id if created is None else created.run_id
        create: tuple[Any, ...] = (None,) * 11
        items: tuple[Any, ...] = (None, None)
        if created is not None:
            written = new_run_write(created)
            create, items = _run_row(created, written)[1:], _items(written)
        row = await self._fetchrow(
            _ADMIT, rid, claim.team, claim.period, amount, ttl, run_id, claim.max_turns, claim.max_in_flight,
            run_budget, budget, claim.owner, claim.tokens, *_rate_columns(claim.rates), *_hold_columns(claim.holds),
            who.key, who.user, who.model, who.policy, create[-1], *create[:-1], self.ledger_slots, *items)
        code = row["o_code"]
        if code == 2:
            assert run_id is not None
            raise RunExists(run_id, None if row["o_body"] is None else await self.load_run(run_id))
        if created is not None:  # stored, granted or not
            created.mark_stored()
        now = float(row["o_now"])
        r, t = row["o_rate_r"] or [], row["o_rate_t"] or []
        if code == 1:
            return Grant(rid, rates=tuple(RateState(x.scope, now, r[i], t[i]) for i, x in enumerate(claim.rates)),
                         run_revision=None if claim.run_id is None else row["o_revision"])
        n = row["o_rate_in_flight"] or []
        figures = Figures(from_micros(row["o_spent"] or 0), from_micros(row["o_reserved"] or 0), row["o_turns"] or 0,
                          row["o_in_flight"] or 0, from_micros(row["o_cost"] or 0), from_micros(row["o_held"] or 0),
                          tuple((from_micros(s), from_micros(v))
                                for s, v in zip(row["o_hold_spent"] or [], row["o_hold_reserved"] or [], strict=True)))
        return Grant(None, cast(Refusal, row["o_refusal"]), figures,
                     tuple(RateState(x.scope, now, r[i], t[i], n[i]) for i, x in enumerate(claim.rates)))

    async def figures(self, team: str, period: str, run_id: str | None = None,
                      holds: Sequence[Hold] = ()) -> Figures:
        row = await self._fetchrow(_FIGURES, team, period, run_id, [h.scope for h in holds], [h.period for h in holds])
        return Figures(from_micros(row[0]), from_micros(row[1]), int(row[2] or 0), int(row[4]),
                       from_micros(row[3] or 0), from_micros(row[5]),
                       tuple((from_micros(s), from_micros(v)) for s, v in zip(row[6], row[7], strict=True)))

    async def renew(self, reservation_ids: Sequence[str], ttl_s: float) -> None:
        if not reservation_ids:
            return
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)
        await self._execute(
            f"UPDATE reservations SET expires_at = GREATEST(expires_at, {NOW} + $2)"
            f" WHERE id = ANY($1::text[]) AND expires_at > {NOW}", list(reservation_ids), ttl)

    async def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        if not owner:
            return 0
        return int(await self._fetchval(f"""
            WITH t AS (SELECT {NOW} AS now),
            l AS (UPDATE leases SET expires_at = 0 WHERE owner = $1),
            o AS (UPDATE outbox SET due_at = (SELECT now FROM t), owner = '' WHERE state = 'pending' AND owner = $1),
            r AS (DELETE FROM reservations WHERE owner = $1 AND expires_at > (SELECT now FROM t)
                  AND NOT id = ANY($2::text[]) RETURNING 1)
            SELECT count(*) FROM r""", owner, sorted(keep)))

    async def settle(self, reservation_id: str, actual_usd: float, tokens: Sequence[TokenCharge] = ()) -> None:
        actual = to_micros(actual_usd, "actual_usd")
        await self._fetchval(_SETTLE, reservation_id, actual, *_charge_columns(tokens))

    async def push_clocks(self, pushes: Sequence[ClockPush]) -> None:
        if not pushes:
            return
        await self._execute(f"""
            INSERT INTO clocks AS c (scope, requests_tat, tokens_tat)
            SELECT s, CASE WHEN rs = 0 THEN 0 ELSE {NOW} + rs END, CASE WHEN ts = 0 THEN 0 ELSE {NOW} + ts END
            FROM unnest($1::text[], $2::float8[], $3::float8[]) AS u(s, rs, ts) ORDER BY s COLLATE "C"
            ON CONFLICT (scope) DO UPDATE SET
              requests_tat = CASE WHEN excluded.requests_tat = 0 THEN c.requests_tat
                             ELSE GREATEST(c.requests_tat, {NOW}) + (excluded.requests_tat - {NOW}) END,
              tokens_tat = CASE WHEN excluded.tokens_tat = 0 THEN c.tokens_tat
                           ELSE GREATEST(c.tokens_tat, {NOW}) + (excluded.tokens_tat - {NOW}) END""",
            [p.scope for p in pushes], [float(p.requests_s) for p in pushes], [float(p.tokens_s) for p in pushes])

    async def release(self, reservation_id: str) -> None:
        await self._execute("DELETE FROM reservations WHERE id = $1", reservation_id)

    async def team_spend(self, team: str, period: str) -> tuple[float, float]:
        row = await self._fetchrow(_TEAM_SPEND, team, period)
        return from_micros(row[0]), from_micros(row[1])

    async def charge(self, team: str, period: str, amount_usd: float, attribution: Attribution | None = None) -> None:
        amount = to_micros(amount_usd, "amount_usd")
        who = attribution or Attribution()
        await self._fetchval(f"SELECT gw_book($1, $2, 0::smallint, $3, '{{}}', $4, $5, $6, $7,"
                             f" NULL, 0, 0, {NOW})",
                             team, period, amount, who.key, who.user, who.model, who.policy)

    async def spend(self, first_day: str, last_day: str, team: str | None = None) -> list[SpendRow]:
        # The documented `spend` view (postgres_schema), as Grafana reads it, summed over runs.
        sql = ("SELECT to_char(day, 'YYYY-MM-DD') AS day, team, key, \"user\", model, policy, sum(cost_micros),"
               " sum(calls) FROM spend WHERE day >= $1::text::date AND day <= $2::text::date"
               + ("" if team is None else " AND team = $3")
               + " GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 1, 2, 3, 4, 5, 6")
        rows = await self._fetch(sql, first_day, last_day, *(() if team is None else (team,)))
        return [SpendRow(r[0], r[1], r[2], r[3], r[4], r[5], int(r[6]), int(r[7])) for r in rows]

    async def prune_spend(self, before_day: str) -> int:
        days = int(await self._fetchval("SELECT count(DISTINCT day) FROM spend_rows WHERE day < $1::text::date",
                                        before_day))
        await self._batches("WITH d AS (DELETE FROM spend_rows WHERE ctid IN (SELECT ctid FROM spend_rows"
                            " WHERE day < $1::text::date LIMIT $2) RETURNING 1) SELECT count(*) FROM d", before_day)
        return days

    # --- leases -------------------------------------------------------------------------------

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)
        # The row is the run's fence (base.Lease): the same owner's lease, live or lapsed and
        # not released (expires_at 0), keeps its epoch; any other taking gets the next one.
        epoch = await self._fetchval(f"""
            INSERT INTO leases AS l (run_id, owner, expires_at, epoch) VALUES ($1, $2, {NOW} + $3, 1)
            ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at,
              epoch = CASE WHEN l.owner = excluded.owner AND l.expires_at > 0 THEN l.epoch ELSE l.epoch + 1 END
            WHERE l.owner = excluded.owner OR l.expires_at <= {NOW}
            RETURNING l.epoch""", run_id, owner, ttl)
        return None if epoch is None else Lease(run_id, owner, int(epoch))

    async def release_lease(self, run_id: str, owner: str) -> None:
        # Expired rather than deleted: the run's next lease takes the next epoch.
        await self._execute("UPDATE leases SET expires_at = 0 WHERE run_id = $1 AND owner = $2", run_id, owner)

    # --- retention ----------------------------------------------------------------------------

    async def prune_runs(self, updated_before: float, *, events_only: bool = False) -> int:
        if events_only:
            sql = """
                WITH doomed AS (SELECT h.run_id FROM event_heads h JOIN runs r ON r.id = h.run_id
                                WHERE r.status <> 'running' AND r.updated_at < $1 LIMIT $2 FOR UPDATE OF h SKIP LOCKED),
                e AS (DELETE FROM events WHERE run_id IN (SELECT run_id FROM doomed)),
                h AS (DELETE FROM event_heads WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1)
                SELECT count(*) FROM h"""
        else:
            sql = """
                WITH doomed AS (SELECT id FROM runs WHERE status <> 'running' AND updated_at < $1
                                ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED),
                e AS (DELETE FROM events WHERE run_id IN (SELECT id FROM doomed)),
                h AS (DELETE FROM event_heads WHERE run_id IN (SELECT id FROM doomed)),
                l AS (DELETE FROM leases WHERE run_id IN (SELECT id FROM doomed)),
                t AS (DELETE FROM transcripts WHERE run_id IN (SELECT id FROM doomed)),
                r AS (DELETE FROM runs WHERE id IN (SELECT id FROM doomed) RETURNING 1)
                SELECT count(*) FROM r"""
        return await self._batches(sql, updated_before)  # one short transaction per batch

    async def prune_ledgers(self, ended_before: float) -> int:
        rows = await self._fetch("SELECT DISTINCT scope, period FROM ledger")
        old = [(r[0], r[1]) for r in rows if period_ended(r[1], ended_before)]
        for i in range(0, len(old), PRUNE_BATCH):
            batch = old[i:i + PRUNE_BATCH]
            await self._execute("DELETE FROM ledger l USING unnest($1::text[], $2::text[]) AS u(s, p)"
                                " WHERE l.scope = u.s AND l.period = u.p", [s for s, _ in batch], [p for _, p in batch])
        # Reservations expired past the time a late settle may still book them.
        await self._execute(f"DELETE FROM reservations WHERE expires_at <= {NOW} - $1", EXPIRED_RETENTION_S)
        return len(old)

    # --- responses ----------------------------------------------------------------------------

    async def put_response(self, response_id: str, team: str, body: bytes) -> None:
        await self._execute(
            "INSERT INTO responses (id, team, created_at, body) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO UPDATE"
            " SET team = excluded.team, created_at = excluded.created_at, body = excluded.body",
            response_id, team, time.time(), bytes(body))

    async def get_response(self, response_id: str) -> tuple[str, bytes] | None:
        row = await self._fetchrow("SELECT team, body FROM responses WHERE id = $1", response_id)
        return None if row is None else (str(row[0]), bytes(row[1]))

    async def delete_response(self, response_id: str) -> bool:
        return await self._fetchval("DELETE FROM responses WHERE id = $1 RETURNING 1", response_id) is not None

    async def prune_responses(self, created_before: float) -> int:
        return await self._batches(
            "WITH d AS (DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE created_at < $1 LIMIT $2)"
            " RETURNING 1) SELECT count(*) FROM d", created_before)

    async def _batches(self, sql: str, *args: Any) -> int:
        """`sql` (a DELETE of at most $N rows returning how many, $N the last parameter) until a
        batch is short."""
        total = 0
        while True:
            n = int(await self._fetchval(sql, *args, PRUNE_BATCH))
            total += n
            if n < PRUNE_BATCH:
                return total
            await asyncio.sleep(0)

    # --- outbox -------------------------------------------------------------------------------

    async def enqueue_notices(self, notices: Sequence[Notice]) -> int:
        check_notices(notices)
        if not notices:
            return 0
        return int(await self._fetchval(_APPEND, "", [], *_notice_columns(notices), None, None, None))

    async def claim_notices(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        lease = check_ttl(lease_s, "lease_s", allow_zero=False)
        rows = await self._fetch(f"""
            WITH t AS (SELECT {NOW} AS now),
            c AS (SELECT id, due_at FROM outbox WHERE state = 'pending' AND due_at <= (SELECT now FROM t)
                  ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED),
            u AS (UPDATE outbox o SET due_at = (SELECT now FROM t) + $3, owner = $1 FROM c WHERE o.id = c.id
                  RETURNING o.id, o.body, o.attempts, c.due_at AS was)
            SELECT id, body, attempts FROM u ORDER BY was, id""", owner, max(limit, 0), lease)
        return [Claimed(str(r[0]), bytes(r[1]), int(r[2])) for r in rows]

    async def notice_sent(self, notice_id: str) -> None:
        await self._execute(f"UPDATE outbox SET state = 'delivered', done_at = {NOW}, attempts = attempts + 1,"
                            " owner = '' WHERE id = $1 AND state = 'pending'", notice_id)

    async def notice_failed(self, notice_id: str, owner: str, retry_in_s: float | None, error: str) -> None:
        if retry_in_s is None:
            await self._execute(f"UPDATE outbox SET state = 'failed', done_at = {NOW}, attempts = attempts + 1,"
                                " owner = '', error = $3 WHERE id = $1 AND state = 'pending' AND owner = $2",
                                notice_id, owner, error)
            return
        retry = check_ttl(retry_in_s, "retry_in_s", allow_zero=True)
        await self._execute(f"UPDATE outbox SET due_at = {NOW} + $4, attempts = attempts + 1, owner = '',"
                            " error = $3 WHERE id = $1 AND state = 'pending' AND owner = $2",
                            notice_id, owner, error, retry)

    async def outbox_depth(self) -> int:
        return int(await self._fetchval("SELECT count(*) FROM outbox WHERE state = 'pending'"))

    async def prune_outbox(self, done_before: float) -> int:
        rows = await self._fetch("SELECT id, period FROM outbox WHERE done_at < $1", done_before)
        old = [r[0] for r in rows if r[1] is None or period_ended(str(r[1]), done_before)]
        for i in range(0, len(old), PRUNE_BATCH):
            await self._execute("DELETE FROM outbox WHERE id = ANY($1::text[])", old[i:i + PRUNE_BATCH])
        return len(old)

    # --- keys, sessions, audit ------------------------------------------------------------------

    async def put_key(self, record: KeyRecord, expected_revision: int | None,
                      audit: Sequence[AuditEntry] = ()) -> KeyRecord:
        async def step(conn: asyncpg.Connection) -> tuple[int, float | None]:
            # The counter's row first: key writes take turns, so revisions commit in order and
            # `keys_since` never skips one that committed late.
            revision = int(await conn.fetchval("UPDATE counters SET value = value + 1 WHERE name = 'keys'"
                                               " RETURNING value"))
            row = await conn.fetchrow("SELECT revision, last_used_at FROM keys WHERE id = $1", record.id)
            check_key_revision(record.id, expected_revision, None if row is None else int(row[0]))
            await conn.execute("INSERT INTO keys (id, team, revision, body) VALUES ($1, $2, $3, $4)"
                               " ON CONFLICT (id) DO UPDATE SET revision = excluded.revision, body = excluded.body",
                               record.id, record.team, revision, record.stored())
            await _insert_audit(conn, audit)
            await conn.execute("SELECT pg_notify(current_schema() || '_keys', '')")
            return revision, None if row is None else row[1]

        revision, used = await self._transaction(step)
        return replace(record, revision=revision, last_used_at=used)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        row = await self._fetchrow("SELECT revision, body, last_used_at FROM keys WHERE id = $1", key_id)
        return None if row is None else KeyRecord.from_stored(row[1], int(row[0]), row[2])

    async def list_keys(self, team: str | None = None, *, after: str = "", limit: int = 100) -> list[KeyRecord]:
        sql = "SELECT revision, body, last_used_at FROM keys WHERE id > $1"
        args: list[Any] = [after]
        if team is not None:
            args.append(team)
            sql += " AND team = $2"
        args.append(max(limit, 0))
        rows = await self._fetch(sql + f" ORDER BY id LIMIT ${len(args)}", *args)
        return [KeyRecord.from_stored(r[1], int(r[0]), r[2]) for r in rows]

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        rows = await self._fetch(
            "WITH c AS (SELECT value FROM counters WHERE name = 'keys')"
            " SELECT c.value, k.revision, k.body, k.last_used_at FROM c"
            " LEFT JOIN keys k ON c.value > $1 AND k.revision > $1 AND k.revision <= c.value", revision)
        last = int(rows[0][0]) if rows else 0
        return [KeyRecord.from_stored(r[2], int(r[1]), r[3]) for r in rows if r[1] is not None], last

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        if not used:
            return
        await self._execute(
            "UPDATE keys k SET last_used_at = GREATEST(COALESCE(k.last_used_at, 0), u.at)"
            " FROM (SELECT * FROM unnest($1::text[], $2::float8[]) AS u(id, at) ORDER BY id) AS u WHERE k.id = u.id",
            list(used), [float(v) for v in used.values()])

    async def put_session(self, session: ConsoleSession, audit: Sequence[AuditEntry] = ()) -> None:
        async def step(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "INSERT INTO console_sessions (id_hash, key_id, idle_until, expires_at, body) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (id_hash) DO UPDATE SET key_id = excluded.key_id, idle_until = excluded.idle_until,"
                " expires_at = excluded.expires_at, body = excluded.body",
                session.id_hash, session.key_id, session.idle_until, session.expires_at, session.stored())
            await _insert_audit(conn, audit)

        await self._transaction(step)

    async def get_session(self, id_hash: str) -> ConsoleSession | None:
        row = await self._fetchrow("SELECT body, idle_until FROM console_sessions WHERE id_hash = $1 AND expires_at > $2",
                                   id_hash, time.time())
        return None if row is None else ConsoleSession.from_stored(id_hash, row[0], row[1])

    async def touch_session(self, id_hash: str, idle_until: float) -> None:
        await self._execute("UPDATE console_sessions SET idle_until = GREATEST(idle_until, $2) WHERE id_hash = $1",
                            id_hash, idle_until)

    async def delete_session(self, id_hash: str, audit: Sequence[AuditEntry] = ()) -> bool:
        async def step(conn: asyncpg.Connection) -> bool:
            found = await conn.fetchval("DELETE FROM console_sessions WHERE id_hash = $1 RETURNING 1", id_hash)
            await _insert_audit(conn, audit)
            return found is not None

        return await self._transaction(step)

    async def prune_sessions(self, now: float) -> int:
        return await self._batches(
            "WITH d AS (DELETE FROM console_sessions WHERE id_hash IN (SELECT id_hash FROM console_sessions"
            " WHERE LEAST(idle_until, expires_at) <= $1 LIMIT $2) RETURNING 1) SELECT count(*) FROM d", now)

    async def append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        if not entries:
            return []
        return await self._transaction(lambda conn: _insert_audit(conn, entries))

    async def audit_log(self, *, after_seq: int = 0, limit: int = 100, since: float | None = None,
                        action: str | None = None, team: str | None = None) -> list[AuditRecord]:
        sql = "SELECT body FROM audit WHERE seq > $1"
        args: list[Any] = [after_seq]
        if since is not None:
            args.append(since)
            sql += f" AND at >= ${len(args)}"
        if action is not None:
            args.append(action)
            sql += f" AND action = ${len(args)}"
        if team is not None:
            args.append(team)
            sql += f" AND (team = ${len(args)} OR actor_team = ${len(args)})"
        args.append(max(limit, 0))
        rows = await self._fetch(sql + f" ORDER BY seq LIMIT ${len(args)}", *args)
        return [AuditRecord.from_stored(r[0]) for r in rows]

    async def prune_audit(self, before: float) -> int:
        return await self._batches(
            "WITH d AS (DELETE FROM audit WHERE seq IN (SELECT seq FROM audit WHERE at < $1"
            " AND seq < (SELECT seq FROM audit_head) ORDER BY seq LIMIT $2) RETURNING 1) SELECT count(*) FROM d",
            before)

    # --- reloads across replicas --------------------------------------------------------------

    async def reload_mark(self) -> ReloadMark:
        row = await self._fetchrow("SELECT generation, origin FROM reloads WHERE id = 1")
        return ReloadMark(0, "") if row is None else ReloadMark(int(row[0]), str(row[1]))

    async def announce_reload(self, origin: str) -> ReloadMark:
        async def step(conn: asyncpg.Connection) -> int:
            generation = int(await conn.fetchval("UPDATE reloads SET generation = generation + 1, origin = $1"
                                                 " WHERE id = 1 RETURNING generation", origin))
            await conn.execute("SELECT pg_notify(current_schema() || '_reload', '')")
            return generation

        return ReloadMark(await self._transaction(step), origin)

    async def close(self) -> None:
        self._closed = True
        await self.signals.close()
        pool, self._pool = self._pool, None
        opening, self._opening = self._opening, None
        if pool is None and opening is not None and opening.done() and opening.exception() is None:
            pool = opening.result()
        if opening is not None and not opening.done():
            opening.cancel()
        if pool is not None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await pool.close()
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                pool.terminate()


class _Refused(Exception):
    """Rolls back a transaction whose store step refused (its row says why)."""

    def __init__(self, row: Any) -> None:
        super().__init__("refused")
        self.row = row


async def _insert_audit(conn: asyncpg.Connection, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
    """Chain `entries` after the head, locked for the rest of the caller's transaction."""
    if not entries:
        return []
    head = await conn.fetchrow("SELECT seq, hash FROM audit_head FOR UPDATE")
    records = chain(int(head[0]), str(head[1]), entries, time.time())
    await conn.executemany("INSERT INTO audit (seq, at, action, team, actor_team, hash, body)"
                           " VALUES ($1, $2, $3, $4, $5, $6, $7)",
                           [(r.seq, r.at, r.action, r.team, r.actor_team, r.hash, r.stored()) for r in records])
    await conn.execute("UPDATE audit_head SET seq = $1, hash = $2", records[-1].seq, records[-1].hash)
    return records


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__


def _run_row(state: RunState, written: RunWrite) -> tuple[Any, ...]:
    """A new run's INSERT values (id first, body last: `written.head`), as `create_run` and
    `gw_admit` take them."""
    return (state.run_id, state.team, state.status, state.policy, state.created_at, state.updated_at, state.revision,
            state.turns, to_micros(state.cost_usd, "cost_usd"), state.usage.prompt_tokens,
            state.usage.completion_tokens, written.head)


_TRANSCRIPT: Final = ("ARRAY(SELECT t.body FROM transcripts t WHERE t.run_id = r.id AND t.kind = 0 ORDER BY t.seq)"
                      " AS messages, ARRAY(SELECT t.body FROM transcripts t WHERE t.run_id = r.id AND t.kind = 1"
                      " ORDER BY t.seq) AS per_turn")
"""A run's transcript rows as two arrays, in the statement that reads its head (one snapshot)."""


def _parse(run_id: str, row: Any) -> RunState:
    """A run from its head and its transcript rows (`_TRANSCRIPT`)."""
    return parse_run(run_id, row["body"], ([bytes(m) for m in row["messages"]], [bytes(t) for t in row["per_turn"]]))


def _items(written: RunWrite) -> tuple[list[bytes], list[bytes]]:
    """A new run's transcript rows: its messages, its turns."""
    return written.messages, written.per_turn


def _lease_columns(lease: Lease | None) -> tuple[str | None, int | None]:
    return (None, None) if lease is None else (lease.owner, lease.epoch)


def _signal(events: Sequence[Event]) -> str | None:
    return "run" if any(e.get("type") in SIGNALLED for e in events) else None


def _notice_columns(notices: Sequence[Notice]) -> tuple[list[str], list[bytes], list[str | None]]:
    return [n.id for n in notices], [n.body for n in notices], [n.period for n in notices]


def _charge_columns(tokens: Sequence[TokenCharge]) -> tuple[list[str], list[int], list[float]]:
    return [c.scope for c in tokens], [c.tokens for c in tokens], [float(c.tokens_s) for c in tokens]


@functools.lru_cache(maxsize=1024)
def _rate_columns(rates: tuple[RateLimit, ...]) -> tuple[list[str], list[float], list[float | None],
                                                          list[float | None], list[int | None]]:
    """A claim's rate scopes as gw_admit's arrays, made once per set (one per team and key)."""
    return ([r.scope for r in rates], [float(r.window_s) for r in rates], [r.requests_s for r in rates],
            [r.tokens_s for r in rates], [r.max_in_flight for r in rates])


def _hold_columns(holds: tuple[Hold, ...]) -> tuple[list[str], list[str], list[str], list[int]]:
    return ([h.kind for h in holds], [h.scope for h in holds], [h.period for h in holds],
            [to_micros(h.budget_usd, "budget") for h in holds])


async def pending(conn: asyncpg.Connection, schema: str) -> tuple[Migration, ...]:
    """The migrations this database's schema lacks (all of them when it has none)."""
    exists = await conn.fetchval("SELECT to_regclass($1)", f"{quote(schema)}.schema_migrations")
    if exists is None:
        return MIGRATIONS
    done = {int(v) for v, in await conn.fetch(f"SELECT version FROM {quote(schema)}.schema_migrations")}
    newest = max(done, default=0)
    if newest > len(MIGRATIONS):
        raise StoreError(f"postgres schema {schema} is at migration {newest}, newer than this gateway knows "
                         f"({len(MIGRATIONS)}); upgrade the gateway")
    return tuple(m for m in MIGRATIONS if m.version not in done)


async def migrate(dsn: str, schema: str, timeout_s: float = 30.0) -> list[int]:
    """Apply the migrations the schema lacks, each once, under the schema's advisory lock
    (replicas starting together wait for each other); returns the versions applied here."""
    conn = await asyncpg.connect(dsn, timeout=timeout_s, server_settings={"application_name": "gateway"})
    applied: list[int] = []
    try:
        if not await pending(conn, schema):  # the usual start: read only, no lock
            return applied
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", LOCK_NAMESPACE, schema)
            await conn.execute(bootstrap(schema))
            await conn.execute(f"SET LOCAL search_path TO {quote(schema)}")
            for m in await pending(conn, schema):  # again, under the lock: another replica may have won
                await conn.execute(m.sql)
                await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.version, m.name)
                applied.append(m.version)
        if applied:
            log.info("store: postgres schema %s migrated to %d (%s)", schema, applied[-1],
                     ", ".join(map(str, applied)))
    finally:
        await conn.close()
    return applied
