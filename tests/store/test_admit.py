"""The admission contract (`Store.admit`), on every backend: a turn slot and a budget hold in
one atomic step, exact across two views of one store (two replicas)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.harness.state import RunState
from gateway.store.base import Booking, Claim, Store
from gateway.store.errors import AlreadyBooked, RunExists
from tests.store.conftest import Stores


async def new_run(store: Store, run_id: str = "run_a", *, turns: int = 0, cost_usd: float = 0.0) -> RunState:
    run = RunState.new("scripted-plan", [{"role": "user", "content": "hi"}], run_id=run_id, team="demo",
                       policy="passthrough")
    run.turns, run.cost_usd = turns, cost_usd
    await store.create_run(run)
    return run


def slot(run_id: str = "run_a", **kw: object) -> Claim:
    fields: dict[str, object] = {"team": "demo", "period": "total", "run_id": run_id}
    fields.update(kw)
    return Claim(**fields)  # type: ignore[arg-type]


async def test_turn_slots_are_exact_across_two_replicas(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    await new_run(views[0], turns=5)
    grants = await asyncio.gather(*(views[i % 2].admit(slot(max_turns=20)) for i in range(64)))
    held = [g for g in grants if g.reservation_id is not None]
    assert len(held) == 15  # 5 booked turns + 15 in flight = the cap
    assert {g.refused for g in grants if g.reservation_id is None} == {"max_turns"}
    figures = await views[1].figures("demo", "total", "run_a")
    assert (figures.run_turns, figures.run_in_flight) == (5, 15)


async def test_a_booked_turn_frees_its_slot_and_counts_as_a_turn(store: Store) -> None:
    run = await new_run(store)
    first = await store.admit(slot(max_turns=2, amount_usd=0.01))
    second = await store.admit(slot(max_turns=2))
    assert first.reservation_id and second.reservation_id
    assert (await store.admit(slot(max_turns=2))).refused == "max_turns"
    run.turns, run.cost_usd = 1, 0.004
    await store.commit_turn(run, [], Booking("demo", "total", 0.004, first.reservation_id))
    refused = await store.admit(slot(max_turns=2))  # 1 booked + 1 in flight
    assert refused.refused == "max_turns"
    assert (refused.figures.run_turns, refused.figures.run_in_flight) == (1, 1)
    await store.release(second.reservation_id)
    assert (await store.admit(slot(max_turns=2))).reservation_id is not None
    assert await store.team_spend("demo", "total") == (0.004, 0.0)


async def test_calls_in_flight_per_run_are_bounded(store: Store) -> None:
    await new_run(store)
    grants = [await store.admit(slot(max_in_flight=3)) for _ in range(4)]
    assert [g.refused for g in grants] == [None, None, None, "busy"]
    await new_run(store, "run_b")  # another run has slots of its own
    assert (await store.admit(slot("run_b", max_in_flight=3))).reservation_id is not None


async def test_the_run_budget_counts_booked_cost_and_holds_in_flight(store: Store) -> None:
    await new_run(store, cost_usd=0.05)
    assert (await store.admit(slot(amount_usd=0.03, run_budget_usd=0.1))).reservation_id
    refused = await store.admit(slot(amount_usd=0.03, run_budget_usd=0.1))
    assert refused.refused == "run_budget"
    assert refused.figures.run_cost_usd == 0.05 and refused.figures.run_held_usd == 0.03
    assert (await store.admit(slot(amount_usd=0.02, run_budget_usd=0.1))).reservation_id  # exactly what is left


async def test_the_team_budget_is_checked_in_the_same_step(store: Store) -> None:
    await new_run(store)
    assert (await store.admit(slot(amount_usd=0.06, budget_usd=0.1))).reservation_id
    refused = await store.admit(slot(amount_usd=0.06, budget_usd=0.1, max_turns=10))
    assert refused.refused == "team_budget" and refused.figures.reserved_usd == 0.06
    assert (await store.figures("demo", "total", "run_a")).run_in_flight == 1  # the refusal held nothing


async def test_a_slot_for_a_run_that_is_not_stored_is_refused(store: Store) -> None:
    assert (await store.admit(slot("run_missing", max_turns=3))).refused == "run_missing"
    no_run = await store.admit(Claim("demo", "total", 0.01))  # a hold without a run (a sub-run's call)
    assert no_run.reservation_id is not None


async def test_a_first_call_creates_its_run_in_the_same_step(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    run = RunState.new("scripted-plan", [{"role": "user", "content": "hi"}], run_id="run_new", team="demo",
                       policy="passthrough")
    grant = await views[0].admit(slot("run_new", max_turns=2, amount_usd=0.01, budget_usd=1.0, create=run))
    assert grant.reservation_id is not None
    stored = await views[1].load_run("run_new")
    assert stored is not None and stored.revision == run.revision and stored.team == "demo"
    assert (await views[1].figures("demo", "total", "run_new")).run_in_flight == 1
    # Two first calls of one id (two replicas): one creates, the other is told, holding nothing.
    with pytest.raises(RunExists):
        await views[1].admit(slot("run_new", max_turns=2, amount_usd=0.01, budget_usd=1.0, create=run))
    assert await views[1].team_spend("demo", "total") == (0.0, 0.01)
    # A refused claim leaves the run it created stored (as create_run then admit would).
    other = RunState.new("scripted-plan", [], run_id="run_poor", team="demo", policy="passthrough")
    refused = await views[1].admit(slot("run_poor", amount_usd=5.0, budget_usd=1.0, create=other))
    assert refused.refused == "team_budget"
    assert await views[0].load_run("run_poor") is not None
    assert (await views[0].figures("demo", "total", "run_poor")).run_in_flight == 0


async def test_expired_slots_do_not_count_and_renewed_ones_do(store: Store) -> None:
    await new_run(store)
    dead = await store.admit(slot(max_turns=2, amount_usd=0.01, budget_usd=1.0, ttl_s=0))
    alive = await store.admit(slot(max_turns=2, amount_usd=0.01, budget_usd=1.0, ttl_s=1.5))
    assert dead.reservation_id and alive.reservation_id
    await store.renew([alive.reservation_id], 60)
    await asyncio.sleep(1.6)  # past the first ttl: only a renewal keeps it
    figures = await store.figures("demo", "total", "run_a")
    assert (figures.run_in_flight, figures.reserved_usd) == (1, 0.01)


async def test_release_owner_gives_back_every_hold_of_a_restarted_process(store: Store) -> None:
    await new_run(store)
    mine = [await store.admit(slot(owner="host/a", amount_usd=0.01, budget_usd=1.0)) for _ in range(3)]
    theirs = await store.admit(slot(owner="host/b", amount_usd=0.01, budget_usd=1.0))
    assert all(g.reservation_id for g in [*mine, theirs])
    assert await store.release_owner("host/a") == 3
    figures = await store.figures("demo", "total", "run_a")
    assert (figures.run_in_flight, figures.reserved_usd) == (1, 0.01)
    assert await store.release_owner("host/a") == 0


async def test_release_owner_keeps_the_holds_of_spooled_turns(store: Store) -> None:
    """A restarted process's turns waiting in the spool keep their holds: the replay books
    them against those (a released one would read as booked already, and the spend be lost)."""
    await new_run(store)
    mine = [await store.admit(slot(owner="host/a", amount_usd=0.01, budget_usd=1.0)) for _ in range(3)]
    spooled = mine[0].reservation_id
    assert spooled is not None
    assert await store.release_owner("host/a", keep={spooled, "gone"}) == 2
    figures = await store.figures("demo", "total", "run_a")
    assert (figures.run_in_flight, figures.reserved_usd) == (1, 0.01)
    await store.commit_turn(await _loaded(store), [], Booking("demo", "total", 0.004, spooled, if_held=True))
    assert await store.team_spend("demo", "total") == (0.004, 0.0)
    assert await store.release_owner("host/a") == 0


async def _loaded(store: Store) -> RunState:
    run = await store.load_run("run_a")
    assert run is not None
    return run


@pytest.mark.parametrize("field", ["amount_usd", "budget_usd", "run_budget_usd"])
async def test_bad_amounts_are_refused_by_name(store: Store, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        await store.admit(slot(**{field: float("nan")}))


async def test_a_replayed_booking_books_once(store: Store) -> None:
    run = await new_run(store)
    grant = await store.admit(slot(amount_usd=0.01, budget_usd=1.0))
    assert grant.reservation_id is not None
    booking = Booking("demo", "total", 0.004, grant.reservation_id, if_held=True)
    run.turns, run.cost_usd = 1, 0.004
    await store.commit_turn(run, [{"type": "turn"}], booking)
    again = await store.load_run("run_a")
    assert again is not None
    again.turns, again.cost_usd = 2, 0.008
    with pytest.raises(AlreadyBooked):
        await store.commit_turn(again, [{"type": "turn"}], booking)
    stored = await store.load_run("run_a")
    assert stored is not None and (stored.turns, stored.revision) == (1, 1)  # nothing written the second time
    assert await store.team_spend("demo", "total") == (0.004, 0.0)
    assert [e for _, e in await store.events("run_a")] == [{"type": "turn"}]
