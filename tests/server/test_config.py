"""config.yaml: the shipped one loads; every error names the file, the field and the problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.settings import ConfigError, load_config
from gateway.server.app import build_app, load_policies
from tests.server.conftest import config_data, write_config
from tests.support.procs import ROOT


def test_the_shipped_config_loads_with_the_shipped_policies() -> None:
    config = load_config(ROOT / "config.yaml")
    assert config.server.port == 8080 and config.server.max_body_bytes == 4 * 1024 * 1024
    assert config.store.kind == "sqlite" and config.store.path == str(ROOT / "gateway.db")
    assert config.policies_dir == ROOT / "policies"
    assert config.upstreams["scripted"].kind == "scripted"
    route = config.route("scripted-plan")
    assert route is not None and route.upstream == "scripted"
    assert (route.price.input_per_million, route.price.output_per_million) == (2.0, 12.0)
    assert config.team("demo") is not None and config.team("demo").policies[0] == "passthrough"  # type: ignore[union-attr]
    load_policies(config)  # every team's policies exist


def test_paths_are_relative_to_the_config_folder(tmp_path: Path) -> None:
    path = write_config(tmp_path / "deep", config_data())
    config = load_config(path)
    assert config.store.options["path"] == str((tmp_path / "deep" / "gateway.db").resolve())
    assert config.trace_file == (tmp_path / "deep" / "trace.jsonl").resolve()
    assert config.policies_dir == (tmp_path / "deep" / "policies").resolve()


def test_first_matching_model_route_wins(tmp_path: Path) -> None:
    data = config_data(models=[
        {"match": "scripted-plan", "upstream": "scripted", "price_in": 1.0, "price_out": 1.0},
        {"match": "scripted-*", "upstream": "scripted"},
    ])
    config = load_config(write_config(tmp_path, data))
    assert config.route("scripted-plan").price.input_per_million == 1.0  # type: ignore[union-attr]
    assert config.route("scripted-runaway").price.input_per_million == 2.0  # type: ignore[union-attr]
    assert config.route("gpt-4o") is None


def test_deployments_fallbacks_and_the_hold_price(tmp_path: Path) -> None:
    data = config_data(
        upstreams=[{"name": "scripted", "kind": "scripted"}, {"name": "far", "base_url": "http://127.0.0.1:9/v1",
                                                              "timeout_s": 30, "first_byte_timeout_s": 5}],
        models=[{"match": "gpt-x", "deployments": [{"upstream": "far", "weight": 3, "price_in": 3.0},
                                                   {"upstream": "scripted", "model": "scripted-plan"}],
                 "price_in": 1.0, "price_out": 4.0, "fallbacks": ["scripted-once"]},
                {"match": "scripted-*", "upstream": "scripted", "price_in": 0.5, "price_out": 20.0}])
    config = load_config(write_config(tmp_path, data))
    route = config.route("gpt-x")
    assert route is not None and route.upstream == "far" and route.plan.retries == 2  # several: 2 by default
    first, second = route.plan.groups[0].deployments
    assert (first.weight, first.price.input_per_million, first.price.output_per_million) == (3, 3.0, 4.0)
    assert (second.model, second.price.input_per_million) == ("scripted-plan", 1.0)
    assert route.plan.groups[1].model == "scripted-once"
    assert (route.price.input_per_million, route.price.output_per_million) == (3.0, 20.0)  # covers the fallback
    single = config.route("scripted-plan")
    assert single is not None and single.plan.single and single.plan.retries == 0  # the old form: as before
    far = config.upstreams["far"]
    assert (far.connect_timeout_s, far.first_byte_timeout_s, far.timeout_s) == (10.0, 5.0, 30.0)


def _deploy(data: dict[str, Any], deployments: list[dict[str, Any]]) -> None:
    route = data["models"][0]
    route.pop("upstream")
    route["deployments"] = deployments


def _with(change: Any) -> dict[str, Any]:
    data = config_data()
    change(data)
    return data


ERRORS = [
    (lambda d: d["teams"][0].update(budget_usd="ten"), "teams[0].budget_usd", "must be a number"),
    (lambda d: d["teams"][0].update(budget_usd=-1), "teams[0].budget_usd", ">= 0"),
    (lambda d: d["teams"][1].update(budget_period="year"), "teams[1].budget_period", "day, week, month, total"),
    (lambda d: d["teams"][0].update(budget_mode="hard"), "teams[0].budget_mode", "turn, strict"),
    (lambda d: d["teams"][0].update(policies=[]), "teams[0].policies", "at least one policy"),
    (lambda d: d["teams"][0].update(keys=[]), "teams[0].keys", "at least one key"),
    (lambda d: d["teams"][1].update(keys=["sk-test"]), "teams[1].keys", "also a key of team 't'"),
    (lambda d: d["teams"][1].update(name="t"), "teams[1].name", "defined twice"),
    (lambda d: d["teams"][0].update(key_env="GATEWAY_TEST_UNSET_VAR"), "teams[0].key_env", "is not set"),
    (lambda d: d["teams"][0].update(budgett=3), "teams[0].budgett", "unknown field"),
    (lambda d: d.update(upstreams=[{"name": "x", "kind": "openai"}]), "upstreams[0].base_url", "is required"),
    (lambda d: d.update(upstreams=[{"name": "x", "base_url": "ftp://x"}]), "upstreams[0].base_url", "http://"),
    (lambda d: d.update(upstreams=[{"name": "x", "kind": "magic"}]), "upstreams[0].kind", "scripted, openai, local"),
    (lambda d: d["upstreams"][0].update(timeout_s=0), "upstreams[0].timeout_s", "> 0"),
    (lambda d: d.update(upstreams=[{"name": "x", "kind": "local"}]), "upstreams[0].base_url", "kind local"),
    (lambda d: d["upstreams"][0].update(max_tokens=0), "upstreams[0].max_tokens", ">= 1"),
    (lambda d: d["upstreams"][0].update(tool_repair="yes"), "upstreams[0].tool_repair", "true or false"),
    (lambda d: d.update(upstreams=[]), "upstreams", "at least one upstream"),
    (lambda d: d["models"][0].update(upstream="nowhere"), "models[0].upstream", "no upstream named 'nowhere'"),
    (lambda d: d["models"][0].update(price_in="cheap"), "models[0].price_in", "must be a number"),
    (lambda d: d["models"][0].pop("match"), "models[0].match", "is required"),
    (lambda d: d.update(teams={"t": 1}), "teams", "must be a list"),
    (lambda d: d.pop("teams"), "teams", "is required"),
    (lambda d: d["server"].update(port=70000), "server.port", "<= 65535"),
    (lambda d: d["server"].update(max_body_bytes="4MB"), "server.max_body_bytes", "must be an integer"),
    (lambda d: d["server"].update(refusal_status=500), "server.refusal_status", "one of 429, 400, 402, 403"),
    (lambda d: d["defaults"].update(output_allowance_tokens=0), "defaults.output_allowance_tokens", ">= 1"),
    (lambda d: d["server"].update(tool_threads=0), "server.tool_threads", ">= 1"),
    (lambda d: d["server"].update(header_timeout_s=0), "server.header_timeout_s", "> 0"),
    (lambda d: d["server"].update(body_timeout_s="1m"), "server.body_timeout_s", "must be a number"),
    (lambda d: d["server"].update(idle_timeout_s=-5), "server.idle_timeout_s", "> 0"),
    (lambda d: d["server"].update(max_connections=0), "server.max_connections", ">= 1"),
    (lambda d: d["server"].update(work_slots=-1), "server.work_slots", ">= 0"),
    (lambda d: d.update(stores={}), "stores", "unknown field"),
    (lambda d: d["models"][0].update(deployments=[{"upstream": "scripted"}]), "models[0].upstream",
     "either upstream or deployments"),
    (lambda d: _deploy(d, [{"upstream": "nowhere"}]),
     "models[0].deployments[0].upstream", "no upstream named 'nowhere'"),
    (lambda d: _deploy(d, [{"upstream": "scripted", "weight": 0}]),
     "models[0].deployments[0].weight", ">= 1"),
    (lambda d: _deploy(d, [{"upstream": "scripted"}, {"upstream": "scripted"}]),
     "models[0].deployments", "same upstream and model twice"),
    (lambda d: d["models"][0].update(fallbacks=["gpt-nowhere"]), "models[0].fallbacks[0]", "not routed"),
    (lambda d: d["models"][0].update(retries=11), "models[0].retries", "<= 10"),
    (lambda d: d["models"][0].update(cooldown_s=0), "models[0].cooldown_s", "> 0"),
    (lambda d: d["upstreams"][0].update(connect_timeout_s=-1), "upstreams[0].connect_timeout_s", "> 0"),
]


@pytest.mark.parametrize(("change", "field", "problem"), ERRORS)
def test_errors_name_file_field_and_problem(tmp_path: Path, change: Any, field: str, problem: str) -> None:
    path = write_config(tmp_path, _with(change))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.file == str(path)
    assert info.value.path == field
    assert problem in info.value.problem
    assert str(info.value).startswith(f"{path}: {field}: ")


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("teams: [\n  - {name: x\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML \(line \d+"):
        load_config(bad)


def test_a_local_upstream_repairs_caps_and_has_a_deadline_unless_told_otherwise(tmp_path: Path) -> None:
    url = "http://127.0.0.1:8081/v1"
    config = load_config(write_config(tmp_path, config_data(upstreams=[
        {"name": "scripted", "kind": "scripted"},
        {"name": "small", "kind": "local", "base_url": url},
        {"name": "small_raw", "kind": "local", "base_url": url, "tool_repair": False, "max_tokens": None,
         "timeout_s": 900},
        {"name": "hosted", "base_url": url, "tool_repair": True, "max_tokens": 1000}])))
    small, raw, hosted = (config.upstreams[n] for n in ("small", "small_raw", "hosted"))
    assert (small.tool_repair, small.max_tokens, small.timeout_s) == (True, 512, 180.0)
    assert (raw.tool_repair, raw.max_tokens, raw.timeout_s) == (False, None, 900.0)
    assert (hosted.kind, hosted.tool_repair, hosted.max_tokens, hosted.timeout_s) == ("openai", True, 1000, 60.0)
    assert (config.upstreams["scripted"].tool_repair, config.upstreams["scripted"].max_tokens) == (False, None)


def test_key_env_supplies_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEY", "sk-from-env")
    path = write_config(tmp_path, _with(lambda d: d["teams"][1].update(key_env="GATEWAY_TEST_KEY")))
    assert load_config(path).teams[1].keys == ("sk-other", "sk-from-env")


def test_team_policies_must_exist(tmp_path: Path) -> None:
    path = write_config(tmp_path, _with(lambda d: d["teams"][1].update(policies=["passthrough", "ghost"])))
    with pytest.raises(ConfigError) as info:
        build_app(load_config(path))
    assert info.value.path == "teams[1].policies[1]" and "no policy named 'ghost'" in info.value.problem


def test_store_errors_are_config_errors(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_data(store={"kind": "redis", "url": "http://nope"}))
    with pytest.raises(ConfigError) as info:
        build_app(load_config(path))
    assert str(info.value).startswith(f"{path}: store.url: ")


def test_gateway_serve_prints_the_error_and_exits_2(tmp_path: Path) -> None:
    data = config_data()
    data["teams"][0]["budget_usd"] = "ten"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{path}: teams[0].budget_usd: must be a number" in proc.stderr
    assert "serving" not in proc.stderr


def test_a_missing_policies_dir_is_a_config_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, _with(lambda d: d.update(policies_dir="./no-such-folder")))
    with pytest.raises(ConfigError) as info:
        build_app(load_config(path))
    assert info.value.path == "policies_dir" and "no-such-folder" in info.value.problem


def test_gateway_serve_reports_every_error_of_the_file_at_once(tmp_path: Path) -> None:
    """The new user's case: a missing variable hid a bad upstream and a bad policy name."""
    data = config_data()
    data["teams"].append({"name": "beta", "key_env": "GATEWAY_TEST_BETA_KEY", "policies": ["passthrough"]})
    data["models"].append({"match": "gpt-*", "upstream": "opneai"})
    data["teams"][1]["policies"] = ["passthrough", "pasthrough"]
    data["teams"][0]["budget_usd"] = "ten"
    data["teams"][0]["budget_period"] = "fortnight"
    data["servre"] = {"port": 1}
    path = write_config(tmp_path, data)
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_TEST_BETA_KEY"}
    proc = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    expected = ["servre", "models[1].upstream", "teams[0].budget_usd", "teams[0].budget_period",
                "teams[2].key_env", "teams[1].policies[1]"]
    for field in expected:
        assert sum(line.startswith(f"gateway: config error: {path}: {field}: ") for line in lines) == 1, \
            (field, proc.stderr)
    assert len(lines) == len(expected), proc.stderr  # one line each, nothing else
    assert "no upstream named 'opneai'" in proc.stderr and "GATEWAY_TEST_BETA_KEY is not set" in proc.stderr
    assert "no policy named 'pasthrough'" in proc.stderr


