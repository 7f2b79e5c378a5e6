"""Prometheus metrics of the gateway: every DESIGN metric, bounded labels, figures that add up."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from gateway.harness.usage import Usage
from gateway.server.metrics import (
    LIMIT_OUTCOMES,
    MAX_EXEMPLAR_RUN_ID,
    PASS_THROUGH_STOPS,
    RUN_STOPS,
    KnownPolicy,
    Metrics,
    end_exemplar_run,
    exemplar_run,
)
from tests.server.conftest import PLAN_USER, FixedUpstream, Gateway, MakeGateway, fixed_config

# What Prometheus 2.x sends when it scrapes (scrape.go, acceptHeader).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PLAIN = "text/plain; version=0.0.4; charset=utf-8"
# The families recorded per run: each of their samples may carry the run id as exemplar.
RUN_FAMILIES = ("gateway_upstream_duration_seconds_bucket", "gateway_turns_total", "gateway_tokens_total",
                "gateway_cost_usd_total", "gateway_runs_stopped_total", "gateway_turns_per_run_bucket",
                "gateway_cost_per_run_usd_bucket")

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


async def scrape(gw: Gateway, accept: str | None) -> tuple[str, str]:
    """(Content-Type, body) of GET /metrics sent with `accept`."""
    headers = {"Accept": accept} if accept is not None else {}
    async with gw.client.get("/metrics", headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Vary"] == "Accept"
        return resp.headers["Content-Type"], await resp.text()


def exemplar_runs(text: str) -> dict[str, set[str]]:
    """Sample name -> the run ids its samples' exemplars carry (OpenMetrics text)."""
    out: dict[str, set[str]] = {}
    for family in openmetrics_families(text):  # type: ignore[no-untyped-call]
        for s in family.samples:
            if s.exemplar is not None:
                assert set(s.exemplar.labels) == {"run_id"}, s
                out.setdefault(s.name, set()).add(s.exemplar.labels["run_id"])
    return out


