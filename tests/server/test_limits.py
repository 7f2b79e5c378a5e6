"""Refusals before forwarding: 429, x-should-retry false, the run object, nothing upstream."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.server import context as ctx
from gateway.tokens import get_counter
from tests.server.conftest import PLAN_USER, CountingUpstream, MakeGateway, counted_config

RUNAWAY: dict[str, Any] = {"model": "scripted-runaway", "messages": [PLAN_USER]}
PRICE = Price(2.0, 12.0)


def assert_refusal(status: int, headers: dict[str, str], body: Any, kind: str, run_id: str) -> None:
    assert status == 429, body
    assert headers["x-should-retry"] == "false"
    assert body["error"]["type"] == kind and body["error"]["code"] == kind
    assert "nothing was forwarded" in body["error"]["message"]
    assert body["run"]["id"] == run_id == headers["X-Run-Id"]
    assert headers["X-Run-Turns"] == str(body["run"]["turns"])
    assert headers["X-Run-Status"] == body["run"]["status"]


async def test_turn_cap_refuses_without_forwarding(make_gateway: MakeGateway,
                                                   counting_upstream: CountingUpstream) -> None:
    gw = await make_gateway(**counted_config(counting_upstream))
    for turn in range(1, 4):
        status, headers, _ = await gw.chat(RUNAWAY, run_id="cap-1", headers={"X-Policy": "capped"})
        assert status == 200 and headers["X-Run-Turns"] == str(turn)
    assert len(counting_upstream.chat_calls()) == 3
    for _ in range(2):  # refused again, still nothing forwarded
        status, headers, body = await gw.chat(RUNAWAY, run_id="cap-1")
        assert_refusal(status, headers, body, "max_turns_exceeded", "cap-1")
        assert body["run"]["status"] == "max_turns_exceeded" and body["run"]["turns"] == 3
        assert body["run"]["interruption"] == {"type": "max_turns", "waiting_for": "resume"}
    assert len(counting_upstream.chat_calls()) == 3
    run = await gw.store.load_run(scoped_run_id("t", "cap-1"))
    assert run is not None and run.status == "max_turns_exceeded" and run.reason == "max_turns"
    stopped = [e for _, e in await gw.store.events(scoped_run_id("t", "cap-1")) if e["type"] == "run_stopped"]
    assert len(stopped) == 1 and stopped[0]["status"] == "max_turns_exceeded"  # traced once, not per refusal
    metrics = await gw.metrics()
    assert 'gateway_runs_stopped_total{policy="capped",reason="max_turns",status="max_turns_exceeded",team="t"} 1.0' \
        in metrics


async def test_run_budget_stops_within_one_turn(make_gateway: MakeGateway,
                                                counting_upstream: CountingUpstream) -> None:
    gw = await make_gateway(**counted_config(counting_upstream))
    costs = []
    for _ in range(50):
        status, headers, body = await gw.chat(RUNAWAY, run_id="b-1", headers={"X-Policy": "budgeted"})
        if status != 200:
            break
        costs.append(float(headers["X-Run-Cost-Usd"]))
        assert body["choices"][0]["message"]["tool_calls"]
    assert_refusal(status, headers, body, "budget_exceeded", "b-1")
    budget = 0.002
    assert costs[-2] < budget <= costs[-1]  # checked before each call: the overshoot is the last turn
    assert float(headers["X-Run-Budget-Remaining-Usd"]) < 0
    assert len(counting_upstream.chat_calls()) == len(costs)


async def test_team_budget_refuses_with_its_own_type(make_gateway: MakeGateway,
                                                     counting_upstream: CountingUpstream) -> None:
    # Each call reserves its prompt + 50 output tokens (r) and costs c < r; the budget B holds
    # c + r (the second call fits after the first) but not 2c + r (the third does not).
    gw = await make_gateway(**counted_config(counting_upstream, team={"budget_usd": 0.00103}))
    body_in = {**RUNAWAY, "max_tokens": 50}
    results = []
    for i in range(4):
        results.append(await gw.chat(body_in, run_id=f"tb-{i}", headers={"X-Policy": "unlimited"}))
    assert [r[0] for r in results] == [200, 200, 429, 429]
    c = float(results[0][1]["X-Run-Cost-Usd"])
    r = PRICE.cost(Usage(get_counter().count_request([PLAN_USER]), 50))
    assert c + r <= 0.00103 < 2 * c + r
    status, headers, body = results[2]
    assert_refusal(status, headers, body, "team_budget_exceeded", "tb-2")
    assert "team 't'" in body["error"]["message"] and "$0.001030" in body["error"]["message"]
    assert body["run"]["status"] == "budget_exceeded" and body["run"]["turns"] == 0
    run = await gw.store.load_run(scoped_run_id("t", "tb-2"))
    assert run is not None and run.reason == "team_budget"
    spent, reserved = await gw.store.team_spend("t", gw.app[ctx.GOVERNOR].period(gw.config.teams[0]))
    assert reserved == 0
    assert abs(spent - sum(float(r[1]["X-Run-Cost-Usd"]) for r in results[:2])) < 1e-6
    assert abs(float(headers["X-Team-Budget-Remaining-Usd"]) - (0.00103 - spent)) < 1e-6
    assert len(counting_upstream.chat_calls()) == 2


async def test_concurrent_calls_of_one_run_never_pass_its_turn_cap(make_gateway: MakeGateway,
                                                                   counting_upstream: CountingUpstream) -> None:
    gw = await make_gateway(**counted_config(counting_upstream))
    latency = {"X-Policy": "capped", "X-Scripted-Latency-Ms": "50"}
    results = await asyncio.gather(*[gw.chat(RUNAWAY, run_id="same", headers=latency) for _ in range(10)])
    assert sorted(r[0] for r in results) == [200] * 3 + [429] * 7
    assert len(counting_upstream.chat_calls()) == 3
    run = await gw.store.load_run(scoped_run_id("t", "same"))
    assert run is not None and run.turns == 3 and len(run.per_turn) == 3
