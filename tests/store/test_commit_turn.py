"""`commit_turn`: a turn's save, trace lines and ledger booking as one step, on every backend."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.harness.state import RunState
from gateway.store.base import Booking, Store
from gateway.store.errors import RunNotFound, StaleRun
from gateway.store.sqlite import SqliteStore
from tests.store.conftest import Stores
from tests.support.procs import ROOT


def make_run(run_id: str) -> RunState:
    return RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id=run_id, team="demo")


async def test_a_turn_saves_traces_settles_and_reports_the_ledger(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    await store.append_events("run_a", [{"type": "run_started"}])
    rid = await store.reserve("demo", "total", 0.05, 1.0)
    other = await store.reserve("demo", "total", 0.02, 1.0)
    assert rid is not None and other is not None
    run.turns, run.cost_usd = 1, 0.013
    ledger = await store.commit_turn(run, [{"type": "turn", "turn": 1}, {"type": "run_stopped"}],
                                     Booking("demo", "total", 0.013, rid))
    assert ledger == (0.013, 0.02)  # the other call's reservation is still held
    assert run.revision == 1
    loaded = await store.load_run("run_a")
    assert loaded is not None and (loaded.revision, loaded.turns, loaded.cost_usd) == (1, 1, 0.013)
    assert [(seq, e["type"]) for seq, e in await store.events("run_a")] == [
        (1, "run_started"), (2, "turn"), (3, "run_stopped")]
    assert await store.team_spend("demo", "total") == (0.013, 0.02)
    await store.settle(rid, 0.013)  # settled by the commit: a later settle books nothing more
    assert await store.team_spend("demo", "total") == (0.013, 0.02)


async def test_a_stale_turn_writes_nothing_at_all(stores: Stores) -> None:
    mine, theirs = stores.open(), stores.open()
    await mine.create_run(make_run("run_a"))
    run = await mine.load_run("run_a")
    newer = await theirs.load_run("run_a")
    assert run is not None and newer is not None
    await theirs.save_run(newer)
    rid = await mine.reserve("demo", "total", 0.05, 1.0)
    assert rid is not None
    run.turns = 1
    with pytest.raises(StaleRun):
        await mine.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.01, rid))
    assert run.revision == 0
    assert await mine.events("run_a") == []
    assert await mine.team_spend("demo", "total") == (0.0, 0.05)  # the reservation is still held, unbooked
    stored = await mine.load_run("run_a")
    assert stored is not None and (stored.revision, stored.turns) == (1, 0)
    fresh = await mine.load_run("run_a")  # the caller's retry: reload, apply again, commit again
    assert fresh is not None
    fresh.turns = 1
    assert await mine.commit_turn(fresh, [{"type": "turn"}], Booking("demo", "total", 0.01, rid)) == (0.01, 0.0)
    assert [seq for seq, _ in await mine.events("run_a")] == [1]


async def test_a_turn_of_a_run_never_created_writes_nothing(store: Store) -> None:
    with pytest.raises(RunNotFound):
        await store.commit_turn(make_run("run_ghost"), [{"type": "turn"}], Booking("demo", "total", 0.5))
    assert await store.events("run_ghost") == []
    assert await store.team_spend("demo", "total") == (0.0, 0.0)


async def test_without_a_reservation_the_turn_charges_the_period(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    assert await store.commit_turn(run, [], Booking("demo", "2026-11", 0.25)) == (0.25, 0.0)
    assert await store.commit_turn(run, [], Booking("demo", "2026-11", 0.0)) == (0.25, 0.0)
    assert await store.commit_turn(run, [{"type": "turn"}]) is None  # nothing to book, no ledger read
    assert run.revision == 3
    assert await store.team_spend("demo", "2026-11") == (0.25, 0.0)
    assert await store.team_spend("demo", "total") == (0.0, 0.0)


async def test_a_released_reservation_books_nothing_but_the_run_is_saved(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    rid = await store.reserve("demo", "total", 0.05, 1.0)
    assert rid is not None
    await store.release(rid)
    assert await store.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.04, rid)) == (0.0, 0.0)
    assert run.revision == 1 and len(await store.events("run_a")) == 1


async def test_a_bad_amount_is_named_before_anything_is_written(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    with pytest.raises(ValueError, match="actual_usd"):
        await store.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", -1.0))
    assert run.revision == 0 and await store.events("run_a") == []
    stored = await store.load_run("run_a")
    assert stored is not None and stored.revision == 0


async def test_concurrent_turns_of_one_revision_book_exactly_once(stores: Stores) -> None:
    views = [stores.open() for _ in range(4)]
    await views[0].create_run(make_run("run_a"))
    rid = await views[0].reserve("demo", "total", 0.05, 1.0)
    assert rid is not None
    copies = [await v.load_run("run_a") for v in views]

    async def commit(view: Store, run: RunState | None) -> bool:
        assert run is not None
        try:
            await view.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.03, rid))
            return True
        except StaleRun:
            return False

    won = await asyncio.gather(*[commit(v, r) for v, r in zip(views, copies, strict=True)])
    assert sum(won) == 1
    assert await views[0].team_spend("demo", "total") == (0.03, 0.0)
    assert len(await views[0].events("run_a")) == 1


COMMITTER = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.harness.state import RunState
    from gateway.store.base import Booking
    from gateway.store.sqlite import SqliteStore

    async def main() -> None:
        store = SqliteStore(sys.argv[1])
        run = RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id="run_crash", team="demo")
        await store.create_run(run)
        while True:
            run.turns += 1
            await store.commit_turn(run, [{"type": "turn", "turn": run.turns}], Booking("demo", "total", 0.001))
            print(run.revision, flush=True)

    asyncio.run(main())
    """
)


def committer(db: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", COMMITTER, str(db)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


async def test_a_turn_survives_sigkill_whole_or_not_at_all(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    proc = committer(db)
    assert proc.stdout is not None and proc.stderr is not None
    last = 0
    while last < 300:  # past several background checkpoints of the WAL
        line = proc.stdout.readline()
        assert line, f"committer died early: {proc.stderr.read()}"
        last = int(line)
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=10)
    last = max([last, *(int(x) for x in rest.split())])

    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = SqliteStore(db)
    try:
        run = await store.load_run("run_crash")
        assert run is not None and run.revision >= last
        events = await store.events("run_crash")
        assert [e["turn"] for _, e in events] == list(range(1, run.turns + 1))  # saved with its run, in order
        assert run.turns == run.revision
        assert await store.team_spend("demo", "total") == (round(run.turns * 0.001, 6), 0.0)
    finally:
        await store.close()
