"""Retention in every backend: finished runs and their events pruned by age, running runs
never, ledgers only for periods that ended."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from gateway.harness.state import RunState
from gateway.store.base import PRUNE_BATCH, Store
from gateway.store.periods import ended_before, period_end, period_key
from tests.store.conftest import Stores


def make_run(run_id: str) -> RunState:
    run = RunState.new("scripted-plan", [{"role": "user", "content": "hi"}], run_id=run_id, team="demo",
                       policy="files", created_at=time.time() - 100)
    return run


async def stored(store: Store, run_id: str, status: str, events: int = 2) -> RunState:
    run = make_run(run_id)
    await store.create_run(run)
    run.status = status  # type: ignore[assignment]
    await store.save_run(run)
    await store.append_events(run_id, [{"runId": run_id, "type": "turn", "n": i} for i in range(events)])
    return run


async def test_finished_runs_saved_before_the_cutoff_go_with_their_events(store: Store) -> None:
    await stored(store, "run_old", "completed")
    running = await stored(store, "run_running", "running")
    cutoff = time.time()
    late = await stored(store, "run_late", "failed")
    while late.updated_at <= cutoff:  # saved after the cutoff, whatever the clock's resolution
        await store.save_run(late)
    assert await store.prune_runs(cutoff) == 1
    assert await store.load_run("run_old") is None
    assert await store.events("run_old") == []
    assert await store.load_run("run_late") is not None and len(await store.events("run_late")) == 2
    assert [r.run_id for r in await store.list_runs(limit=10)] == ["run_late", "run_running"]
    assert await store.prune_runs(time.time() + 3600) == 1  # the late one; never the running one
    assert (await store.load_run("run_running")) is not None and running.status == "running"
    assert len(await store.events("run_running")) == 2
    assert [r.run_id for r in await store.list_runs(status="failed", limit=10)] == []


async def test_events_only_keeps_the_runs(store: Store) -> None:
    await stored(store, "run_a", "interrupted")
    await stored(store, "run_b", "max_turns_exceeded")
    later = time.time() + 3600
    assert await store.prune_runs(later, events_only=True) == 2
    assert await store.prune_runs(later, events_only=True) == 0  # nothing left to drop
    assert await store.events("run_a") == []
    assert (await store.load_run("run_a")) is not None and (await store.load_run("run_b")) is not None


async def test_a_prune_goes_through_every_batch(store: Store) -> None:
    count = 2 * PRUNE_BATCH + 3
    for i in range(count):
        await stored(store, f"run_{i:04d}", "completed", events=1)
    await stored(store, "run_running", "running")
    assert await store.prune_runs(time.time() + 3600) == count
    assert [r.run_id for r in await store.list_runs(limit=10)] == ["run_running"]


async def test_only_ledgers_of_ended_periods_are_pruned(stores: Stores) -> None:
    store = stores.open()
    now = datetime.now(UTC)
    today, month = period_key("day", now), period_key("month", now)
    for period in ("2020-01", "2020-01-05", "total", today, month):
        await store.charge("demo", period, 1.5)
    assert await store.prune_ledgers(time.time()) == 2
    assert await store.team_spend("demo", "2020-01") == (0.0, 0.0)
    assert await store.team_spend("demo", "2020-01-05") == (0.0, 0.0)
    for period in ("total", today, month):
        assert (await store.team_spend("demo", period))[0] == 1.5
    assert await store.prune_ledgers(time.time()) == 0


def test_period_end() -> None:
    assert period_end("2026-12-31") == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_end("2026-12") == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_end("2026-02") == datetime(2026, 3, 1, tzinfo=UTC)
    assert period_end("total") is None and period_end("garbage!!") is None
    assert ended_before("2026-11", datetime(2026, 12, 1, 0, 0, 1, tzinfo=UTC).timestamp())
    assert not ended_before("2026-12", datetime(2026, 12, 31, tzinfo=UTC).timestamp())


async def test_stored_responses_are_forgotten_by_age(store: Store) -> None:
    await store.put_response("resp_old", "demo", b'{"a": 1}')
    cutoff = time.time() + 0.005
    await asyncio.sleep(0.02)  # time passes between the two writes: the cutoff falls between them
    await store.put_response("resp_new", "demo", b'{"b": 2}')
    assert await store.prune_responses(cutoff) == 1
    assert await store.get_response("resp_old") is None
    assert await store.get_response("resp_new") == ("demo", b'{"b": 2}')
    assert await store.prune_responses(cutoff) == 0
    assert await store.delete_response("resp_new") and await store.prune_responses(time.time() + 1) == 0
