"""Metrics of two replicas on one store, as Prometheus and the dashboards see them.

Two real gateway processes on one real redis-server (tests/server/test_replicas.py's
pair), both scraped by one real Prometheus (the shipped scrape config, two targets):

- `gateway_approvals_pending` is the truth on every replica: a call paused on B shows on
  A too, and once it is decided (on A) and the run finished, neither reports it any more
  (before: each replica kept what it had seen itself, so B reported 1 for ever and A 0);
- every shipped dashboard panel that reads a store-wide gauge (the team ledger, the
  approvals, the outbox: each replica reports the same figure) shows one copy of it, not
  one per replica: the panel's result equals the same expression over the gauge
  de-duplicated across instances, and the spend panel equals the ledger.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.store.periods import period_key
from tests.metrics.dashboards import load_dashboards, metric_names, panel_queries, substitute, variables
from tests.metrics.prom import JOB, Prometheus, start_prometheus
from tests.server.served import OPS, chat_body, poll, request
from tests.server.test_replicas import Pair, start_pair
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.procs import ROOT

STORE_WIDE = frozenset({"gateway_team_spend_usd", "gateway_team_budget_remaining_usd", "gateway_approvals_pending",
                        "gateway_webhook_outbox_depth"})
"""Gauges every replica reads from the shared store (docs/metrics.md, Scope)."""
SELECTOR = re.compile(r"\b(gateway_[a-z0-9_]+)\b(\{[^}]*\})?")


@dataclass
class Stack:
    pair: Pair
    prom: Prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:  # noqa: F811
    supervised = yaml.safe_load((ROOT / "policies" / "supervised.yaml").read_text())  # asks for more of its limits
    pair = start_pair(tmp_path_factory.mktemp("metrics-replicas"), redis_url, {"supervised": supervised})
    try:
        targets = [url.removeprefix("http://") for url in (pair.a.url, pair.b.url)]
        prom = start_prometheus(targets, tmp_path_factory.mktemp("prom-replicas"))
    except BaseException:
        pair.a.stop()
        pair.b.stop()
        raise
    try:
        yield Stack(pair, prom)
    finally:
        prom.stop()
        pair.a.stop()
        pair.b.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def gauge(session: aiohttp.ClientSession, url: str, name: str, team: str) -> float | None:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf'^{name}{{team="{team}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


async def pending_on_both(session: aiohttp.ClientSession, pair: Pair, expected: float) -> None:
    async def both() -> bool:
        seen = [await gauge(session, url, "gateway_approvals_pending", "demo") for url in (pair.a.url, pair.b.url)]
        return seen == [expected, expected]

    try:
        await poll(both, timeout=10)
    except TimeoutError:
        seen = [await gauge(session, url, "gateway_approvals_pending", "demo") for url in (pair.a.url, pair.b.url)]
        raise AssertionError(f"gateway_approvals_pending{{team=demo}} on A, B: {seen}, expected {expected} on both")


async def pause(session: aiohttp.ClientSession, url: str) -> str:
    status, headers, body = await request(session, "POST", f"{url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"),
                                          headers={"X-Policy": "files", "X-Run-Id": f"m-{uuid.uuid4().hex[:8]}"})
    assert status == 200 and body["run"]["interruption"]["waiting_for"] == "decision", body
    return str(headers["X-Run-Id"])


async def test_every_replica_reports_the_approvals_pending_in_the_store(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    pair = stack.pair
    run_id = await pause(session, pair.b.url)
    await pending_on_both(session, pair, 1.0)  # before: A, which saw nothing of it, said 0
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve"})
    assert status == 200, body
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200 and body["run"]["status"] == "completed", body
    await pending_on_both(session, pair, 0.0)  # before: B, where it paused, said 1 for ever


def wait_both_scraped(prom: Prometheus, after: float) -> float:
    """Until Prometheus holds a successful scrape of each replica that started after `after`:
    a time at which both are the latest (queries are made at it, since a later scrape that
    failed on a loaded machine would mark its replica's series stale)."""
    def probe() -> float | None:
        result = prom.query(f'timestamp(up{{job="{JOB}"}})')
        if len(result) != 2 or any(float(r["value"][1]) <= after for r in result):
            return None
        at = max(float(r["value"][1]) for r in result)
        up = [float(r["value"][1]) for r in prom.query(f'up{{job="{JOB}"}}', at)]
        return at if up == [1.0, 1.0] else None
    return prom.wait_for("a successful scrape of both replicas", probe, timeout=60)


def one_copy(expr: str) -> str:
    """`expr` over the store-wide gauges with their replicas' copies merged into one."""
    def merged(match: re.Match[str]) -> str:
        name, matchers = match.group(1), match.group(2) or ""
        return f"(max without (instance) ({name}{matchers}))" if name in STORE_WIDE else match.group(0)
    return SELECTOR.sub(merged, expr)


def by_labels(result: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], list[float]]:
    out: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for series in result:
        key = tuple(sorted((k, v) for k, v in series["metric"].items() if k not in ("instance", "job")))
        out.setdefault(key, []).append(float(series["value"][1]))
    return out


