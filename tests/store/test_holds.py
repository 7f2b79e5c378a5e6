"""Holds (a key's and a user's budgets) in the admission step, and spend rows, on every backend:
checked and held with the team's budget in one atomic step, exact across two views of one
store, booked and released with the reservation, and every booking of a ledger in the day's
spend row of its attribution."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.store.base import Attribution, Booking, Claim, Hold, Store, spend_day
from tests.store.conftest import Stores
from tests.store.test_admit import new_run

KEY = Hold("key", "key:key_a", "2026-12", 1.0)
USER = Hold("user", "user:demo:ana", "2026-W49", 0.5)
WHO = Attribution("key_a", "ana", "gpt-x", "passthrough")


def claim(amount: float, *holds: Hold, budget: float | None = None, **kw: object) -> Claim:
    return Claim("demo", "total", amount, budget, holds=holds, attribution=WHO, **kw)  # type: ignore[arg-type]


async def test_holds_are_exact_across_two_views_and_name_the_budget_that_refused(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    grants = await asyncio.gather(*(views[i % 2].admit(claim(0.03, KEY, USER)) for i in range(64)))
    held = [g for g in grants if g.reservation_id is not None]
    assert len(held) == 16  # floor(0.5 / 0.03): the user's budget is the tighter
    refused = [g for g in grants if g.reservation_id is None]
    assert {g.refused for g in refused} == {"user_budget"}
    assert refused[0].figures.holds == ((0.0, 0.48), (0.0, 0.48))
    figures = await views[1].figures("demo", "total", None, (KEY, USER))
    assert figures.holds == ((0.0, 0.48), (0.0, 0.48)) and figures.reserved_usd == 0.48


async def test_the_order_of_refusals_is_run_key_user_team(store: Store) -> None:
    await new_run(store, cost_usd=0.0)
    g = await store.admit(claim(2.0, KEY, USER, budget=0.1, run_id="run_a", run_budget_usd=0.5))
    assert g.refused == "run_budget"
    assert (await store.admit(claim(0.8, Hold("key", "key:k2", "total", 0.5), USER, budget=0.1))).refused == "key_budget"
    assert (await store.admit(claim(0.8, USER, budget=0.1))).refused == "user_budget"
    assert (await store.admit(claim(0.3, USER, budget=0.1))).refused == "team_budget"
    assert (await store.admit(claim(0.3, USER, budget=0.5))).reservation_id is not None


async def test_a_booking_spends_on_every_hold_and_a_release_gives_every_hold_back(store: Store) -> None:
    run = await new_run(store)
    first = await store.admit(claim(0.4, KEY, USER, run_id="run_a"))
    second = await store.admit(claim(0.05, KEY, USER))
    assert first.reservation_id and second.reservation_id
    assert (await store.admit(claim(0.1, KEY, USER))).refused == "user_budget"  # 0.45 held of 0.5
    run.turns, run.cost_usd = 1, 0.25
    await store.commit_turn(run, [], Booking("demo", "total", 0.25, first.reservation_id))
    await store.release(second.reservation_id)
    assert (await store.figures("demo", "total", None, (KEY, USER))).holds == ((0.25, 0.0), (0.25, 0.0))
    third = await store.admit(claim(0.2, KEY, USER))
    assert third.reservation_id is not None
    await store.settle(third.reservation_id, 0.1)
    await store.settle(third.reservation_id, 0.1)  # once
    assert (await store.figures("demo", "total", None, (KEY, USER))).holds == ((0.35, 0.0), (0.35, 0.0))
    assert (await store.admit(claim(0.16, KEY, USER))).refused == "user_budget"
    assert (await store.admit(claim(0.15, KEY, USER))).reservation_id is not None  # exactly what is left


async def test_a_process_that_died_frees_its_holds_with_its_reservations(stores: Stores) -> None:
    store = stores.open()
    admitted_at = time.monotonic()
    held = await store.admit(claim(0.5, USER, ttl_s=1.0))
    assert held.reservation_id is not None
    # Refused while the hold lives (unless the machine stalled past its whole ttl in between).
    assert (await store.admit(claim(0.1, USER))).refused == "user_budget" or time.monotonic() - admitted_at >= 1.0
    deadline = time.monotonic() + 10
    while (await store.admit(claim(0.1, USER, owner="other"))).reservation_id is None:
        assert time.monotonic() < deadline, "an expired hold kept counting"
        await asyncio.sleep(0.05)  # polling for the expiry the store's clock decides
    mine = await store.admit(claim(0.1, USER, owner="dead"))
    assert mine.reservation_id is not None
    assert await store.release_owner("dead") == 1
    assert (await store.figures("demo", "total", None, (USER,))).holds[0][1] == pytest.approx(0.1)


async def test_every_booking_adds_to_the_days_spend_row_of_its_attribution(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    grants = await asyncio.gather(*(views[i % 2].admit(claim(0.01, KEY)) for i in range(20)))
    await asyncio.gather(*(views[i % 2].settle(g.reservation_id or "", 0.003) for i, g in enumerate(grants)))
    await views[0].charge("demo", "total", 0.5)
    await views[1].charge("other", "total", 0.25, Attribution("cfg_x", "", "m", ""))
    today = spend_day(time.time())
    rows = await views[0].spend(today, today)
    by = {(r.team, r.key, r.user, r.model, r.policy): (r.cost_micros, r.calls) for r in rows}
    assert by == {("demo", "key_a", "ana", "gpt-x", "passthrough"): (60_000, 20), ("demo", "", "", "", ""): (500_000, 1),
                  ("other", "cfg_x", "", "m", ""): (250_000, 1)}
    assert sum(r.cost_micros for r in await views[1].spend(today, today, "demo")) == round(
        (await views[1].team_spend("demo", "total"))[0] * 1e6)
    assert await views[0].spend("2000-01-01", "2000-01-02") == []
    assert await views[0].prune_spend("2999-01-01") == 1
    assert await views[0].spend(today, today) == []
