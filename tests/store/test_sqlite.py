"""SQLite specifics: durability under SIGKILL, two processes on one file, migrations, speed."""

from __future__ import annotations

import multiprocessing
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.harness.state import RunState
from gateway.store.base import Claim, RateLimit
from gateway.store.errors import StoreError
from gateway.store.sqlite import MIGRATIONS, SqliteStore
from gateway.store.sqlite_schema import BUSY_TIMEOUT_S
from tests.support.procs import ROOT

SAVER = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.harness.state import RunState
    from gateway.store.sqlite import SqliteStore

    async def main() -> None:
        store = SqliteStore(sys.argv[1])
        run = RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id="run_crash", team="demo")
        await store.create_run(run)
        while True:
            run.messages.append({"role": "assistant", "content": f"turn {run.revision + 1}"})
            await store.save_run(run)
            print(run.revision, flush=True)

    asyncio.run(main())
    """
)

RESERVER = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.store.sqlite import SqliteStore

    # Keeps up to 3 reservations of $0.01 against a $0.05 budget: two such processes want 6,
    # so the ledger sits at its limit and every reserve races the other process.
    async def main() -> None:
        store = SqliteStore(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.readline()  # both processes start racing on the same line
        held, granted, overspent = [], 0, 0
        for _ in range(int(sys.argv[2])):
            rid = await store.reserve("demo", "2026-11", 0.01, 0.05)
            if rid is not None:
                granted += 1
                held.append(rid)
                spent, reserved = await store.team_spend("demo", "2026-11")
                overspent += round((spent + reserved) * 1_000_000) > 50_000
            if len(held) == 3:
                await store.release(held.pop(0))
        for rid in held:
            await store.settle(rid, 0.01)
        print(granted, overspent, len(held), flush=True)

    asyncio.run(main())
    """
)