async def test_dashboards_show_one_copy_of_each_store_wide_gauge(stack: Stack, session: aiohttp.ClientSession) -> None:
    pair, prom = stack.pair, stack.prom
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan"), headers={"X-Policy": "passthrough"})
    assert status == 200, body
    await pause(session, pair.b.url)  # one call waits: a figure a sum over replicas would double

    store = pair.store()
    try:
        spent, _ = await store.team_spend("demo", period_key("month", datetime.now(UTC)))  # demo's default period
    finally:
        await store.close()
    assert spent > 0
    settled = time.time()
    at = wait_both_scraped(prom, settled)

    panels = [q for q in panel_queries() if metric_names(q.expr) and metric_names(q.expr) <= STORE_WIDE]
    assert {q.panel for q in panels} >= {"Team spend vs remaining budget", "Team budget used", "Approvals pending"}
    for q in panels:
        shown = by_labels(prom.query(q.expr, at))
        truth = by_labels(prom.query(one_copy(q.expr), at))
        doubled = {k: v for k, v in shown.items() if len(v) > 1}
        assert not doubled, f"{q.name}: one series per replica: {doubled}\n{q.expr}"
        assert shown == truth, f"{q.name} shows {shown}, one copy of each gauge gives {truth}\n{q.expr}"

    [spend] = [q for q in panels if q.panel == "Team spend vs remaining budget" and "spend" in q.expr]
    [demo] = [v for k, v in by_labels(prom.query(spend.expr, at)).items() if ("team", "demo") in k]
    assert demo == [pytest.approx(spent)]
    [approvals] = [q for q in panels if q.panel == "Approvals pending"]
    assert [v for k, v in by_labels(prom.query(approvals.expr, at)).items() if ("team", "demo") in k] == [[1.0]]


QUIET_TEAM = {"team": "thrifty", "policy": "passthrough"}
"""A team (with its one policy) no test of this module sends traffic for."""
QUIET_POLICY = {"policy": "files_auto"}
"""A server-side policy no test of this module runs (for panels filtered by policy only)."""
QUIET_ASKING = {"policy": "supervised"}
"""A policy whose limits ask a person (`on_exceed: ask`) that no test of this module runs."""
LIMIT_PANEL = "Limit requests by limit and outcome (per minute)"
COUNTER_PANELS = ("Stop reasons", "Stop reasons over time (runs per minute)", "Cost by team and model (USD per hour)",
                  "Tokens by team, model and kind (per second)", "Turns by team, policy and model (per minute)",
                  "Tool calls by outcome (per minute)", "Tool calls in range by outcome", LIMIT_PANEL)


def test_counter_panels_read_zero_before_any_traffic_of_theirs(stack: Stack) -> None:
    """The counters' label sets the config knows are exported at 0 from the start, so a
    panel of a quiet team or policy reads 0, not "No data" (before: absent until first
    observed)."""
    quiet = [q for q in panel_queries() if q.panel in COUNTER_PANELS]
    assert {q.panel for q in quiet} == set(COUNTER_PANELS)
    dashboards = load_dashboards()
    for q in quiet:
        [values] = [variables(d) for d in dashboards.values() if d["title"] == q.dashboard]
        quiet_ones = QUIET_TEAM if "$team" in q.raw else QUIET_ASKING if q.panel == LIMIT_PANEL else QUIET_POLICY
        expr = substitute(q.raw, {**values, **quiet_ones})

        def zeros(expr: str = expr) -> list[float] | None:
            found = [float(series["value"][1]) for series in stack.prom.query(expr)]
            return found or None

        try:
            found = stack.prom.wait_for(f"{q.name} has data", zeros, timeout=30)
        except TimeoutError:
            raise AssertionError(f"{q.name}: no data for {quiet_ones}\n{expr}") from None
        assert set(found) == {0.0}, (q.name, found)
