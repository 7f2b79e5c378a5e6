"""Rate limits in the admission step (`Claim.rates`), on every backend: requests, tokens and
calls in flight of a scope, checked and spent in the same atomic step as the rest of the
claim, exact across two views of one store (two replicas)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.store.base import Booking, Claim, ClockPush, RateLimit, Store, TokenCharge, fits
from tests.store.conftest import Stores

HOUR = 3600.0  # a window long enough that nothing refills during a test


def claim(*rates: RateLimit, tokens: int = 0, ttl_s: float = 600.0) -> Claim:
    return Claim("demo", "total", rates=rates, tokens=tokens, ttl_s=ttl_s)


async def test_requests_per_window_are_exact_across_two_replicas(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    limit = RateLimit("team:demo", HOUR, requests=20)
    grants = await asyncio.gather(*(views[i % 2].admit(claim(limit)) for i in range(64)))
    assert sum(g.reservation_id is not None for g in grants) == 20
    assert {g.refused for g in grants if g.reservation_id is None} == {"rate_limit"}
    refused = next(g for g in grants if g.reservation_id is None)
    state = refused.rates[0]
    assert not fits(state.requests_tat, state.now, limit.requests_s or 0, limit.window_s)


async def test_tokens_are_counted_before_and_reconciled_at_booking(store: Store) -> None:
    limit = RateLimit("team:demo", HOUR, tokens=1000)
    first = await store.admit(claim(limit, tokens=400))
    assert first.reservation_id is not None
    assert first.rates[0].tokens_tat - first.rates[0].now == HOUR * 400 / 1000
    # The call really used 700 tokens (prompt and completion): 300 more than counted.
    await store.settle(first.reservation_id, 0.0, [TokenCharge("team:demo", 300, HOUR / 1000)])
    assert (await store.admit(claim(limit, tokens=301))).refused == "rate_limit"
    assert (await store.admit(claim(limit, tokens=300))).reservation_id is not None
    # A second settle of the same reservation books nothing more, tokens included.
    await store.settle(first.reservation_id, 0.0, [TokenCharge("team:demo", -1000, HOUR / 1000)])
    assert (await store.admit(claim(limit, tokens=1))).refused == "rate_limit"


async def test_a_key_and_its_team_reconcile_their_tokens_each(store: Store) -> None:
    # Two scopes of one call (a key and its team) each reconcile their own clocks.
    team = RateLimit("team:demo", HOUR, tokens=1000)
    key = RateLimit("key:k1", HOUR, tokens=500)
    first = await store.admit(claim(key, team, tokens=100))
    assert first.reservation_id is not None
    assert [s.tokens_tat - s.now for s in first.rates] == pytest.approx([HOUR * 100 / 500, HOUR * 100 / 1000])
    await store.settle(first.reservation_id, 0.0, [TokenCharge("key:k1", 300, HOUR / 500),
                                                   TokenCharge("team:demo", 300, HOUR / 1000)])
    # 400 spent of each: the key has 100 left, the team 600.
    assert (await store.admit(claim(key, team, tokens=101))).refused == "rate_limit"
    assert (await store.admit(claim(team, tokens=601))).refused == "rate_limit"
    assert (await store.admit(claim(key, team, tokens=100))).reservation_id is not None
    assert (await store.admit(claim(team, tokens=500))).reservation_id is not None


async def test_a_reconciled_booking_books_its_spend_and_frees_its_hold_exactly(store: Store) -> None:
    # The team's clocks and its ledger are written together (Redis: one write of the ledger):
    # the money figures move as without rate limits.
    limit = RateLimit("team:demo", HOUR, requests=100, tokens=100_000, max_in_flight=10)
    held = [await store.admit(Claim("demo", "total", 0.25, 10.0, rates=(limit,), tokens=100)) for _ in range(3)]
    assert await store.team_spend("demo", "total") == (0.0, 0.75)
    await store.settle(held[0].reservation_id or "", 0.125, [TokenCharge("team:demo", 400, limit.tokens_s or 0)])
    await store.settle(held[1].reservation_id or "", 0.0, [TokenCharge("team:demo", -100, limit.tokens_s or 0)])
    assert await store.team_spend("demo", "total") == (0.125, 0.25)
    # 300 counted, then +400 and -100 at booking: the clock (well ahead of now) moved by 300
    # tokens, and 1 more for the next claim.
    after = await store.admit(Claim("demo", "total", 0.0, 10.0, rates=(limit,), tokens=1))
    assert after.rates[0].tokens_tat - held[2].rates[0].tokens_tat == pytest.approx(HOUR * 301 / 100_000)
    assert await store.team_spend("demo", "total") == (0.125, 0.25)


async def test_a_booking_gives_back_tokens_counted_too_many(store: Store) -> None:
    from gateway.harness.state import RunState
    limit = RateLimit("team:demo", HOUR, tokens=1000)
    run = RunState.new("m", [], run_id="run_a", team="demo", policy="passthrough")
    await store.create_run(run)
    grant = await store.admit(claim(limit, tokens=900))
    assert grant.reservation_id is not None and (await store.admit(claim(limit, tokens=200))).refused
    await store.commit_turn(run, [], Booking("demo", "total", 0.0, grant.reservation_id,
                                             tokens=(TokenCharge("team:demo", -500, HOUR / 1000),)))
    assert (await store.admit(claim(limit, tokens=500))).reservation_id is not None


async def test_calls_in_flight_of_a_scope_are_bounded_and_freed(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    limit = RateLimit("team:demo", HOUR, max_in_flight=5)
    grants = await asyncio.gather(*(views[i % 2].admit(claim(limit)) for i in range(32)))
    held = [g.reservation_id for g in grants if g.reservation_id is not None]
    assert len(held) == 5
    refused = next(g for g in grants if g.reservation_id is None)
    assert (refused.refused, refused.rates[0].in_flight) == ("rate_limit", 5)
    await views[0].release(held[0])
    await views[1].settle(held[1], 0.0)
    again = await asyncio.gather(*(views[i % 2].admit(claim(limit)) for i in range(8)))
    assert sum(g.reservation_id is not None for g in again) == 2


async def test_a_slot_of_a_dead_process_is_freed_when_its_hold_expires(store: Store) -> None:
    limit = RateLimit("team:demo", HOUR, max_in_flight=1)
    dead = await store.admit(claim(limit, ttl_s=0.0))  # its process never renews it
    assert dead.reservation_id is not None
    assert (await store.admit(claim(limit))).reservation_id is not None


async def test_calls_in_flight_of_a_key_and_of_its_team_are_bounded_each(stores: Stores) -> None:
    # The Redis store counts a team scope's calls in flight from the team's held
    # reservations and a key's in a set of its own: both bounded, freed, and expired alike.
    views = [stores.open(), stores.open()]
    team = RateLimit("team:demo", HOUR, max_in_flight=3)
    key = RateLimit("key:k1", HOUR, max_in_flight=2)
    grants = await asyncio.gather(*(views[i % 2].admit(claim(key, team)) for i in range(16)))
    held = [g.reservation_id for g in grants if g.reservation_id is not None]
    assert len(held) == 2  # the key's limit
    refused = next(g for g in grants if g.reservation_id is None)
    assert [s.in_flight for s in refused.rates] == [2, 2]
    assert (await views[0].admit(claim(team))).reservation_id is not None  # the team's third
    assert (await views[1].admit(claim(team))).refused == "rate_limit"
    await views[1].settle(held[0], 0.0)  # the key has one in flight, the team two
    assert (await views[0].admit(claim(key, team))).reservation_id is not None
    assert (await views[1].admit(claim(team))).refused == "rate_limit"
    await views[0].release(held[1])
    assert (await views[1].admit(claim(key, team, ttl_s=0.0))).reservation_id is not None  # its process dies
    assert (await views[0].admit(claim(key, team))).reservation_id is not None  # the dead one counts no more
    assert [(await views[1].admit(claim(c))).refused for c in (key, team)] == ["rate_limit", "rate_limit"]


async def test_each_scope_is_checked_and_spent(store: Store) -> None:
    team = RateLimit("team:demo", HOUR, requests=3)
    key = RateLimit("key:k1", HOUR, requests=1)
    other = RateLimit("key:k2", HOUR, requests=1)
    assert (await store.admit(claim(team, key))).reservation_id is not None
    assert (await store.admit(claim(team, key))).refused == "rate_limit"  # the key's limit
    assert (await store.admit(claim(team, other))).reservation_id is not None
    # the key's refusal spent nothing of the team's 3: this is its third request, and the last
    assert [(await store.admit(claim(team))).refused for _ in range(2)] == [None, "rate_limit"]


async def test_the_window_refills(store: Store) -> None:
    limit = RateLimit("team:demo", 0.5, requests=2)
    assert [(await store.admit(claim(limit))).refused for _ in range(3)] == [None, None, "rate_limit"]
    refused = await store.admit(claim(limit))
    state = refused.rates[0]
    wait = max(state.requests_tat, state.now) + (limit.requests_s or 0) - state.now - limit.window_s
    assert 0 < wait <= 0.25 + 1e-3
    deadline = asyncio.get_running_loop().time() + 10
    while (await store.admit(claim(limit))).reservation_id is None:  # refilled at 4 per second
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_a_claim_spends_the_requests_it_takes_ahead_and_pushed_clocks_give_them_back(stores: Stores) -> None:
    # A process takes 5 requests with one claim (its call's and 4 ahead), on a team's clock
    # and a key's; the other replica sees them spent. It gives 3 back with push_clocks.
    taker, other = stores.open(), stores.open()
    team, key = RateLimit("team:demo", HOUR, requests=10), RateLimit("key:k1", HOUR, requests=8)
    granted = await taker.admit(claim(key.spending(5), team.spending(5)))
    assert granted.reservation_id is not None
    assert [s.requests_tat - s.now for s in granted.rates] == pytest.approx([HOUR * 5 / 8, HOUR * 5 / 10])
    assert (await other.admit(claim(key.spending(4), team))).refused == "rate_limit"  # 5 + 4 > 8
    assert (await other.admit(claim(team.spending(6)))).refused == "rate_limit"  # 5 + 6 > 10
    await taker.push_clocks([ClockPush("key:k1", -3 * (key.requests_s or 0), 0.0),
                             ClockPush("team:demo", -3 * (team.requests_s or 0), 0.0)])
    # 2 of each spent: the key has 6 left, the team 8.
    assert (await other.admit(claim(key.spending(7), team.spending(7)))).refused == "rate_limit"
    assert (await other.admit(claim(key.spending(6), team.spending(6)))).reservation_id is not None
    assert (await other.admit(claim(team.spending(3)))).refused == "rate_limit"
    assert (await other.admit(claim(team.spending(2)))).reservation_id is not None


async def test_pushed_clocks_move_each_kind_on_its_own(store: Store) -> None:
    limit = RateLimit("team:demo", HOUR, requests=10, tokens=1000)
    assert (await store.admit(claim(limit.spending(4), tokens=600))).reservation_id is not None
    await store.push_clocks([ClockPush("team:demo", 0.0, -200 * (limit.tokens_s or 0))])  # tokens only
    assert (await store.admit(claim(limit.spending(6), tokens=601))).refused == "rate_limit"  # 1000 - 400
    assert (await store.admit(claim(limit.spending(7), tokens=1))).refused == "rate_limit"  # 10 - 4
    assert (await store.admit(claim(limit.spending(6), tokens=600))).reservation_id is not None
