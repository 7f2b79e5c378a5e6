"""The metrics proof: a real Prometheus scraping a real gateway.

Two identical rounds of traffic each take every exit a run can take (completed,
max_turns, max_budget, team_budget, approval, cancelled, permanent_error, repeated_call,
upstream_error). Prometheus scrapes between and after them (waited for through its API,
never slept for), so every counter and histogram has grown between two scrapes and every
rate and quantile is defined. Then every PromQL expression of every dashboard panel is
evaluated through Prometheus's HTTP API, exactly as written with the template variables
substituted, and must return data. Prometheus runs with exemplar storage and scrapes
OpenMetrics, so its exemplar API must link each run metric to a run in the store.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.metrics.dashboards import (
    DESIGN_METRICS,
    EXTRA_HISTOGRAMS,
    METRIC_LABELS,
    PER_WORKER_GAUGES,
    load_dashboards,
    STANDARD_PREFIXES,
    metric_of_sample,
    panel_queries,
)
from tests.metrics.exposition import Exposition, scrape
from tests.metrics.prom import JOB, Prometheus, start_prometheus
from tests.metrics.traffic import GATEWAY_ENV, Client, Exits, drive_every_exit, write_gateway_config
from tests.support.procs import TEST_WORKERS, Proc, free_port, run_gateway, start_gateway

pytestmark = pytest.mark.timeout(240)

STOP_REASONS = {
    ("completed", "completed"), ("max_turns_exceeded", "max_turns"), ("budget_exceeded", "max_budget"),
    ("budget_exceeded", "team_budget"), ("interrupted", "approval"), ("interrupted", "limit"), ("interrupted", "cancelled"),
    ("failed", "permanent_error"), ("failed", "repeated_call"), ("failed", "upstream_error"),
}


@dataclass
class Stack:
    gateway: Proc
    prom: Prometheus
    config: Path
    demo: Client
    ops: Client
    tight: Client


@dataclass
class Traffic:
    rounds: list[Exits]
    start: float
    end: float
    exposition: Exposition
    scraped_at: float
    """When Prometheus took the scrape that held all the traffic: the tests query at that
    time, since a later scrape that failed (a loaded machine) would mark every series stale."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("proof")
    config = write_gateway_config(tmp)
    port = free_port()
    gateway = start_gateway(["serve", "--config", str(config), "--port", str(port)], "/healthz", port,
                            tmp / "gateway.log", env=GATEWAY_ENV)
    try:
        # Started right away: its first scrape comes ~5 s later (target discovery is batched).
        prom = start_prometheus(f"127.0.0.1:{port}", tmp / "prometheus")
    except BaseException:
        gateway.stop()
        raise
    try:
        yield Stack(gateway, prom, config, Client(gateway.url, "sk-demo"), Client(gateway.url, "sk-ops"),
                    Client(gateway.url, "sk-tight"))
    finally:
        prom.stop()
        gateway.stop()


def wait_scraped(stack: Stack, after: float) -> tuple[Exposition, float]:
    """Wait for a scrape that started after `after` and saw what /metrics shows now: what
    /metrics showed, and when Prometheus took that scrape."""
    def probe() -> tuple[Exposition, float] | None:
        at = stack.prom.wait_scrape_after(after)
        exposition = scrape(stack.gateway.url)
        for name in ("gateway_runs_stopped_total", "gateway_cost_usd_total", "gateway_turns_total"):
            seen = stack.prom.scalar(f'sum({name}{{job="{JOB}"}})', at)
            if seen is None or not math.isclose(seen, exposition.total(name), rel_tol=0, abs_tol=1e-12):
                return None
        return exposition, at
    return stack.prom.wait_for("a scrape holding all the traffic", probe, timeout=60)


@pytest.fixture(scope="module")
def traffic(stack: Stack) -> Traffic:
    start = time.time()
    rounds = [drive_every_exit(stack.demo, stack.ops, stack.tight)]
    wait_scraped(stack, time.time())
    rounds.append(drive_every_exit(stack.demo, stack.ops, stack.tight))
    end = time.time()
    exposition, scraped_at = wait_scraped(stack, end)
    return Traffic(rounds, start, end, exposition, scraped_at)


def has_data(result: list[dict[str, Any]]) -> bool:
    """At least one series with at least one finite sample (a NaN quantile is not data)."""
    for series in result:
        samples = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(math.isfinite(float(value)) for _, value in samples):
            return True
    return False


def test_every_dashboard_panel_query_returns_data(stack: Stack, traffic: Traffic) -> None:
    now = traffic.scraped_at
    empty = []
    queries = panel_queries()
    for q in queries:
        if q.instant:
            result = stack.prom.query(q.expr, at=now)
        else:
            # Grafana's grid ends at "now"; this one at the scrape that held all the traffic
            # (start a whole number of steps back)
            result = stack.prom.query_range(q.expr, now - math.ceil(now - traffic.start + 2), now, "1s")
        if not has_data(result):
            empty.append(f"{q.name}: {q.expr}")
    assert not empty, f"{len(empty)} of {len(queries)} panel queries returned no data:\n" + "\n".join(empty)


