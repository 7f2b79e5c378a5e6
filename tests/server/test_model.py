"""UpstreamModel: the harness Model over the gateway's upstream client and governor."""

from __future__ import annotations

import pytest

from gateway.harness.model import ModelRequest
from gateway.harness.state import Limits, RunState
from gateway.harness.usage import Price, Usage
from gateway.providers.errors import UpstreamError
from gateway.server import context as ctx
from gateway.server.http.errors import LimitExceeded
from gateway.server.runs.governed_model import UpstreamModel
from gateway.tokens import get_counter
from gateway.tools.catalog import FILE_TOOLS
from tests.server.conftest import PLAN_USER, Gateway, MakeGateway
from tests.support.procs import free_port

PRICE = Price(2.0, 12.0)
TOOLS = [t.openai() for t in FILE_TOOLS]


async def ready(make_gateway: MakeGateway, **kw: object) -> Gateway:
    gw = await make_gateway(**kw)
    async with gw.client.get("/healthz") as resp:  # any request tells the app its own address
        assert resp.status == 200
    return gw


def ledger_key(gw: Gateway) -> str:
    return gw.app[ctx.GOVERNOR].period(gw.config.teams[0])


async def test_a_turn_through_the_scripted_upstream_is_settled_on_the_team(make_gateway: MakeGateway) -> None:
    gw = await ready(make_gateway, team={"budget_usd": 1.0})
    state = RunState.new("scripted-plan", [PLAN_USER], team="t", policy="passthrough")
    model = UpstreamModel.for_run(gw.app, state)
    reply = await model.complete(ModelRequest(model="scripted-plan", messages=[PLAN_USER], tools=TOOLS,
                                              run_id=state.run_id))
    assert reply.message["tool_calls"][0]["function"]["name"] == "list_files"
    assert reply.usage.prompt_tokens == get_counter().count_request([PLAN_USER], TOOLS)
    spent, reserved = await gw.store.team_spend("t", ledger_key(gw))
    assert reserved == 0 and spent == pytest.approx(PRICE.cost(reply.usage))
    text = await gw.metrics()
    assert 'gateway_turns_total{model="scripted-plan",policy="passthrough",team="t"} 1.0' in text


async def test_strict_runs_are_clamped_to_their_remaining_budget(make_gateway: MakeGateway) -> None:
    gw = await ready(make_gateway)
    state = RunState.new("scripted-plan", [PLAN_USER], team="t", policy="strict",
                         limits=Limits(max_budget_usd=0.002, budget_mode="strict"))
    model = UpstreamModel.for_run(gw.app, state)
    prompt = get_counter().count_request([PLAN_USER], TOOLS)
    left = PRICE.cost(Usage(prompt, 5))  # the run can pay for its prompt and five output tokens
    reply = await model.complete(ModelRequest(model="scripted-plan", messages=[PLAN_USER], tools=TOOLS,
                                              run_id=state.run_id, budget_remaining_usd=left + 1e-5))
    assert reply.finish_reason == "length" and reply.usage.completion_tokens <= 5
    assert PRICE.cost(reply.usage) <= left + 1e-5
    with pytest.raises(LimitExceeded) as info:
        await model.complete(ModelRequest(model="scripted-plan", messages=[PLAN_USER], tools=TOOLS,
                                          run_id=state.run_id, budget_remaining_usd=0.0))
    assert info.value.kind == "budget_exceeded"


async def test_team_refusal_and_upstream_failure(make_gateway: MakeGateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = await ready(make_gateway, team={"budget_usd": 0.01},
                     upstreams=[{"name": "scripted", "kind": "scripted"}, {"name": "dead", "base_url": dead}],
                     models=[{"match": "scripted-*", "upstream": "scripted"}, {"match": "*", "upstream": "dead"}])
    state = RunState.new("x", [PLAN_USER], team="t", policy="passthrough")
    model = UpstreamModel.for_run(gw.app, state)
    with pytest.raises(UpstreamError) as failed:
        await model.complete(ModelRequest(model="offline-model", messages=[PLAN_USER], max_tokens=10,
                                          run_id=state.run_id))
    assert failed.value.code == "upstream_unreachable" and failed.value.upstream == "dead"
    assert await gw.store.team_spend("t", ledger_key(gw)) == (0.0, 0.0)  # released
    with pytest.raises(LimitExceeded) as refused:  # the default allowance (4096 tokens) does not fit $0.01
        await model.complete(ModelRequest(model="scripted-plan", messages=[PLAN_USER], run_id=state.run_id))
    assert refused.value.kind == "team_budget_exceeded"
