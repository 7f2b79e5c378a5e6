"""What is PostgreSQL's own: migrations under an advisory lock, `gateway db migrate` and `db copy`,
the spend view, a connection killed mid-transaction, locks that never deadlock.

Against the session's real cluster (tests/support/postgres.py), each test on a schema of its own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from gateway.harness.state import RunState
from gateway.harness.usage import Usage
from gateway.store.audit import AuditEntry
from gateway.store.base import Attribution, Booking, Claim, Hold, Store
from gateway.store.keys import KeyRecord, new_key_id
from gateway.store.outbox import Notice
from gateway.store.postgres import PostgresStore, migrate
from gateway.store.postgres_schema import MIGRATIONS
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.postgres import new_schema
from tests.support.procs import ROOT

WHO = Attribution("key_a", "ana", "gpt-x", "passthrough")


def gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120, check=False)


async def test_replicas_starting_at_once_apply_each_migration_once(postgres_dsn: str) -> None:
    schema = new_schema()
    applied = await asyncio.gather(*(migrate(postgres_dsn, schema, 30) for _ in range(6)))
    assert sorted(v for one in applied for v in one) == [m.version for m in MIGRATIONS]  # each once, by one of them
    conn = await asyncpg.connect(postgres_dsn)
    try:
        rows = await conn.fetch(f"SELECT version FROM {schema}.schema_migrations ORDER BY version")
        assert [r[0] for r in rows] == [m.version for m in MIGRATIONS]
    finally:
        await conn.close()
    assert await migrate(postgres_dsn, schema, 30) == []  # up to date: nothing, and no lock taken


def write_config(folder: Path, store: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "policies").mkdir(exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({
        "store": store, "policies_dir": "./policies",
        "upstreams": [{"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "*", "upstream": "scripted", "price_in": 1.0, "price_out": 1.0}],
        "teams": [{"name": "demo", "keys": ["sk-x"], "policies": ["passthrough"]}]}))
    return path


def test_db_migrate_dry_run_prints_the_sql_and_changes_nothing(postgres_dsn: str, tmp_path: Path) -> None:
    schema = new_schema()
    config = write_config(tmp_path, {"kind": "postgres", "dsn_env": "GW_TEST_DSN", "schema": schema})
    env = {"GW_TEST_DSN": postgres_dsn}
    dry = gateway("db", "migrate", "--dry-run", "--config", str(config), env=env)
    assert dry.returncode == 0, dry.stderr
    assert "CREATE TABLE runs" in dry.stdout and "CREATE FUNCTION gw_admit" in dry.stdout
    assert "CREATE VIEW spend" in dry.stdout and f"-- migration {len(MIGRATIONS)}:" in dry.stdout
    done = gateway("db", "migrate", "--config", str(config), env=env)
    assert done.returncode == 0 and "applied migrations 1, 2" in done.stdout, done
    again = gateway("db", "migrate", "--dry-run", "--config", str(config), env=env)
    assert again.returncode == 0 and "is up to date" in again.stdout and "CREATE" not in again.stdout


def test_db_migrate_needs_a_postgres_config(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"kind": "sqlite", "path": "./g.db"})
    done = gateway("db", "migrate", "--config", str(config))
    assert done.returncode == 2 and "store.kind is sqlite, not postgres" in done.stderr


def run(run_id: str, i: int) -> RunState:
    state = RunState.new("scripted-plan", [{"role": "user", "content": f"task {i}"}], run_id=run_id, team="demo",
                         policy="passthrough", created_at=1_800_000_000.0 + i)
    return state


async def fill(store: Store, runs: int) -> None:
    """A store with a bit of everything: runs with booked turns and traces, holds, spend,
    responses, a notice, a key with its audit record."""
    for i in range(runs):
        state = run(f"demo/run_{i:04d}", i)
        await store.create_run(state)
        grant = await store.admit(Claim("demo", "total", 0.01, 5.0, run_id=state.run_id, holds=(
            Hold("key", "key:key_a", "total", 3.0),), attribution=WHO))
        assert grant.reservation_id is not None
        state.messages.append({"role": "assistant", "content": f"answer {i}"})  # a transcript item of its own
        state.turns, state.cost_usd, state.usage = 1, 0.000012 * (i % 100 + 1), Usage(100 + i, 7)
        await store.commit_turn(state, [{"type": "turn", "n": 1}, {"type": "run_stopped", "i": i}],
                                Booking("demo", "total", state.cost_usd, grant.reservation_id))
    await store.charge("demo", "2026-12", 0.5, WHO)
    await store.put_response("resp_1", "demo", b'{"id": "resp_1"}')
    await store.enqueue_notices([Notice("n1", b"{}", "2026-12")])
    key = KeyRecord(new_key_id(), "demo", "ci", "gw-abc", "f" * 64, time.time())
    await store.put_key(key, None, [AuditEntry("key.created", "demo", "key_admin", key.id, "demo")])


async def compare(source: Store, target: Store, runs: int) -> None:
    for i in range(runs):
        run_id = f"demo/run_{i:04d}"
        mine, theirs = await source.load_run(run_id), await target.load_run(run_id)
        assert mine is not None and theirs is not None and mine.to_json() == theirs.to_json()
        assert await source.events(run_id) == await target.events(run_id)
    assert await source.team_spend("demo", "total") == await target.team_spend("demo", "total")
    assert (await source.figures("demo", "total", None, (Hold("key", "key:key_a", "total", 3.0),))).holds == \
        (await target.figures("demo", "total", None, (Hold("key", "key:key_a", "total", 3.0),))).holds
    assert await source.spend("2000-01-01", "2100-01-01") == await target.spend("2000-01-01", "2100-01-01")
    assert await source.get_response("resp_1") == await target.get_response("resp_1")
    assert await target.outbox_depth() == 1
    assert await source.keys_since(0) == await target.keys_since(0)
    assert await source.audit_log() == await target.audit_log()
    assert len(await target.list_runs(limit=10_000)) == runs
    # and the copy goes on: the next turn, key and audit record follow the copied ones
    state = await target.load_run("demo/run_0000")
    assert state is not None
    await target.commit_turn(state, [{"type": "turn"}])
    assert [seq for seq, _ in await target.events("demo/run_0000")] == [1, 2, 3]
    records = await target.append_audit([AuditEntry("config.reloaded", "demo", "k", "x")])
    assert records[0].seq == 2


def copy_cli(source: str, dsn: str, schema: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return gateway("db", "copy", "--from", source, "--to", dsn, "--schema", schema, *extra)


async def test_db_copy_from_sqlite_moves_everything_and_checks_it(postgres_dsn: str, tmp_path: Path) -> None:
    sqlite = SqliteStore(tmp_path / "gateway.db")
    await fill(sqlite, 30)
    schema = new_schema()
    done = copy_cli(f"sqlite:{tmp_path / 'gateway.db'}", postgres_dsn, schema)
    assert done.returncode == 0, done.stderr
    assert "runs" in done.stdout and "checked" in done.stdout
    target = PostgresStore(postgres_dsn, schema)
    try:
        await compare(sqlite, target, 30)
    finally:
        await target.close()
        await sqlite.close()
    again = copy_cli(f"sqlite:{tmp_path / 'gateway.db'}", postgres_dsn, schema)
    assert again.returncode == 1 and "is not empty" in again.stderr


async def test_db_copy_from_redis_moves_everything_and_checks_it(postgres_dsn: str, redis_url: str) -> None:  # noqa: F811
    prefix = f"copy-{new_schema()}:"
    source = RedisStore(redis_url, prefix)
    await fill(source, 12)
    schema = new_schema()
    done = copy_cli(redis_url, postgres_dsn, schema, "--prefix", prefix)
    assert done.returncode == 0, done.stderr
    target = PostgresStore(postgres_dsn, schema)
    try:
        await compare(source, target, 12)
    finally:
        await target.close()
        await source.close()


async def test_db_copy_refuses_a_store_with_calls_in_flight(postgres_dsn: str, tmp_path: Path) -> None:
    sqlite = SqliteStore(tmp_path / "gateway.db")
    await sqlite.admit(Claim("demo", "total", 0.01))
    await sqlite.close()
    done = copy_cli(f"sqlite:{tmp_path / 'gateway.db'}", postgres_dsn, new_schema())
    assert done.returncode == 1 and "in flight" in done.stderr


async def test_the_spend_view_has_a_row_per_day_team_key_user_model_policy_and_run(postgres_dsn: str) -> None:
    schema = new_schema()
    store = PostgresStore(postgres_dsn, schema)
    try:
        await fill(store, 3)
        conn = await asyncpg.connect(postgres_dsn)
        try:
            rows = await conn.fetch(f"SELECT team, key, \"user\", model, policy, run, tokens, prompt_tokens, "
                                    f"completion_tokens, calls, cost_micros, cost_usd, day FROM {schema}.spend "
                                    "WHERE run IS NOT NULL ORDER BY run")
        finally:
            await conn.close()
        assert [(r["run"], r["tokens"], r["calls"], r["cost_micros"]) for r in rows] == [
            ("demo/run_0000", 107, 1, 12), ("demo/run_0001", 108, 1, 24), ("demo/run_0002", 109, 1, 36)]
        assert {(r["team"], r["key"], r["user"], r["model"], r["policy"]) for r in rows} == {tuple(["demo", *WHO])}
        total = sum(r.cost_micros for r in await store.spend("2000-01-01", "2100-01-01"))
        assert total == 12 + 24 + 36 + 500_000  # with the charge, which has no run
    finally:
        await store.close()


async def test_a_connection_killed_mid_transaction_loses_nothing_and_books_nothing_twice(postgres_dsn: str) -> None:
    """pg_terminate_backend on the connection of a turn's commit while it waits on a lock:
    the commit fails as a whole (StoreError), and the spool's replay (if_held) books it once."""
    from gateway.store.errors import AlreadyBooked, StoreError

    schema = new_schema()
    store = PostgresStore(postgres_dsn, schema, timeout_s=10)
    try:
        state = run("demo/kill", 0)
        await store.create_run(state)
        grant = await store.admit(Claim("demo", "total", 0.01, 1.0, run_id=state.run_id))
        assert grant.reservation_id is not None
        blocker, watcher = await asyncpg.connect(postgres_dsn), await asyncpg.connect(postgres_dsn)
        blocker_pid = await blocker.fetchval("SELECT pg_backend_pid()")
        await blocker.execute("BEGIN")
        await blocker.execute(f"SELECT 1 FROM {schema}.runs WHERE id = 'demo/kill' FOR UPDATE")  # the commit waits
        state.turns, state.cost_usd = 1, 0.004
        booking = Booking("demo", "total", 0.004, grant.reservation_id, if_held=True)
        commit = asyncio.ensure_future(store.commit_turn(state, [{"type": "turn"}], booking))

        async def waiting_pid() -> int | None:  # (pg_stat_activity is read once per transaction: a new one)
            return await watcher.fetchval(  # the backend our blocker blocks (other tests share the cluster)
                "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", blocker_pid)

        deadline = time.monotonic() + 10
        while (pid := await waiting_pid()) is None:
            assert time.monotonic() < deadline, "the commit never waited on the lock"
            await asyncio.sleep(0.02)  # poll for the commit to reach the lock
        await watcher.execute("SELECT pg_terminate_backend($1)", pid)
        await watcher.close()
        with pytest.raises(StoreError):
            await commit
        await blocker.execute("ROLLBACK")
        await blocker.close()
        assert state.revision == 0  # nothing was saved, so the copy is as it was
        assert await store.events("demo/kill") == []
        assert (await store.team_spend("demo", "total"))[0] == 0.0
        await store.commit_turn(state, [{"type": "turn"}], booking)  # the spool's replay
        with pytest.raises(AlreadyBooked):  # and a replay of the replay
            await store.commit_turn(state, [{"type": "turn"}], booking)
        assert await store.team_spend("demo", "total") == (0.004, 0.0)
        assert len(await store.events("demo/kill")) == 1
    finally:
        await store.close()