def test_dashboard_variables_list_the_teams_and_policies(stack: Stack, traffic: Traffic) -> None:
    for dashboard in load_dashboards().values():
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"]).groups()  # type: ignore[union-attr]
            values = set(stack.prom.label_values(label, metric))
            expected = {"team": {"demo", "tight"}, "policy": {"files", "capped", "tiny", "passcap", "passthrough"}}
            assert expected[label] <= values, (var["name"], values)


def test_every_design_metric_is_exported_with_its_type(stack: Stack, traffic: Traffic) -> None:
    types = traffic.exposition.types
    for name, kind in DESIGN_METRICS.items():
        assert types.get(name) == kind, f"{name}: exported as {types.get(name)}, DESIGN says {kind}"
    for name in EXTRA_HISTOGRAMS:
        assert types.get(name) == "histogram", name
    # with the labels DESIGN (and grafana/README.md) give them, no more, no fewer
    for sample_name, labels in traffic.exposition.series:
        if sample_name.startswith(STANDARD_PREFIXES):  # prometheus-client's own (tests/server/test_process_metrics)
            continue
        name = metric_of_sample(sample_name)
        names = {label for label, _ in labels} - {"le"}
        expected = METRIC_LABELS[name] | ({"pid"} if os.environ.get(TEST_WORKERS) and name in PER_WORKER_GAUGES else set())
        assert names == expected, (sample_name, sorted(names), sorted(expected))
    # and Prometheus holds samples of each
    for name, kind in {**DESIGN_METRICS, **{n: "histogram" for n in EXTRA_HISTOGRAMS}}.items():
        series = name + "_count" if kind == "histogram" else name
        assert stack.prom.query(f'count({series}{{job="{JOB}"}})', traffic.scraped_at), f"Prometheus has no {series}"


def test_every_stop_reason_is_counted_once_per_round(stack: Stack, traffic: Traffic) -> None:
    result = stack.prom.query(f'sum by (status, reason) (gateway_runs_stopped_total{{job="{JOB}"}})', traffic.scraped_at)
    counted = {(r["metric"]["status"], r["metric"]["reason"]): float(r["value"][1]) for r in result}
    missing = STOP_REASONS - set(counted)
    assert not missing, f"stop reasons never counted: {sorted(missing)}; counted: {counted}"
    for pair in STOP_REASONS:
        assert counted[pair] >= len(traffic.rounds), (pair, counted[pair])


def test_gauges_after_the_traffic(stack: Stack, traffic: Traffic) -> None:
    # one destructive run and one limit request per round are left waiting for a person
    at = traffic.scraped_at
    assert stack.prom.scalar(f'sum(gateway_approvals_pending{{job="{JOB}", team="demo"}})', at) == 2 * len(traffic.rounds)
    # nothing is running any more
    assert stack.prom.scalar(f'sum(gateway_runs_active{{job="{JOB}"}})', at) == 0
    # the tight team has spent nothing and has no budget left for a call's reservation
    remaining = stack.prom.scalar(f'gateway_team_budget_remaining_usd{{job="{JOB}", team="tight"}}', at)
    assert remaining is not None and remaining <= 0.0001


def runs_of(client: Client) -> list[dict[str, Any]]:
    reply = client.request("GET", "/v1/runs?limit=1000")
    assert reply.status == 200, (reply.status, reply.text)
    body = reply.body
    runs: list[dict[str, Any]] = body["data"] if isinstance(body, dict) else body
    return runs


def test_cost_counter_equals_the_runs_cost_in_the_store(stack: Stack, traffic: Traffic) -> None:
    runs = {run["id"]: run for client in (stack.demo, stack.ops, stack.tight) for run in runs_of(client)}
    made = {run_id for exits in traffic.rounds for run_id in exits.runs.values() if run_id}
    assert made <= set(runs), f"runs made by the traffic but not listed: {sorted(made - set(runs))}"
    store_total = sum(float(run["cost_usd"]) for run in runs.values())
    counter = stack.prom.scalar(f'sum(gateway_cost_usd_total{{job="{JOB}"}})', traffic.scraped_at)
    assert counter is not None and store_total > 0.01
    assert round(counter, 2) == round(store_total, 2)  # issue 5: to the cent
    assert counter == pytest.approx(store_total, abs=1e-6)  # in fact to the micro-dollar
    assert counter == pytest.approx(traffic.exposition.total("gateway_cost_usd_total"), abs=1e-12)
    # the team's spend gauge is the same money, seen from the ledger
    demo_total = sum(float(run["cost_usd"]) for run in runs.values() if run.get("team", "demo") == "demo")
    spend = stack.prom.scalar(f'gateway_team_spend_usd{{job="{JOB}", team="demo"}}', traffic.scraped_at)
    assert spend == pytest.approx(demo_total, abs=1e-6)


