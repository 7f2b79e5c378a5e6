"""Prometheus metrics of the gateway: every DESIGN metric, bounded labels, figures that add up."""

from __future__ import annotations

import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.harness.usage import Usage
from gateway.server.metrics import Metrics
from tests.server.conftest import PLAN_USER, FixedUpstream, Gateway, MakeGateway, fixed_config

DESIGN_METRICS = [
    "gateway_requests", "gateway_turns", "gateway_tokens", "gateway_cost_usd", "gateway_runs_stopped",
    "gateway_tool_calls", "gateway_tool_duration_seconds", "gateway_upstream_duration_seconds",
    "gateway_ttft_seconds", "gateway_overhead_seconds", "gateway_team_spend_usd",
    "gateway_team_budget_remaining_usd", "gateway_approvals_pending", "gateway_runs_active",
    "gateway_turns_per_run", "gateway_cost_per_run_usd",
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


async def test_every_design_metric_is_exposed(gw: Gateway) -> None:
    text = await gw.metrics()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert set(DESIGN_METRICS) <= names


async def test_turns_tokens_cost_and_timings_add_up(make_gateway: MakeGateway, fixed_upstream: FixedUpstream) -> None:
    fixed_upstream.json_body = orjson.dumps({
        "id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10}})
    gw = await make_gateway(**fixed_config(fixed_upstream, team={"budget_usd": 1.0}, models=[
        {"match": "named-model", "upstream": "fixed", "price_in": 2.0, "price_out": 12.0},
        {"match": "*", "upstream": "fixed", "price_in": 2.0, "price_out": 12.0}]))
    for model, run_id in [("named-model", "m-1"), ("named-model", "m-1"), ("whatever-9f3a", "m-2")]:
        status, _, _ = await gw.chat({"model": model, "messages": [PLAN_USER]}, run_id=run_id)
        assert status == 200
    await gw.chat({"model": "named-model", "messages": "bad"}, run_id="m-3")
    async with gw.client.get("/v1/runs-that-do-not-exist/abc") as resp:
        assert resp.status == 404
    text = await gw.metrics()
    assert value(text, "gateway_turns_total", team="t", policy="passthrough", model="named-model") == 2
    assert value(text, "gateway_turns_total", team="t", policy="passthrough", model="other") == 1
    assert value(text, "gateway_tokens_total", team="t", model="named-model", kind="prompt") == 200
    assert value(text, "gateway_tokens_total", team="t", model="named-model", kind="completion") == 20
    one = (100 * 2 + 10 * 12) / 1e6
    assert abs(value(text, "gateway_cost_usd_total", team="t", model="named-model") - 2 * one) < 1e-12
    assert value(text, "gateway_requests_total", route="/v1/chat/completions", code="200") == 3
    assert value(text, "gateway_requests_total", route="/v1/chat/completions", code="400") == 1
    assert value(text, "gateway_requests_total", route="unmatched", code="404") == 1
    assert value(text, "gateway_overhead_seconds_count") == 3
    assert value(text, "gateway_upstream_duration_seconds_count", upstream="fixed", model="named-model") == 2
    assert abs(value(text, "gateway_team_spend_usd", team="t") - 3 * one) < 1e-9
    assert abs(value(text, "gateway_team_budget_remaining_usd", team="t") - (1.0 - 3 * one)) < 1e-9
    assert value(text, "gateway_runs_stopped_total", team="t", policy="passthrough", status="completed",
                 reason="completed") == 3
    assert value(text, "gateway_runs_active") == 0
    # no run id and no raw path ever becomes a label
    for run_id in ("m-1", "m-2", "m-3", "abc", "whatever-9f3a"):
        assert run_id not in text


async def test_streams_record_time_to_first_token(gw: Gateway) -> None:
    async with gw.client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-test"},
                              json={"model": "scripted-plan", "messages": [PLAN_USER], "stream": True}) as resp:
        await resp.read()
    text = await gw.metrics()
    assert value(text, "gateway_ttft_seconds_count", upstream="scripted", model="scripted-plan") == 1


def test_label_values_stay_bounded() -> None:
    metrics = Metrics(["scripted-plan"])
    metrics.on_turn("t", "p", "scripted-plan", Usage(1, 1), 0.1)
    metrics.on_turn("t", "p", "some-random-model", Usage(1, 1), 0.1)
    metrics.on_run_stopped("t", "p", "failed", "no such file: /etc/shadow was not found", 3, 0.01)
    metrics.on_run_stopped("t", "p", "failed", "permanent_error", 3, 0.01)
    metrics.on_tool("p", "read_file", "ok", 0.01)
    metrics.on_tool("p", "read_file", "Weird Outcome!", None)
    text = metrics.render().decode()
    assert value(text, "gateway_turns_total", team="t", policy="p", model="other") == 1
    assert value(text, "gateway_runs_stopped_total", team="t", policy="p", status="failed", reason="other") == 1
    assert value(text, "gateway_runs_stopped_total", team="t", policy="p", status="failed",
                 reason="permanent_error") == 1
    assert value(text, "gateway_tool_calls_total", policy="p", tool="read_file", outcome="other") == 1
    assert value(text, "gateway_tool_duration_seconds_count", tool="read_file") == 1
    assert value(text, "gateway_turns_per_run_count", team="t", policy="p") == 2
    # two apps, two registries: nothing leaks between them
    assert value(Metrics().render().decode(), "gateway_turns_per_run_count", team="t", policy="p") == 0