async def test_two_teams_and_one_team_admit_and_book_at_once_without_a_deadlock(postgres_dsn: str) -> None:
    """Admissions and bookings of two teams, with holds, rate scopes and runs crossing, from
    three pools at once: the lock order is one, so none waits on another in a circle
    (PostgreSQL would abort one with 'deadlock detected', a StoreError here)."""
    from gateway.store.base import RateLimit

    schema = new_schema()
    stores = [PostgresStore(postgres_dsn, schema, timeout_s=20, pool_max=16) for _ in range(3)]
    try:
        for team in ("a", "b"):
            for r in range(4):
                await stores[0].create_run(RunState.new("m", [], run_id=f"{team}/r{r}", team=team))

        async def one(i: int) -> None:
            store, team = stores[i % 3], ("a", "b")[i % 2]
            claim = Claim(team, "total", 0.001, 100.0, run_id=f"{team}/r{i % 4}", max_turns=10_000,
                          holds=(Hold("key", f"key:{team}{i % 2}", "total", 50.0), Hold("user", f"user:{team}:u", "total", 50.0)),
                          rates=(RateLimit(f"team:{team}", 60, requests=100_000), RateLimit(f"key:{team}", 60,
                                                                                            max_in_flight=1000)),
                          attribution=WHO)
            grant = await store.admit(claim)
            assert grant.reservation_id is not None, grant
            if i % 3:
                await store.settle(grant.reservation_id, 0.001)
            else:
                state = await store.load_run(f"{team}/r{i % 4}")
                assert state is not None
                for _attempt in range(50):
                    try:
                        state.turns += 1
                        await store.commit_turn(state, [], Booking(team, "total", 0.001, grant.reservation_id))
                        break
                    except Exception as exc:  # noqa: BLE001 - a stale copy: load and book again
                        if "saved by someone else" not in str(exc):
                            raise
                        state = await store.load_run(f"{team}/r{i % 4}")
                        assert state is not None

        await asyncio.gather(*(one(i) for i in range(240)))
        assert await stores[1].team_spend("a", "total") == (pytest.approx(0.12), 0.0)
        assert await stores[2].team_spend("b", "total") == (pytest.approx(0.12), 0.0)
    finally:
        for s in stores:
            await s.close()


