"""The shipped Grafana/Prometheus files, checked without a gateway.

The dashboards' queries must parse in a real Prometheus, read only metrics the gateway
exports, and cover what issue 5 asks to see; promtool must accept the scrape config; the
compose file and provisioning must point at files that exist.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.metrics.dashboards import (
    DESIGN_METRICS,
    EXTRA_COUNTERS,
    EXTRA_GAUGES,
    EXTRA_HISTOGRAMS,
    KNOWN_METRICS,
    METRIC_LABELS,
    load_dashboards,
    metric_names,
    panel_queries,
    panels,
    selectors,
    substitute,
    variables,
)
from tests.metrics.prom import SHIPPED_CONFIG, Prometheus, binary, scrape_config, start_prometheus
from tests.support.procs import ROOT, free_port

GRAFANA = ROOT / "grafana"


@pytest.fixture(scope="module")
def idle_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A Prometheus whose only target answers nothing: enough to parse and evaluate PromQL."""
    prom = start_prometheus(f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("prom-idle"))
    yield prom
    prom.stop()


def test_every_panel_query_parses_in_prometheus(idle_prometheus: Prometheus) -> None:
    queries = panel_queries()
    assert len(queries) >= 20
    for q in queries:
        # Raises PromError (bad_data) on a syntax error; empty results are fine here.
        idle_prometheus.query(q.expr)


def test_every_variable_query_parses(idle_prometheus: Prometheus) -> None:
    for dashboard in load_dashboards().values():
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert match, f"{var['name']}: unexpected variable query {var['definition']!r}"
            assert match.group(1) in KNOWN_METRICS
            idle_prometheus.label_values(match.group(2), match.group(1))


def test_panels_read_only_metrics_the_gateway_exports() -> None:
    for q in panel_queries():
        names = metric_names(q.expr)
        assert names, f"{q.name} reads no gateway metric: {q.expr}"
        unknown = names - KNOWN_METRICS
        assert not unknown, f"{q.name} reads metrics nobody exports: {sorted(unknown)}"


def test_dashboards_show_every_exported_metric() -> None:
    shown = set().union(*(metric_names(q.expr) for q in panel_queries()))
    assert shown == KNOWN_METRICS, f"not on any dashboard: {sorted(KNOWN_METRICS - shown)}"


def test_dashboards_show_what_issue_5_lists() -> None:
    exprs = [q.expr for q in panel_queries()]

    def some(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in exprs)

    # cost by team and model over time
    assert some(r"sum by \(team, model\) \(rate\(gateway_cost_usd_total")
    # spend vs budget per team
    assert some(r"gateway_team_spend_usd.*gateway_team_budget_remaining_usd")
    # stop reasons
    assert some(r"sum by \(status, reason\) \(increase\(gateway_runs_stopped_total")
    # percentiles: upstream latency, TTFT, gateway overhead, and the per-run distributions
    for metric in ("gateway_upstream_duration_seconds", "gateway_ttft_seconds", "gateway_overhead_seconds",
                   "gateway_turns_per_run", "gateway_cost_per_run_usd"):
        for q in ("0.5", "0.95", "0.99"):
            assert some(rf"histogram_quantile\({q}, sum by \(le[^)]*\) \(rate\({metric}_bucket"), (metric, q)
    # distributions as heatmaps
    heatmaps = [q for q in panel_queries() if q.panel_type == "heatmap"]
    assert {m for q in heatmaps for m in metric_names(q.expr)} == {"gateway_turns_per_run", "gateway_cost_per_run_usd"}
    # tool calls by outcome, approvals pending, request rate and error rate
    assert some(r"sum by \(tool, outcome\) \(rate\(gateway_tool_calls_total")
    assert some(r"gateway_approvals_pending")
    assert some(r"sum by \(route\) \(rate\(gateway_requests_total")
    assert some(r'gateway_requests_total\{code=~"5\.\."\}.*/ sum\(rate\(gateway_requests_total')


