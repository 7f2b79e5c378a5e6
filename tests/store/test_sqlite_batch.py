"""Group commit in the SQLite store: concurrent writes share transactions, each still all or nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.harness.state import RunState
from gateway.store.base import Booking
from gateway.store.errors import StaleRun, StoreError
from gateway.store.sqlite import SqliteStore


def make_run(run_id: str) -> RunState:
    return RunState.new("m", [{"role": "user", "content": "go"}], run_id=run_id, team="demo")


async def test_one_call_at_a_time_commits_each_write_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        run = make_run("run_a")
        await store.create_run(run)
        for turn in range(3):
            rid = await store.reserve("demo", "total", 0.01, 1.0)
            run.turns = turn + 1
            await store.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.004, rid))
        assert store._batch.transactions == 0  # never waited for a batch
        assert await store.team_spend("demo", "total") == (0.012, 0.0)
    finally:
        await store.close()


async def test_concurrent_calls_share_transactions_and_book_exactly(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        runs = [make_run(f"run_{i}") for i in range(20)]
        for run in runs:
            await store.create_run(run)

        async def call(run: RunState) -> None:
            rid = await store.reserve("demo", "total", 0.05, 0.5)  # room for ten at a time
            if rid is None:
                return
            await asyncio.sleep(0)  # the upstream answers
            run.turns = 1
            await store.commit_turn(run, [{"type": "turn", "n": 1}], Booking("demo", "total", 0.01, rid))

        await asyncio.gather(*[call(r) for r in runs])
        assert store._batch.transactions < store._batch.steps  # writes did share transactions
        spent, reserved = await store.team_spend("demo", "total")
        booked = [r for r in runs if r.turns == 1]
        assert len(booked) == 10  # the budget check saw the reservations made earlier in its batch
        assert (spent, reserved) == (round(0.01 * len(booked), 6), 0.0)
        for run in booked:
            loaded = await store.load_run(run.run_id)
            assert loaded is not None and loaded.revision == 1 and loaded.turns == 1
            assert [seq for seq, _ in await store.events(run.run_id)] == [1]
    finally:
        await store.close()


async def test_a_stale_turn_in_a_batch_is_undone_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        await store.create_run(make_run("run_a"))
        await store.create_run(make_run("run_b"))
        stale = await store.load_run("run_a")
        newer = await store.load_run("run_a")
        fresh = await store.load_run("run_b")
        assert stale is not None and newer is not None and fresh is not None
        await store.save_run(newer)
        rid_a = await store.reserve("demo", "total", 0.05, 1.0)
        rid_b = await store.reserve("demo", "total", 0.05, 1.0)  # two calls in flight: writes batch
        before = store._batch.transactions
        results = await asyncio.gather(
            store.commit_turn(stale, [{"type": "turn"}], Booking("demo", "total", 0.02, rid_a)),
            store.commit_turn(fresh, [{"type": "turn"}], Booking("demo", "total", 0.03, rid_b)),
            return_exceptions=True,
        )
        assert isinstance(results[0], StaleRun) and results[1] == (0.03, 0.05)
        assert store._batch.transactions == before + 1  # one transaction for both
        assert await store.events("run_a") == [] and len(await store.events("run_b")) == 1
        assert await store.team_spend("demo", "total") == (0.03, 0.05)  # run_a's reservation is still held
    finally:
        await store.close()


async def test_a_reservation_whose_caller_left_before_its_batch_is_never_made(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        assert await store.reserve("demo", "total", 0.01, 1.0) is not None  # another call in flight
        task = asyncio.create_task(store.reserve("demo", "total", 0.2, 1.0))
        await asyncio.sleep(0)  # it queued its write
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the batch turn has passed
        assert store._batch.transactions == 0  # there was nothing left to write
        assert await store.team_spend("demo", "total") == (0.0, 0.01)
    finally:
        await store.close()


async def test_a_reservation_made_for_a_caller_who_then_left_is_given_back(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        assert await store.reserve("demo", "total", 0.01, 1.0) is not None  # another call in flight
        task = asyncio.create_task(store.reserve("demo", "total", 0.2, 1.0))
        await asyncio.sleep(0)  # it queued its write; the batch runs next, then this cancel
        asyncio.get_running_loop().call_soon(task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store._batch.transactions == 1  # the reservation was made ...
        assert await store.team_spend("demo", "total") == (0.0, 0.01)  # ... and given back
    finally:
        await store.close()


async def test_a_batch_that_cannot_run_fails_every_write(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    run_a, run_b = make_run("run_a"), make_run("run_b")
    await store.create_run(run_a)
    await store.create_run(run_b)
    rid = await store.reserve("demo", "total", 0.01, 1.0)
    assert rid is not None
    pending = [asyncio.create_task(store.commit_turn(r, [{"type": "turn"}])) for r in (run_a, run_b)]
    await asyncio.sleep(0)  # both queued
    await store.close()  # the process shuts down before their batch runs
    for task in pending:
        with pytest.raises(StoreError, match="closed"):
            await task
    assert (run_a.revision, run_b.revision) == (0, 0)
    reopened = SqliteStore(tmp_path / "g.db")
    try:
        for run_id in ("run_a", "run_b"):
            loaded = await reopened.load_run(run_id)
            assert loaded is not None and loaded.revision == 0
    finally:
        await reopened.close()


async def test_an_error_that_is_not_a_refusal_undoes_the_whole_batch(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    try:
        run = make_run("run_a")
        await store.create_run(run)
        mine = await store.reserve("demo", "total", 0.01, 1.0)
        assert mine is not None and await store.reserve("demo", "total", 0.01, 1.0) is not None  # another call

        def broken(db: object) -> None:  # writes, then fails for a reason that is not a refusal
            store._insert_events(db, "run_a", [b'{"type": "half"}'])  # type: ignore[arg-type]
            raise RuntimeError("disk on fire")

        run.turns = 1
        turn = asyncio.create_task(store.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.01, mine)))
        await asyncio.sleep(0)  # the turn is queued for the next batch ...
        failing = store._batch.submit(broken, skip_if_cancelled=False)  # ... and so is this
        results = await asyncio.gather(turn, failing, return_exceptions=True)
        assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError)
        assert await store.events("run_a") == []
        loaded = await store.load_run("run_a")
        assert loaded is not None and loaded.revision == 0 and run.revision == 0
        assert await store.team_spend("demo", "total") == (0.0, 0.02)  # nothing settled
    finally:
        await store.close()