async def test_a_team_ledger_split_in_slots_stays_exact(postgres_dsn: str) -> None:
    """The team's budget is shared out over 8 slot rows (gw_admit): claims that fit a slot's
    share lock that row alone; the last ones, when the shares are used up, take every row and
    the whole figures. The sum is still exact: 64 claims of 0.03 on a budget of 1.00 from two
    pools grant 33, and a booking dearer than its hold is seen by the next claim at once."""
    schema = new_schema()
    views = [PostgresStore(postgres_dsn, schema, timeout_s=20, pool_max=32) for _ in range(2)]
    try:
        grants = await asyncio.gather(*(views[i % 2].admit(Claim("hot", "total", 0.03, 1.0)) for i in range(64)))
        held = [g.reservation_id for g in grants if g.reservation_id is not None]
        assert len(held) == 33 and {g.refused for g in grants if g.reservation_id is None} == {"team_budget"}
        conn = await asyncpg.connect(postgres_dsn)
        try:
            slots = await conn.fetch(f"SELECT slot, cap FROM {schema}.ledger WHERE scope = 'hot' ORDER BY slot")
            used = await conn.fetch(f"SELECT DISTINCT slot FROM {schema}.reservations WHERE team = 'hot'")
        finally:
            await conn.close()
        assert [r["slot"] for r in slots if r["slot"] >= 0] == list(range(8)) and len(used) > 1  # spread over slots
        for rid in held[:30]:
            await views[0].settle(rid, 0.03)
        await views[1].settle(held[30], 0.03 + 0.05)  # dearer than it held, past its slot's share
        # spent 0.98, held 0.06: 0.04 left would fit a claim, but not after the 0.05 overdraft
        assert (await views[0].admit(Claim("hot", "total", 0.01, 1.0))).refused == "team_budget"
        await views[1].release(held[31])
        await views[1].release(held[32])
        spent, reserved = await views[0].team_spend("hot", "total")
        assert (spent, reserved) == (pytest.approx(0.98), 0.0)
        granted = [await views[i % 2].admit(Claim("hot", "total", 0.005, 1.0)) for i in range(6)]
        assert [g.reservation_id is not None for g in granted] == [True] * 4 + [False] * 2  # exactly 0.02 left
    finally:
        for v in views:
            await v.close()