def test_panels_filter_by_every_dashboard_variable_their_metric_carries() -> None:
    """On a dashboard with a team (policy) picker, every metric labelled by team (policy) is
    filtered by it, so no panel silently shows all teams."""
    for dashboard in load_dashboards().values():
        pickers = {v["name"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
        for panel in panels(dashboard):
            for target in panel["targets"]:
                for metric, matchers in selectors(target["expr"]):
                    for label in pickers & METRIC_LABELS[metric]:
                        assert f'{label}=~"${label}"' in matchers, \
                            f"{dashboard['title']} / {panel['title']}: {metric} not filtered by ${label}"


def test_per_run_panels_follow_the_team_and_policy_pickers() -> None:
    per_run = [q for q in panel_queries() if metric_names(q.expr) & {"gateway_turns_per_run", "gateway_cost_per_run_usd"}]
    assert len(per_run) == 8  # two heatmaps, two panels of three quantiles
    for q in per_run:
        assert 'team=~"$team"' in q.raw and 'policy=~"$policy"' in q.raw, q.name


def readme_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """The README's metric table: name -> (type, labels)."""
    rows = {}
    for line in (GRAFANA / "README.md").read_text().splitlines():
        match = re.match(r"\|\s*`(gateway_[a-z_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|\s*\S", line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} documented twice"
            rows[name] = (kind, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def test_readme_documents_every_metric_with_its_type_and_labels() -> None:
    documented = readme_metrics()
    assert set(documented) == KNOWN_METRICS, sorted(KNOWN_METRICS ^ set(documented))
    kinds = {**DESIGN_METRICS, **{name: "histogram" for name in EXTRA_HISTOGRAMS},
             **{name: "counter" for name in EXTRA_COUNTERS}, **{name: "gauge" for name in EXTRA_GAUGES}}
    for name, (kind, labels) in documented.items():
        assert kind == kinds[name], (name, kind)
        assert labels == METRIC_LABELS[name], (name, sorted(labels))


def test_dashboard_json_is_well_formed() -> None:
    uids = set()
    for file_name, dashboard in load_dashboards().items():
        assert dashboard["uid"] not in uids, f"{file_name}: duplicate uid"
        uids.add(dashboard["uid"])
        assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
        ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels(dashboard) if p not in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{file_name}: duplicate panel ids"
        occupied: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, f"{file_name}: {panel['title']} off the grid"
            cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
            assert not cells & occupied, f"{file_name}: {panel['title']} overlaps another panel"
            occupied |= cells
        for panel in panels(dashboard):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), f"{file_name}: {panel['title']} refIds"
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"]
        assert variables(dashboard)["datasource"] == "prometheus"


def test_substitution_is_grafanas_and_refuses_unknown_variables() -> None:
    values = {"team": ".*", "__rate_interval": "2m"}
    assert substitute('rate(x{team=~"$team"}[$__rate_interval])', values) == 'rate(x{team=~".*"}[2m])'
    assert substitute('x{team=~"${team}"} x{team=~"${team:regex}"} [[team]]', values) == \
        'x{team=~".*"} x{team=~".*"} .*'
    with pytest.raises(AssertionError, match=r"\$nope"):
        substitute("x{a=~\"$nope\"}", values)


def test_no_run_id_or_raw_path_in_any_query() -> None:
    for q in panel_queries():
        assert "run_id" not in q.expr and "path" not in q.expr, q.name


def test_the_metrics_the_tests_know_are_the_ones_docs_metrics_lists() -> None:
    """The names and labels the tests hold the gateway to are the contract's (docs/metrics.md):
    each metric of its table, with its labels, and no other."""
    rows = re.findall(r"^\| `(gateway_[a-z_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|",
                      (ROOT / "docs" / "metrics.md").read_text(), re.M)
    documented = {name: frozenset(re.findall(r"`([a-z_]+)`", labels)) for name, _, labels in rows}
    # exported only when a policy names MCP servers, so the scraped gateways of these tests lack them
    mcp = {"gateway_mcp_server_up": {"server"}, "gateway_mcp_server_starts_total": {"server"},
           "gateway_mcp_server_failures_total": {"server"}}
    assert set(DESIGN_METRICS) <= set(documented)
    assert set(documented) == set(METRIC_LABELS) | set(mcp), set(documented) ^ (set(METRIC_LABELS) | set(mcp))
    for name, labels in documented.items():
        assert {**METRIC_LABELS, **mcp}[name] == labels, (name, sorted(labels))


def test_promtool_accepts_the_shipped_and_the_test_scrape_configs(tmp_path: Path) -> None:
    derived = tmp_path / "prometheus.yml"
    derived.write_text(yaml.safe_dump(scrape_config("127.0.0.1:8080")))
    for config in (SHIPPED_CONFIG, derived):
        done = subprocess.run([binary("promtool"), "check", "config", str(config)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check above would catch a broken file: promtool does fail on one."""
    broken = tmp_path / "prometheus.yml"
    broken.write_text("scrape_configs:\n  - job_name: gateway\n    scrape_interval: soon\n")
    done = subprocess.run([binary("promtool"), "check", "config", str(broken)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    compose = yaml.safe_load((GRAFANA / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"gateway", "prometheus", "grafana", "tempo"}

    mounts: dict[str, Path] = {}
    for name in ("prometheus", "grafana", "tempo"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                path = (GRAFANA / source).resolve()
                assert path.exists(), f"{name} mounts {source}, which does not exist"
                mounts[target] = path
    assert mounts["/etc/prometheus/prometheus.yml"] == SHIPPED_CONFIG
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]

    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    prom_ds, tempo_ds = datasources
    assert prom_ds["type"] == "prometheus" and prom_ds["isDefault"] is True
    # an exemplar's trace_id opens its trace in the Tempo the compose file runs
    assert prom_ds["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": tempo_ds["uid"]}]
    assert tempo_ds["type"] == "tempo" and tempo_ds["url"] == f"http://tempo:{services['tempo']['ports'][0].split(':')[-1]}"
    tempo = yaml.safe_load(mounts["/etc/tempo.yaml"].read_text())
    otlp_port = tempo["distributor"]["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    assert f"{otlp_port}:{otlp_port}" in services["tempo"]["ports"]
    port = services["prometheus"]["ports"][0].split(":")[-1]
    assert prom_ds["url"] == f"http://prometheus:{port}"
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    assert prom_ds["jsonData"]["timeInterval"] == shipped["global"]["scrape_interval"]

    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/gateway.yml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == GRAFANA / "dashboards"
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"

    gateway_port = services["gateway"]["ports"][0].split(":")[-1]
    (job,) = [j for j in shipped["scrape_configs"] if j["job_name"] == "gateway"]
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]


def test_dockerfile_copies_files_that_exist() -> None:
    compose = yaml.safe_load((GRAFANA / "docker-compose.yml").read_text())
    build = compose["services"]["gateway"]["build"]
    context = (GRAFANA / build["context"]).resolve()
    dockerfile = context / build["dockerfile"]
    copies = [line.split()[1:-1] for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (context / source).exists(), f"{dockerfile.name} copies {source}, missing from the repo"