def python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def integrity(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


async def test_a_save_survives_sigkill_right_after_it_returns(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    proc = python(SAVER, str(db))
    assert proc.stdout is not None and proc.stderr is not None
    last = 0
    while last < 200:
        line = proc.stdout.readline()
        assert line, f"saver died early: {proc.stderr.read()}"
        last = int(line)
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    printed = [int(x) for x in rest.split()]  # saves that returned between our read and the kill
    last = max([last, *printed])

    assert integrity(db) == "ok"
    store = SqliteStore(db)
    try:
        run = await store.load_run("run_crash")
        assert run is not None
        assert run.revision >= last
        assert len(run.messages) == run.revision + 1  # the body and its revision were written together
        assert run.messages[-1]["content"] == f"turn {run.revision}"
    finally:
        await store.close()


async def test_two_processes_reserving_on_one_file_never_overspend(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    await SqliteStore(db).close()  # create the schema once so both children start from the same file
    procs = [python(RESERVER, str(db), "2000") for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    kept = 0
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        granted, overspent, held = (int(x) for x in out.split())
        assert overspent == 0
        assert granted >= 2  # the other process never holds more than 3 of the 5
        kept += held
    assert kept <= 5
    store = SqliteStore(db)
    try:  # the reservations both processes kept were settled into exact spending
        assert await store.team_spend("demo", "2026-11") == (kept / 100, 0.0)
    finally:
        await store.close()
    assert integrity(db) == "ok"


async def test_a_fresh_file_is_migrated_to_the_latest_schema(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    sqlite3.connect(db).close()
    assert user_version(db) == 0
    store = SqliteStore(db)
    await store.create_run(RunState.new("m", [], run_id="run_a"))
    await store.close()
    assert user_version(db) == len(MIGRATIONS)
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {"runs", "events", "ledger", "reservations", "leases"} <= tables


async def test_an_older_file_gets_only_the_missing_migrations(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        for sql in MIGRATIONS[:4]:  # a file from a gateway that only had the runs table
            conn.execute(sql)
        conn.execute("PRAGMA user_version = 4")
        conn.execute(
            "INSERT INTO runs VALUES ('run_old', 'demo', 'completed', 'files', 1, 1, 0, ?)",
            (RunState.new("m", [{"role": "user", "content": "kept"}], run_id="run_old", status="completed").dumps(),),
        )
    store = SqliteStore(db)
    try:
        old = await store.load_run("demo/run_old")  # run ids became per team
        assert old is not None and old.messages == [{"role": "user", "content": "kept"}]
        await store.append_events("demo/run_old", [{"type": "run_resumed"}])
        assert await store.reserve("demo", "total", 1.0, 1.0) is not None
    finally:
        await store.close()
    assert user_version(db) == len(MIGRATIONS)


async def test_rate_clocks_and_held_reservations_survive_the_move_onto_the_reservations_page(
        tmp_path: Path) -> None:
    # Before 2026-12 a scope's clocks were a ledger row (period ''); they move into the
    # reservations table, which is made again: what it held, and the clocks, are kept.
    db = tmp_path / "clocks.db"
    moved = next(i for i, sql in enumerate(MIGRATIONS) if "reservations_v3" in sql)
    now = time.time()
    with sqlite3.connect(db) as conn:
        for sql in MIGRATIONS[:moved]:
            conn.execute(sql)
        conn.execute(f"PRAGMA user_version = {moved}")
        conn.execute("INSERT INTO ledger (team, period, spent_micros, requests_tat, tokens_tat)"
                     " VALUES ('team:demo', '', 0, ?, ?)", (now + 3600.0 * 9 / 10, now))
        conn.execute("INSERT INTO reservations (id, team, period, amount_micros, expires_at, owner, scopes)"
                     " VALUES ('res_old', 'demo', 'total', 250000, ?, 'p1', '|team:demo|')", (now + 600,))
    store = SqliteStore(db)
    limit = RateLimit("team:demo", 3600.0, requests=10, max_in_flight=5)
    try:
        assert await store.team_spend("demo", "total") == (0.0, 0.25)
        first = await store.admit(Claim("demo", "total", rates=(limit,)))  # 9 spent before, 1 in flight
        assert first.reservation_id is not None
        refused = await store.admit(Claim("demo", "total", rates=(limit,)))  # the 11th request
        assert refused.refused == "rate_limit" and refused.rates[0].in_flight == 2  # the old one counts
        await store.settle("res_old", 0.25)
        assert await store.team_spend("demo", "total") == (0.25, 0.0)
    finally:
        await store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM ledger WHERE period = ''").fetchone()[0] == 0
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_reopening_an_up_to_date_file_changes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "current.db"
    store = SqliteStore(db)
    await store.create_run(RunState.new("m", [], run_id="run_a"))
    await store.close()
    with sqlite3.connect(db) as conn:
        schema = conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: a migration could not run now
    try:
        started = time.monotonic()
        store = SqliteStore(db)
        assert time.monotonic() - started < BUSY_TIMEOUT_S / 2  # did not wait on the lock (it would wait it out)
        assert await store.load_run("run_a") is not None
        await store.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == schema
    assert user_version(db) == len(MIGRATIONS)


def test_a_file_from_a_newer_gateway_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "newer.db"
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="newer than this gateway"):
        SqliteStore(db)


def test_a_file_that_is_not_a_database_is_named(tmp_path: Path) -> None:
    db = tmp_path / "notes.txt"
    db.write_text("these are not the tables you are looking for\n" * 100)
    with pytest.raises(StoreError, match="notes.txt"):
        SqliteStore(db)


async def test_save_of_a_ten_message_run_takes_well_under_half_a_millisecond(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "speed.db")
    run = RunState.new(
        "scripted-plan",
        [{"role": "user" if i % 2 == 0 else "assistant", "content": "a realistic line of agent chatter " * 6}
         for i in range(10)],
        run_id="run_speed",
    )
    await store.create_run(run)
    timings = []
    for _ in range(300):
        started = time.perf_counter()
        await store.save_run(run)
        timings.append(time.perf_counter() - started)
    await store.close()
    median = statistics.median(timings)
    print(f"sqlite save_run of a 10-message run: median {median * 1e6:.0f} us")
    assert median < 0.0005


async def test_expired_reservations_are_forgotten_after_the_retention(tmp_path: Path) -> None:
    db = tmp_path / "retention.db"
    store = SqliteStore(db)
    try:
        old = await store.reserve("demo", "total", 0.01, 1.0, ttl_s=0)
        recent = await store.reserve("demo", "total", 0.01, 1.0, ttl_s=0)
        assert old is not None and recent is not None
        with sqlite3.connect(db) as conn:  # make one of them older than the retention
            conn.execute("UPDATE reservations SET expires_at = expires_at - 2 * 86400 WHERE id = ?", (old,))
        assert await store.reserve("demo", "total", 0.01, 1.0) is not None
        with sqlite3.connect(db) as conn:
            states = dict(conn.execute("SELECT id, state FROM reservations WHERE id IN (?, ?)", (old, recent)))
        assert states == {recent: "expired"}
        await store.settle(old, 0.5)  # forgotten: nothing to book any more
        await store.settle(recent, 0.02)
        assert await store.team_spend("demo", "total") == (0.02, 0.01)
    finally:
        await store.close()


async def test_reservations_held_before_the_reservations_rebuild_are_kept(tmp_path: Path) -> None:
    db = tmp_path / "v10.db"
    with sqlite3.connect(db) as conn:  # a file of the gateway whose reservations had a rowid and two indexes
        for sql in MIGRATIONS[:10]:
            conn.execute(sql)
        conn.execute("PRAGMA user_version = 10")
        conn.execute("INSERT INTO reservations (id, team, period, amount_micros, expires_at)"
                     " VALUES ('res_old', 'demo', 'total', 40000, ?)", (time.time() + 600,))
    store = SqliteStore(db)
    try:
        assert await store.team_spend("demo", "total") == (0.0, 0.04)
        assert await store.reserve("demo", "total", 0.07, 0.1) is None  # the old hold still counts
        await store.settle("res_old", 0.03)
        assert await store.team_spend("demo", "total") == (0.03, 0.0)
    finally:
        await store.close()
    assert user_version(db) == len(MIGRATIONS)
    with sqlite3.connect(db) as conn:
        indexes = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'reservations'")}
        assert indexes == set()  # the id is the table's own key; the table is scanned


async def test_an_expired_reservation_never_counts_even_before_it_is_marked(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    store, other = SqliteStore(db), SqliteStore(db)  # two processes on one file
    try:
        assert await store.reserve("demo", "total", 0.01, 0.1) is not None  # marks expired ones, next time in 1 s
        dead = await other.reserve("demo", "total", 0.09, 0.1)  # fills the budget; then its process dies
        assert dead is not None and await store.reserve("demo", "total", 0.01, 0.1) is None
        with sqlite3.connect(db) as conn:  # ... and its hold's time passes
            conn.execute("UPDATE reservations SET expires_at = expires_at - 1000 WHERE id = ?", (dead,))
        assert await store.reserve("demo", "total", 0.09, 0.1) is not None  # not counted, marked or not
        assert await store.team_spend("demo", "total") == (0.0, 0.1)
    finally:
        await store.close()
        await other.close()


async def test_runs_stored_before_run_ids_were_per_team_are_found_under_their_team(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    before = MIGRATIONS.index("CREATE TABLE responses (id TEXT PRIMARY KEY, team TEXT NOT NULL, created_at REAL NOT NULL,"
                              " body BLOB NOT NULL)") + 1
    old = RunState.new("scripted-plan", [{"role": "user", "content": "hi"}], run_id="r1", team="demo", policy="files")
    old.turns = 2
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for sql in MIGRATIONS[:before]:
        conn.execute(sql)
    conn.execute(f"PRAGMA user_version = {before}")
    conn.execute("INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, body, turns)"
                 " VALUES ('r1', 'demo', 'running', 'files', 1.0, 1.0, 0, ?, 2)", (old.dumps(),))
    conn.execute("INSERT INTO events (run_id, seq, body) VALUES ('r1', 1, '{\"type\":\"turn\"}')")
    conn.close()
    store = SqliteStore(path)
    try:
        assert await store.load_run("r1") is None
        run = await store.load_run("demo/r1")
        assert run is not None and (run.run_id, run.public_id, run.turns, run.parent_run_id) == ("demo/r1", "r1", 2, None)
        assert [e for _, e in await store.events("demo/r1")] == [{"type": "turn"}]
        run.turns = 3
        await store.save_run(run)  # and it is saved under its new id
    finally:
        await store.close()


def _open_at_the_barrier(path: str, barrier: Any, out: Any) -> None:
    from gateway.store.sqlite_schema import connect

    barrier.wait()
    try:
        connect(path).close()
        out.put("ok")
    except StoreError as exc:
        out.put(str(exc))


def test_replicas_that_open_a_new_file_at_once_all_open(tmp_path: Path) -> None:
    # Replicas started together all open the file that does not exist yet: each switches it to
    # WAL, which SQLite refused at once (no busy timeout) to whoever found another's lock,
    # and the gateway exited "database is locked" at start in about one process of five.
    ctx = multiprocessing.get_context("fork")
    results: list[str] = []
    for round_ in range(6):
        path = str(tmp_path / f"new-{round_}.db")
        barrier, out = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_open_at_the_barrier, args=(path, barrier, out)) for _ in range(6)]
        for proc in procs:
            proc.start()
        results += [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
    assert results == ["ok"] * 36, [r for r in results if r != "ok"]
