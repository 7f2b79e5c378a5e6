"""The governor over a real SQLite store: reservations, strict clamps, periods that roll over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.config.settings import Defaults, TeamConfig
from gateway.harness.state import Limits, RunState
from gateway.harness.usage import Price, Usage
from gateway.server.http.errors import LimitExceeded
from gateway.server.runs.governor import MARGIN_USD, Admission, Ask, Governor
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


async def admit(gov: Governor, t: TeamConfig, run: RunState, max_tokens: int | None = None, n: int = 1) -> Admission:
    if await gov.store.load_run(run.run_id) is None:  # a call's turn slot belongs to a stored run
        await gov.store.create_run(run)
    return await gov.admit_turn(run, t, Ask(PRICE, MESSAGES, None, max_tokens, n))


async def in_flight(gov: Governor, run: RunState) -> int:
    return (await gov.store.figures("t", "total", run.run_id)).run_in_flight


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
    assert await in_flight(gov, run) == 1
    await gov.release(adm)
    await gov.settle(adm, 0.5)  # after a release: nothing more is booked
    assert await store.team_spend("t", "total") == (0.0, 0.0)
    assert await in_flight(gov, run) == 0


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
    a = await admit(gov, t, run)
    b = await admit(gov, t, run)
    with pytest.raises(LimitExceeded) as info:
        await admit(gov, t, run)
    assert info.value.kind == "max_turns_exceeded" and "2 more in flight" in info.value.message
    await gov.release(a)
    c = await admit(gov, t, run)  # a slot came back
    for adm in (b, c):
        await gov.release(adm)


async def test_an_admission_left_without_a_booking_releases_its_slot(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team(budget_usd=1.0, budget_period="total")
    run = RunState.new("m", MESSAGES, limits=Limits(max_turns=1))
    with pytest.raises(RuntimeError):
        async with await admit(gov, t, run):
            raise RuntimeError("the upstream failed")
    assert await store.team_spend("t", "total") == (0.0, 0.0)
    async with await admit(gov, t, run) as adm:  # the slot came back
        await gov.settle(adm, 0.001)
    assert await store.team_spend("t", "total") == (0.001, 0.0)


async def test_reservations_are_sized_for_every_choice(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team(budget_usd=1.0, budget_period="total")
    adm = await admit(gov, t, RunState.new("m", MESSAGES), max_tokens=100, n=8)
    assert await store.team_spend("t", "total") == (0.0, pytest.approx(prompt_cost() + PRICE.cost(Usage(0, 800))))
    assert adm.allowed_completion == 800
    await gov.release(adm)


async def test_strict_clamps_each_choice_so_all_of_them_fit(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    t = team(budget_usd=0.01, budget_period="total", budget_mode="strict")
    adm = await admit(gov, t, RunState.new("m", MESSAGES), n=8)
    assert adm.max_tokens is not None
    prompt = get_counter().count_request(MESSAGES)
    assert PRICE.cost(Usage(prompt, adm.max_tokens * 8)) <= 0.01
    assert PRICE.cost(Usage(prompt, (adm.max_tokens + 1) * 8)) > 0.01 - 2 * MARGIN_USD
    await gov.release(adm)


async def test_no_budget_and_no_strict_counts_nothing(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    adm = await admit(gov, team(), RunState.new("m", MESSAGES))
    assert adm.prompt_tokens is None and adm.max_tokens is None
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
    assert booking is not None and booking.reservation_id == adm.reservation
    assert gov.booking(adm, 0.002) is None  # closed: a second close books nothing
    run.turns = 1
    ledger = await store.commit_turn(run, [{"type": "turn"}], booking)
    assert gov.remaining(t, ledger) == pytest.approx(0.998)
    await gov.book(booking)  # the fallback after a failed save is safe even when the save went through
    spent, reserved = await store.team_spend("t", "total")
    assert spent == pytest.approx(0.002) and reserved == 0.0


async def test_every_call_holds_a_slot_that_its_booking_frees(store: Store) -> None:
    gov = Governor(store, get_counter(), Defaults())
    run = RunState.new("m", MESSAGES, team="t")
    free = gov.booking(await admit(gov, team(), run), 0.0)  # a free call still holds the run's turn slot
    assert free is not None and free.reservation_id is not None and free.actual_usd == 0.0
    run.turns = 1
    await store.commit_turn(run, [], free)
    assert (await store.figures("t", free.period, run.run_id)).run_in_flight == 0
    booking = gov.booking(await admit(gov, team(), RunState.new("m", MESSAGES)), 0.25)
    assert booking is not None and booking.period == gov.period(team())
    await gov.book(booking)
    assert await store.team_spend("t", booking.period) == (0.25, 0.0)
    assert gov.remaining(team(), (0.25, 0.0)) is None  # no team budget: nothing remains to report
