"""The shipped Grafana dashboards, read as Grafana reads them, and their PromQL made concrete.

`panel_queries()` yields every query of every panel with Grafana's template variables
substituted the way Grafana would before sending it to Prometheus, so the tests evaluate
the exact expressions the dashboards run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.procs import ROOT

DASHBOARDS_DIR = ROOT / "grafana" / "dashboards"

# The first metrics docs/metrics.md lists, plus the histograms and counters added since.
DESIGN_METRICS: dict[str, str] = {
    "gateway_requests_total": "counter",
    "gateway_turns_total": "counter",
    "gateway_tokens_total": "counter",
    "gateway_cost_usd_total": "counter",
    "gateway_runs_stopped_total": "counter",
    "gateway_tool_calls_total": "counter",
    "gateway_tool_duration_seconds": "histogram",
    "gateway_upstream_duration_seconds": "histogram",
    "gateway_overhead_seconds": "histogram",
    "gateway_team_spend_usd": "gauge",
    "gateway_team_budget_remaining_usd": "gauge",
    "gateway_approvals_pending": "gauge",
    "gateway_runs_active": "gauge",
}
EXTRA_HISTOGRAMS = ("gateway_ttft_seconds", "gateway_turns_per_run", "gateway_cost_per_run_usd", "gateway_store_seconds")
EXTRA_COUNTERS = ("gateway_usage_clamped_total", "gateway_webhook_deliveries_total", "gateway_upstream_attempts_total",
                  "gateway_tool_call_repairs_total", "gateway_limit_requests_total")
PER_WORKER_GAUGES = frozenset({"gateway_event_loop_lag_seconds"})
"""Gauges a `--workers` gateway exports once per live worker, labelled with its `pid`
(docs/metrics.md)."""
EXTRA_GAUGES = ("gateway_webhook_outbox_depth", "gateway_event_loop_lag_seconds", "gateway_upstream_connections")
KNOWN_METRICS: frozenset[str] = (frozenset(DESIGN_METRICS) | frozenset(EXTRA_HISTOGRAMS) | frozenset(EXTRA_COUNTERS)
                                 | frozenset(EXTRA_GAUGES))
# The labels of each metric (histograms' `le` aside): DESIGN's for its metrics.
METRIC_LABELS: dict[str, frozenset[str]] = {name: frozenset(labels) for name, labels in {
    "gateway_requests_total": ("route", "code"),
    "gateway_turns_total": ("team", "policy", "model"),
    "gateway_tokens_total": ("team", "model", "kind"),
    "gateway_cost_usd_total": ("team", "model"),
    "gateway_runs_stopped_total": ("team", "policy", "status", "reason"),
    "gateway_tool_calls_total": ("policy", "tool", "outcome"),
    "gateway_tool_duration_seconds": ("tool",),
    "gateway_upstream_duration_seconds": ("upstream", "model"),
    "gateway_overhead_seconds": (),
    "gateway_team_spend_usd": ("team",),
    "gateway_team_budget_remaining_usd": ("team",),
    "gateway_approvals_pending": ("team",),
    "gateway_runs_active": (),
    "gateway_ttft_seconds": ("upstream", "model"),
    "gateway_turns_per_run": ("team", "policy"),
    "gateway_cost_per_run_usd": ("team", "policy"),
    "gateway_usage_clamped_total": ("upstream", "kind"),
    "gateway_upstream_attempts_total": ("upstream", "outcome"),
    "gateway_tool_call_repairs_total": ("upstream", "kind"),
    "gateway_webhook_deliveries_total": ("webhook", "event", "outcome"),
    "gateway_webhook_outbox_depth": (),
    "gateway_store_seconds": ("op",),
    "gateway_event_loop_lag_seconds": (),
    "gateway_upstream_connections": ("state",),
    "gateway_tool_threads": (),
    "gateway_tool_threads_busy": (),
    "gateway_tool_calls_waiting": (),
    "gateway_connections": (),
    "gateway_connections_refused_total": (),
    "gateway_request_timeouts_total": ("kind",),
    "gateway_ready": ("check",),
    "gateway_spool_records": (),
    "gateway_work_waits_total": ("team",),
    "gateway_limit_requests_total": ("policy", "limit", "outcome"),
}.items()}
STANDARD_PREFIXES = ("process_", "python_")
"""The standard collectors' families (prometheus-client's own names; with `--workers`, labelled by pid)."""

# Grafana's built-in interval variables, as the test evaluates them: windows wide enough to
# hold the whole test's traffic (Grafana would derive them from the time range and scrape
# interval; their value changes how much is averaged, not whether a query has data).
BUILTINS: dict[str, str] = {"__rate_interval": "2m", "__interval": "15s", "__range": "10m"}

VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
METRIC_NAME = re.compile(r"\bgateway_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(gateway_[a-z0-9_]+)\b(\{[^}]*\})?")


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel, with its template variables substituted."""

    dashboard: str
    panel: str
    panel_type: str
    ref_id: str
    raw: str
    expr: str
    instant: bool

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON file, by file name."""
    files = sorted(DASHBOARDS_DIR.glob("*.json"))
    if not files:
        raise AssertionError(f"no dashboards in {DASHBOARDS_DIR}")
    return {path.name: json.loads(path.read_text()) for path in files}


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every non-row panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def variables(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Template variables as Grafana expands them with "All" selected, plus the built-ins."""
    values = dict(BUILTINS)
    for var in dashboard.get("templating", {}).get("list", []):
        name = var["name"]
        if var["type"] == "datasource":
            values[name] = "prometheus"
        elif var.get("includeAll"):
            if "allValue" not in var or not var["allValue"]:
                raise AssertionError(f"variable {name!r} includes All but has no allValue (Grafana would list values)")
            values[name] = var["allValue"]
        else:
            raise AssertionError(f"variable {name!r} has no All value to evaluate the dashboards with")
    return values


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace $var, ${var}, ${var:format} and [[var]] like Grafana; unknown variables fail."""
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise AssertionError(f"undefined template variable ${name} in {expr!r}")
        return values[name]
    return VARIABLE.sub(repl, expr)


def panel_queries() -> list[PanelQuery]:
    """Every Prometheus query of every panel of every dashboard, substituted."""
    out: list[PanelQuery] = []
    for file_name, dashboard in load_dashboards().items():
        values = variables(dashboard)
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                raw = target["expr"]
                out.append(PanelQuery(
                    dashboard=dashboard.get("title", file_name), panel=panel["title"], panel_type=panel["type"],
                    ref_id=target["refId"], raw=raw, expr=substitute(raw, values),
                    instant=bool(target.get("instant")) and not target.get("range", False)))
    return out


def metric_names(expr: str) -> set[str]:
    """The gateway metric families an expression reads (histogram suffixes stripped)."""
    return {family(name) for name in METRIC_NAME.findall(expr)}


def family(name: str) -> str:
    """The metric family of a sample name (histogram suffixes stripped)."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in KNOWN_METRICS:
            return name[: -len(suffix)]
    return name


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric family, its `{...}` matchers or "") for every gateway metric an expression reads."""
    return [(family(name), matchers or "") for name, matchers in SELECTOR.findall(expr)]


def metric_of_sample(sample_name: str) -> str:
    """The metric (as METRIC_LABELS names it) a sample of the exposition belongs to:
    `x_bucket`, `x_count`, `x_sum` and `x_created` (counters: `x_created` of `x_total`)."""
    base = sample_name.removesuffix("_created")
    for candidate in (base, base + "_total", family(base)):
        if candidate in METRIC_LABELS:
            return candidate
    raise AssertionError(f"sample {sample_name} belongs to no known metric (tests/metrics/dashboards.py)")