def completing_upstream(fixed_upstream: FixedUpstream) -> None:
    fixed_upstream.json_body = orjson.dumps({
        "id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10}})


async def test_prometheus_gets_openmetrics_with_the_run_id_as_exemplar(make_gateway: MakeGateway,
                                                                     fixed_upstream: FixedUpstream) -> None:
    completing_upstream(fixed_upstream)
    gw = await make_gateway(**fixed_config(fixed_upstream))
    status, headers, _ = await gw.chat({"model": "m", "messages": [PLAN_USER]}, run_id="ex-run-1")
    assert status == 200 and headers["X-Run-Status"] == "completed"

    content_type, text = await scrape(gw, PROMETHEUS_ACCEPT)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0; charset=utf-8"), content_type
    assert text.endswith("# EOF\n")
    runs = exemplar_runs(text)
    for name in RUN_FAMILIES:
        assert runs.get(name) == {"ex-run-1"}, (name, runs)
    assert "gateway_requests_total" not in runs  # a request is not a run's: no exemplar there
    # the same figures as the classic format
    assert value(text.replace("# EOF\n", ""), "gateway_turns_total", team="t", policy="passthrough", model="other") == 1

    # a scraper asking for nothing in particular (curl, promtool) gets the classic text, without exemplars
    for accept in (None, "*/*", "text/plain", "application/openmetrics-text;version=0.0.1"):
        content_type, text = await scrape(gw, accept)
        assert content_type == PLAIN, (accept, content_type)
        assert "# {" not in text and "ex-run-1" not in text and "# EOF" not in text
        assert value(text, "gateway_turns_total", team="t", policy="passthrough", model="other") == 1


async def test_a_run_id_too_long_for_an_exemplar_is_counted_without_one(make_gateway: MakeGateway,
                                                                        fixed_upstream: FixedUpstream) -> None:
    completing_upstream(fixed_upstream)
    gw = await make_gateway(**fixed_config(fixed_upstream))
    longest = "r" * 128  # the longest run id the gateway accepts
    status, _, _ = await gw.chat({"model": "m", "messages": [PLAN_USER]}, run_id=longest)
    assert status == 200
    _, text = await scrape(gw, PROMETHEUS_ACCEPT)
    assert exemplar_runs(text) == {}
    assert longest not in text
    assert value(text.replace("# EOF\n", ""), "gateway_turns_total", team="t", policy="passthrough", model="other") == 1

    fits = "f" * MAX_EXEMPLAR_RUN_ID  # 122: with the label name, exactly OpenMetrics' 128 characters
    status, _, _ = await gw.chat({"model": "m", "messages": [PLAN_USER]}, run_id=fits)
    assert status == 200
    _, text = await scrape(gw, PROMETHEUS_ACCEPT)
    assert exemplar_runs(text)["gateway_turns_total"] == {fits}
    assert value(text.replace("# EOF\n", ""), "gateway_turns_total", team="t", policy="passthrough", model="other") == 2


async def test_streams_put_the_run_id_on_time_to_first_token(gw: Gateway) -> None:
    async with gw.client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-test", "X-Run-Id": "ex-s"},
                              json={"model": "scripted-plan", "messages": [PLAN_USER], "stream": True}) as resp:
        assert resp.status == 200
        await resp.read()
    _, text = await scrape(gw, PROMETHEUS_ACCEPT)
    runs = exemplar_runs(text)
    assert runs["gateway_ttft_seconds_bucket"] == {"ex-s"}
    assert runs["gateway_upstream_duration_seconds_bucket"] == {"ex-s"}


async def test_the_scripted_mount_is_an_upstream_not_gateway_traffic(gw: Gateway) -> None:
    status, _, _ = await gw.chat({"model": "scripted-plan", "messages": [PLAN_USER]})
    assert status == 200
    async with gw.client.get("/scripted/v1/models", headers={"Authorization": "Bearer sk-test"}) as resp:  # direct
        assert resp.status == 200
    async with gw.client.get("/scripted/v1/no-such-route", headers={"Authorization": "Bearer sk-test"}) as resp:
        assert resp.status == 404
    text = await gw.metrics()
    routes = {dict(labels)["route"] for (name, labels) in samples(text) if name == "gateway_requests_total"}
    assert routes == {"/v1/chat/completions"}, routes  # this scrape is counted after it is answered
    assert value(text, "gateway_requests_total", route="/v1/chat/completions", code="200") == 1
    # the gateway's call to the mount is measured as what it is: an upstream call
    assert value(text, "gateway_upstream_duration_seconds_count", upstream="scripted", model="scripted-plan") == 1
    assert "/scripted" not in text


async def test_exemplars_follow_the_served_run_into_the_tasks_it_starts() -> None:
    metrics = Metrics(["m"])
    served: list[str | None] = ["run-a"]
    metrics.on_turn("t", "p", "m", Usage(1, 1), 0.1)  # outside any request: no exemplar
    assert exemplar_runs(metrics.exposition(PROMETHEUS_ACCEPT)[0].decode()) == {}

    scope = exemplar_run(lambda: served[0])
    try:
        # a task started while serving (the run driver's); it runs after the scope ended
        started = asyncio.ensure_future(_record_stop(metrics))
    finally:
        end_exemplar_run(scope)
    metrics.on_tool("p", "read_file", "ok", 0.01)  # after the request: no exemplar
    served[0] = "run-b"  # the source is asked at record time: a run keyed later is the one seen
    await started  # a task started while serving still belongs to the run being served
    runs = exemplar_runs(metrics.exposition(PROMETHEUS_ACCEPT)[0].decode())
    assert runs["gateway_runs_stopped_total"] == {"run-b"}
    assert runs["gateway_turns_per_run_bucket"] == {"run-b"}
    assert "gateway_tool_calls_total" not in runs and "gateway_turns_total" not in runs

    served[0] = None  # a request with no run yet: nothing to link
    scope = exemplar_run(lambda: served[0])
    try:
        metrics.on_upstream("u", "m", 0.2)
    finally:
        end_exemplar_run(scope)
    assert "gateway_upstream_duration_seconds_bucket" not in exemplar_runs(
        metrics.exposition(PROMETHEUS_ACCEPT)[0].decode())


async def _record_stop(metrics: Metrics) -> None:
    metrics.on_run_stopped("t", "p", "completed", "completed", 2, 0.01)


def test_the_stops_exported_at_zero_are_the_reasons_table_of_docs_runs() -> None:
    """`RUN_STOPS` (the runs_stopped label sets exported at 0 from the start) is docs/runs.md's
    Reasons table, pair for pair; a pass-through policy's are the ones its mode can reach."""
    table = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text().split("## Reasons", 1)[1]
    rows = {(status, reason) for reason, status in
            re.findall(r"^\| `([a-z_]+)` \| `([a-z_]+)` \|", table.split("\n## ", 1)[0], flags=re.M)}
    assert set(RUN_STOPS) == rows and len(RUN_STOPS) == len(rows)
    assert set(PASS_THROUGH_STOPS) < set(RUN_STOPS)


def test_limit_requests_and_their_stop_are_exported_at_zero_only_for_policies_that_ask() -> None:
    metrics = Metrics(["m"])
    metrics.start_at_zero({"t": [KnownPolicy("asks", ("list_files",), ("max_turns", "max_budget_usd")),
                                 KnownPolicy("pt_asks", (), ("max_turns",)), KnownPolicy("plain", ("list_files",))]})
    found = samples(metrics.exposition(PROMETHEUS_ACCEPT)[0].decode())
    limits = {(dict(labels)["policy"], dict(labels)["limit"], dict(labels)["outcome"]): v
              for (name, labels), v in found.items() if name == "gateway_limit_requests_total"}
    assert limits == {(p, limit, o): 0.0 for p, limit in (("asks", "max_turns"), ("asks", "max_budget_usd"),
                                                          ("pt_asks", "max_turns")) for o in LIMIT_OUTCOMES}
    stops = {dict(labels)["policy"] for (name, labels), v in found.items() if name == "gateway_runs_stopped_total"
             and dict(labels)["reason"] == "limit"}
    assert stops == {"asks", "pt_asks"}  # a pass-through policy that asks can pause too; one that does not, never
