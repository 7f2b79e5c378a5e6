"""Fifty calls at once against a team budget that pays for about ten turns."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.harness.usage import Price, Usage
from gateway.server import context as ctx
from gateway.server.runs.governor import MARGIN_USD
from gateway.tokens import get_counter
from tests.server.conftest import (
    PLAN_USER,
    CountingUpstream,
    Gateway,
    MakeGateway,
    counted_config,
)

PRICE = Price(2.0, 12.0)
BODY: dict[str, Any] = {"model": "scripted-runaway", "messages": [PLAN_USER]}
HEADERS = {"X-Policy": "unlimited", "X-Scripted-Latency-Ms": "20"}


async def storm(gw: Gateway, body: dict[str, Any], n: int = 50) -> list[tuple[int, dict[str, str], Any]]:
    return list(await asyncio.gather(*[gw.chat(body, headers=HEADERS) for _ in range(n)]))


async def one_turn_cost(make_gateway: MakeGateway, upstream: CountingUpstream) -> float:
    probe = await make_gateway(**counted_config(upstream))
    status, headers, _ = await probe.chat(BODY, headers=HEADERS)
    assert status == 200
    return float(headers["X-Run-Cost-Usd"])


async def ledger(gw: Gateway) -> tuple[float, float]:
    return await gw.store.team_spend("t", gw.app[ctx.GOVERNOR].period(gw.config.teams[0]))


def check_outcomes(results: list[tuple[int, dict[str, str], Any]]) -> list[float]:
    """Every call either succeeded or was refused as team_budget_exceeded; returns the costs paid."""
    paid = []
    for status, headers, body in results:
        if status == 200:
            paid.append(float(headers["X-Run-Cost-Usd"]))
        else:
            assert status == 429 and body["error"]["type"] == "team_budget_exceeded", body
            assert body["run"]["turns"] == 0
    return paid


async def test_strict_mode_never_spends_more_than_the_budget(make_gateway: MakeGateway,
                                                             counting_upstream: CountingUpstream) -> None:
    turn = await one_turn_cost(make_gateway, counting_upstream)
    budget = 10 * turn
    gw = await make_gateway(**counted_config(counting_upstream, team={"budget_usd": budget, "budget_mode": "strict"}))
    for body in ({**BODY, "max_tokens": 30}, BODY):  # with a client allowance, then with the default (4096)
        results = await storm(gw, body)
        paid = check_outcomes(results)
        assert paid, "some calls must get through"
        spent, reserved = await ledger(gw)
        assert reserved == 0
        assert spent <= budget + 1e-9, (spent, budget)
    # One by one now: strict clamps max_tokens to what is left, so the budget is used up
    # to the last affordable token and never passed.
    finishes = []
    for _ in range(20):
        status, headers, body = await gw.chat(BODY, headers=HEADERS)
        if status != 200:
            break
        finishes.append(body["choices"][0]["finish_reason"])
    assert status == 429 and body["error"]["type"] == "team_budget_exceeded"
    assert finishes[-1] == "length"  # the last call got only what the budget could pay for
    spent, reserved = await ledger(gw)
    # what is left cannot pay for the prompt and one output token (plus the governor's dust margin)
    smallest_call = PRICE.cost(Usage(get_counter().count_request([PLAN_USER]), 1)) + MARGIN_USD
    assert reserved == 0 and budget - smallest_call < spent <= budget + 1e-9, (spent, budget)
    # the ledger is exactly the sum of what the runs were charged
    runs = await gw.store.list_runs(team="t", limit=1000)
    assert abs(sum(r.cost_usd for r in runs) - spent) < 1e-6


async def test_turn_mode_overshoots_at_most_one_turn_per_call_in_flight(
        make_gateway: MakeGateway, counting_upstream: CountingUpstream) -> None:
    turn = await one_turn_cost(make_gateway, counting_upstream)
    budget = 10 * turn
    # An allowance of 5 output tokens is less than a runaway turn writes (23): the overshoot
    # per admitted call is bounded by what its reservation did not cover.
    gw = await make_gateway(**counted_config(counting_upstream, team={"budget_usd": budget},
                                             defaults={"output_allowance_tokens": 5}))
    results = await storm(gw, BODY)
    paid = check_outcomes(results)
    reserved_each = PRICE.cost(Usage(get_counter().count_request([PLAN_USER]), 5))
    spent, reserved = await ledger(gw)
    assert reserved == 0
    assert spent <= budget + len(paid) * (turn - reserved_each) + 1e-9
    assert len(paid) < 50  # the reservations did stop the storm
    status, _, body = await gw.chat(BODY, headers=HEADERS)
    assert status == 429 and body["error"]["type"] == "team_budget_exceeded"


async def test_turn_mode_with_an_allowance_that_covers_the_reply_never_overspends(
        make_gateway: MakeGateway, counting_upstream: CountingUpstream) -> None:
    turn = await one_turn_cost(make_gateway, counting_upstream)
    budget = 10 * turn
    gw = await make_gateway(**counted_config(counting_upstream, team={"budget_usd": budget}))
    results = await storm(gw, {**BODY, "max_tokens": 30})
    paid = check_outcomes(results)
    spent, _ = await ledger(gw)
    assert 1 <= len(paid) <= 10 and spent <= budget + 1e-9