async def test_replicas_are_notified_of_cancels_keys_and_notices_and_poll_without(postgres_dsn: str) -> None:
    """LISTEN/NOTIFY: a write another replica waits for wakes it at once; with no write the
    wait ends at its poll (the fallback); a notification is sent only once the write commits."""
    schema = new_schema()
    a, b = PostgresStore(postgres_dsn, schema), PostgresStore(postgres_dsn, schema)
    try:
        await a.create_run(run("demo/n", 0))
        assert await b.signals.wait("run", "demo/n", 0.3) is False  # nothing: the poll's timeout
        waiting = asyncio.ensure_future(b.signals.wait("run", "demo/n", 20))
        await asyncio.sleep(0.3)  # the listener connects on its first wait
        began = time.monotonic()
        await a.append_events("demo/n", [{"type": "turn"}])  # not a line anyone waits for
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await a.append_events("demo/n", [{"type": "cancel_requested", "reason": "x"}])
        assert await waiting is True and time.monotonic() - began < 5
        for topic, write in (("keys", a.put_key(KeyRecord(new_key_id(), "demo", "n", "gw-x", "0" * 64, time.time()),
                                                  None)),
                             ("outbox", a.enqueue_notices([Notice("n-1", b"{}")]))):
            waiting = asyncio.ensure_future(b.signals.wait(topic, "", 20))
            await asyncio.sleep(0.05)
            await write
            assert await waiting is True, topic
        assert b.signals.received >= 3
    finally:
        await a.close()
        await b.close()