def test_an_invalid_entry_does_not_make_the_entries_naming_it_fail_too(tmp_path: Path) -> None:
    data = config_data(upstreams=[{"name": "scripted", "kind": "scripted"},
                                  {"name": "far", "base_url": "ftp://nowhere", "timeout_s": -1}],
                       models=[{"match": "scripted-*", "upstream": "scripted"}, {"match": "x", "upstream": "far"}])
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, data))
    assert [e.path for e in getattr(info.value, "errors", [info.value])] == ["upstreams[1].base_url"]  # not models[1]


def test_a_value_past_its_bound_does_not_hide_its_sections_other_errors(tmp_path: Path) -> None:
    """A bound checked after the number was read (shutdown_delay_s, spool_reserve_mb,
    telemetry.sample_ratio) names its field and lets the rest of its section be checked."""
    data = config_data()
    data.setdefault("server", {}).update({"shutdown_delay_s": 999, "max_body_bytes": "big"})
    data["spool_reserve_mb"] = 10 ** 9
    data["telemetry"] = {"sample_ratio": 3, "service_name": 5}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, data))
    paths = sorted(e.path for e in getattr(info.value, "errors", [info.value]))
    assert paths == ["server.max_body_bytes", "server.shutdown_delay_s", "spool_reserve_mb",
                     "telemetry.sample_ratio", "telemetry.service_name"], paths