def test_no_label_carries_a_run_id_or_a_raw_path(stack: Stack, traffic: Traffic) -> None:
    run_ids = {run_id for exits in traffic.rounds for run_id in exits.runs.values() if run_id}
    for run_id in run_ids:
        assert run_id not in traffic.exposition.text.split("# {")[0]
    for (name, labels) in traffic.exposition.series:
        for label, value in labels:
            assert not re.search(r"run_[0-9a-f]{8}", value), (name, label, value)  # a generated run id
            if label == "route":
                assert "/runs/run_" not in value and not re.search(r"/[0-9a-f]{12,}", value), value


# Every family recorded per run, and the labels its series share with the run they link to.
EXEMPLAR_FAMILIES: dict[str, tuple[str, ...]] = {
    "gateway_upstream_duration_seconds_bucket": (),
    "gateway_ttft_seconds_bucket": (),
    "gateway_turns_total": ("team", "policy"),
    "gateway_tokens_total": ("team",),
    "gateway_cost_usd_total": ("team",),
    "gateway_runs_stopped_total": ("team", "policy"),
    "gateway_tool_calls_total": ("policy",),
    "gateway_tool_duration_seconds_bucket": (),
    "gateway_turns_per_run_bucket": ("team", "policy"),
    "gateway_cost_per_run_usd_bucket": ("team", "policy"),
}


def test_exemplars_link_every_run_metric_to_its_run_in_the_store(stack: Stack, traffic: Traffic) -> None:
    """Prometheus scraped OpenMetrics and kept exemplars: each carries the id of a run that
    is in the store, of the team and policy its series is labelled with."""
    if os.environ.get(TEST_WORKERS):  # prometheus-client's multiprocess mode keeps none
        pytest.skip("a gateway with --workers has no exemplars (docs/metrics.md#scope)")
    clients = {"demo": stack.demo, "ops": stack.ops, "tight": stack.tight}
    runs = {run["id"]: run for client in clients.values() for run in runs_of(client)}
    linked_all: set[str] = set()
    for family, shared in EXEMPLAR_FAMILIES.items():
        groups = stack.prom.exemplars(f'{family}{{job="{JOB}"}}', traffic.start - 1, time.time())
        assert groups, f"Prometheus kept no exemplar of {family}"
        for group in groups:
            series = group["seriesLabels"]
            for exemplar in group["exemplars"]:
                run_id = exemplar["labels"].get("run_id")
                assert run_id in runs, f"{family}{series}: exemplar {exemplar['labels']} names no run in the store"
                for label in shared:
                    assert runs[run_id][label] == series[label], (family, series, run_id, runs[run_id][label])
                linked_all.add(run_id)
    # every stop reason links to a run whose trace says it stopped for that reason
    linked_reasons = set()
    for group in stack.prom.exemplars(f'gateway_runs_stopped_total{{job="{JOB}"}}', traffic.start - 1, time.time()):
        series = group["seriesLabels"]
        for exemplar in group["exemplars"]:
            run_id = exemplar["labels"]["run_id"]
            stops = {(e.get("status"), e.get("reason")) for e in clients[runs[run_id]["team"]].events(run_id)
                     if e.get("type") == "run_stopped"}
            assert (series["status"], series["reason"]) in stops, (series, run_id, stops)
            linked_reasons.add((series["status"], series["reason"]))
    assert STOP_REASONS <= linked_reasons, sorted(STOP_REASONS - linked_reasons)
    made = {run_id for exits in traffic.rounds for run_id in exits.runs.values() if run_id}
    assert len(linked_all & made) >= len(STOP_REASONS), sorted(linked_all)


def test_promtool_lints_the_real_exposition(traffic: Traffic) -> None:
    done = subprocess.run(["promtool", "check", "metrics"], input=traffic.exposition.text,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_trace_command_prints_a_real_run(stack: Stack, traffic: Traffic) -> None:
    run_id = traffic.rounds[0].runs["completed"]
    done = run_gateway(["trace", run_id, "--config", str(stack.config)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "sqlite store" in lines[0]
    assert [re.search(r"turn \d+: in (\d+)", line).group(1) for line in lines if " turn " in line] == [  # type: ignore[union-attr]
        "204", "269", "342"]  # the chapter's per-turn prompt tokens
    assert sum(1 for line in lines if "  tool list_files() -> ok in" in line or "  tool read_file(" in line) == 2
    assert "stopped: completed (completed), turns 3, cost $0.002470" in done.stdout
    assert lines[-1].startswith("total: 3 turns, 2 tool runs (0 failed), tokens in 815 out 70, cost $0.002470")
    # every line of the trace also went to the trace file
    trace_file = stack.config.parent / "trace.jsonl"
    assert f'"runId":"demo/{run_id}"' in trace_file.read_text()  # stored ids name the team
