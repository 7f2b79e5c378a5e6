"""The governor over a real SQLite store: reservations, strict clamps, periods that roll over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.harness.state import Limits, RunState
from gateway.harness.usage import Price, Usage
from gateway.server.budget import MARGIN_USD, Governor
from gateway.server.config import Defaults, TeamConfig
from gateway.server.errors import LimitExceeded
from gateway.store import Store, open_store
from gateway.tokens import get_counter

PRICE = Price(2.0, 12.0)
MESSAGES = [{"role": "user", "content": "Which file mentions a timeout?"}]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = open_store({"kind": "sqlite", "path": str(tmp_path / "ledger.db")})
    yield s
    await s.close()


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def team(**kw: object) -> TeamConfig:
    return TeamConfig(name="t", keys=("k",), policies=("p",), **kw)  # type: ignore[arg-type]


def prompt_cost() -> float:
    return PRICE.cost(Usage(get_counter().count_request(MESSAGES), 0))


async def admit(gov: Governor, t: TeamConfig, run: RunState, max_tokens: int | None = None):  # type: ignore[no-untyped-def]
    adm = gov.open(run, t)
    remaining = None if run.limits.max_budget_usd is None else run.limits.max_budget_usd - run.cost_usd
    await gov.reserve(adm, price=PRICE, messages=MESSAGES, tools=None, max_tokens=max_tokens,
                      run_remaining_usd=remaining)
    return adm


async def test_team_budget_rolls_over_with_the_clock(store: Store) -> None:
    clock = Clock()
    gov = Governor(store, get_counter(), Defaults(output_allowance_tokens=10), clock=clock)
    t = team(budget_usd=0.001, budget_period="day")
    run = RunState.new("m", MESSAGES)
    spent = 0
    while True:
        try:
            adm = await admit(gov, t, run)
        except LimitExceeded as exc:
            assert exc.kind == "team_budget_exceeded" and "2026-03-31" in exc.message
            break
        await gov.settle(adm, 0.0003)
        spent += 1
    assert spent == 3  # 3 x 0.0003 spent, a fourth reservation (prompt + 10 tokens) does not fit
    assert await gov.team_remaining(t) == pytest.approx(0.0001)
    clock.now += timedelta(hours=2)  # past midnight UTC: a new day, a new budget
    adm = await admit(gov, t, run)
    assert adm.period == "2026-04-01" and adm.reservation is not None
    await gov.release(adm)
    assert await store.team_spend("t", "2026-03-31") == (pytest.approx(0.0009), 0.0)
    assert await store.team_spend("t", "2026-04-01") == (0.0, 0.0)


async def test_release_gives_the_reservation_back_and_settle_is_once(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team(budget_usd=1.0, budget_period="total")
    run = RunState.new("m", MESSAGES)
    adm = await admit(gov, t, run, max_tokens=100)
    held = prompt_cost() + PRICE.cost(Usage(0, 100))
    assert await store.team_spend("t", "total") == (0.0, pytest.approx(held))
    assert gov.in_flight(run.run_id) == 1
    await gov.release(adm)
    await gov.settle(adm, 0.5)  # after a release: nothing more is booked
    assert await store.team_spend("t", "total") == (0.0, 0.0)
    assert gov.in_flight(run.run_id) == 0


async def test_strict_clamps_to_the_run_budget_and_counts_calls_in_flight(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team()
    run = RunState.new("m", MESSAGES, limits=Limits(max_budget_usd=0.001, budget_mode="strict"))
    first = await admit(gov, t, run)
    expected = PRICE.max_output_tokens(0.001 - MARGIN_USD, get_counter().count_request(MESSAGES))
    assert first.max_tokens == expected and first.max_tokens < 4096
    # a second call of the same run while the first holds its budget: nothing left for it
    with pytest.raises(LimitExceeded) as info:
        await admit(gov, t, run)
    assert info.value.kind == "budget_exceeded" and "strict" in info.value.message
    await gov.settle(first, 0.0004)
    run.cost_usd = 0.0004
    second = await admit(gov, t, run, max_tokens=5)
    assert second.max_tokens == 5  # the client's own smaller max_tokens stands
    await gov.release(second)


async def test_turn_cap_counts_calls_in_flight(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team()
    run = RunState.new("m", MESSAGES, limits=Limits(max_turns=2))
    a = gov.open(run, t)
    b = gov.open(run, t)
    with pytest.raises(LimitExceeded) as info:
        gov.open(run, t)
    assert info.value.kind == "max_turns_exceeded" and "2 more in flight" in info.value.message
    await gov.release(a)
    c = gov.open(run, t)  # a slot came back
    for adm in (b, c):
        await gov.release(adm)


async def test_no_budget_and_no_strict_counts_nothing(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    adm = await admit(gov, team(), RunState.new("m", MESSAGES))
    assert adm.prompt_tokens is None and adm.reservation is None and adm.max_tokens is None
    await gov.settle(adm, 0.25)  # still booked on the team's ledger (for the spend gauge)
    spent, _ = await store.team_spend("t", gov.period(team()))
    assert spent == pytest.approx(0.25)


async def test_a_turns_booking_closes_the_call_and_books_once_with_its_save(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team(budget_usd=1.0, budget_period="total")
    run = RunState.new("m", MESSAGES, team="t")
    await store.create_run(run)
    adm = await admit(gov, t, run, max_tokens=100)
    booking = gov.booking(adm, 0.002)
    assert booking is not None and booking.reservation_id == adm.reservation and gov.in_flight(run.run_id) == 0
    assert gov.booking(adm, 0.002) is None  # closed: a second close books nothing
    run.turns = 1
    ledger = await store.commit_turn(run, [{"type": "turn"}], booking)
    assert gov.remaining(t, ledger) == pytest.approx(0.998)
    await gov.book(booking)  # the fallback after a failed save is safe even when the save went through
    spent, reserved = await store.team_spend("t", "total")
    assert spent == pytest.approx(0.002) and reserved == 0.0


async def test_a_free_unreserved_call_books_nothing_and_a_paid_one_is_charged(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    assert gov.booking(await admit(gov, team(), RunState.new("m", MESSAGES)), 0.0) is None
    booking = gov.booking(await admit(gov, team(), RunState.new("m", MESSAGES)), 0.25)
    assert booking is not None and booking.reservation_id is None and booking.period == gov.period(team())
    await gov.book(booking)
    assert await store.team_spend("t", booking.period) == (0.25, 0.0)
    assert gov.remaining(team(), (0.25, 0.0)) is None  # no team budget: nothing remains to report
