"""`telemetry:` and `access_log:` validated like the rest of the config; the access log's
writer (formats, rotation shared by processes); any store's calls timed.

The real exporter, spans and access log of a running gateway are tests/server/test_telemetry.py.
"""

from __future__ import annotations

import json
import multiprocessing
import shlex
from pathlib import Path
from typing import Any

import pytest

from gateway.config.settings import ConfigError, load_config
from gateway.config.telemetry import AccessLogConfig
from gateway.harness.state import RunState
from gateway.server import context as ctx
from gateway.server.app import build_app, start_tracing
from gateway.store.memory import MemoryStore
from gateway.store.timed import OPERATIONS, TimedStore, timed, unwrapped
from gateway.telemetry.access_log import FIELDS, AccessLog
from tests.server.conftest import config_data, write_config

ERRORS = [
    ({"telemetry": {"otlp_endpoint": "grpc://collector:4317"}}, "telemetry.otlp_endpoint", "http:// or https://"),
    ({"telemetry": {"otlp_endpoint": "http://collector:4318?x=1"}}, "telemetry.otlp_endpoint", "without a query"),
    ({"telemetry": {"otlp_endpoint": "http://collector:99999"}}, "telemetry.otlp_endpoint", "port"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "sample_ratio": 1.5}}, "telemetry.sample_ratio", "from 0 to 1"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "sample_ratio": -0.1}}, "telemetry.sample_ratio", ">= 0"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "headers_env": "GATEWAY_TEST_UNSET_VAR"}},
     "telemetry.headers_env", "is not set"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "resource": {"k": [1]}}}, "telemetry.resource.k",
     "a string"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "content_max_chars": 0}}, "telemetry.content_max_chars",
     ">= 1"),
    ({"telemetry": {"otlp_endpoint": "http://c:4318", "sampling": 1}}, "telemetry.sampling", "unknown field"),
    ({"access_log": {"format": "xml"}}, "access_log.format", "json, logfmt"),
    ({"access_log": {"max_mb": 0}}, "access_log.max_mb", "> 0"),
    ({"access_log": {"exclude_routes": ["metrics"]}}, "access_log.exclude_routes[0]", "starting with /"),
    ({"server": {"shutdown_delay_s": 60}}, "server.shutdown_delay_s", "at most 15"),
]


@pytest.mark.parametrize(("extra", "field", "problem"), ERRORS)
def test_errors_name_the_field(tmp_path: Path, extra: dict[str, Any], field: str, problem: str) -> None:
    data = config_data()
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if key == "server" else value
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == field, str(info.value)
    assert problem in info.value.problem


def test_the_defaults_and_a_bare_collector_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(write_config(tmp_path, config_data()))
    assert not config.telemetry.enabled  # off by default
    assert config.access_log == AccessLogConfig()  # on: JSON on stderr, probes and scrapes left out
    assert config.access_log.exclude_routes == {"/healthz", "/livez", "/readyz", "/metrics"}
    monkeypatch.setenv("GATEWAY_TEST_OTLP", "authorization=Bearer%20s3cret, x-tenant=ops")
    data = {**config_data(), "telemetry": {"otlp_endpoint": "http://collector:4318/", "headers_env": "GATEWAY_TEST_OTLP"},
            "access_log": False}
    config = load_config(write_config(tmp_path, data))
    assert config.telemetry.otlp_endpoint == "http://collector:4318/v1/traces"
    assert dict(config.telemetry.headers) == {"authorization": "Bearer s3cret", "x-tenant": "ops"}
    assert "s3cret" not in repr(config.telemetry)  # never in a log line or an error
    assert config.access_log.enabled is False
    data["telemetry"]["otlp_endpoint"] = "https://otlp.example.com/api/traces"  # a path: used as it is
    assert load_config(write_config(tmp_path, data)).telemetry.otlp_endpoint == "https://otlp.example.com/api/traces"


def test_malformed_exporter_headers_are_refused_without_showing_them(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_OTLP", "just-a-s3cret-token")
    data = {**config_data(), "telemetry": {"otlp_endpoint": "http://c:4318", "headers_env": "GATEWAY_TEST_OTLP"}}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, data))
    assert info.value.path == "telemetry.headers_env" and "s3cret" not in str(info.value)


async def test_tracing_off_adds_nothing_to_the_app(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, config_data()))
    assert start_tracing(config, None) is None
    app = build_app(config)
    try:
        assert len(app.middlewares) == 1  # the gateway's own: no tracing middleware
        assert ctx.TRACING not in app
        assert isinstance(app[ctx.STORE], TimedStore)  # the store's latency is always measured
    finally:
        app[ctx.MCP].close()
        await app[ctx.STORE].close()


def _fields(i: int) -> dict[str, Any]:
    return {name: None for name in FIELDS} | {"time": "2026-12-05T10:11:12.345Z", "method": "GET",
                                               "route": "/v1/runs/{id}", "status": 200, "duration_ms": 1.5,
                                               "bytes": 100 + i, "run_id": f"r {i}", "cost_usd": 0.25}


def test_logfmt_quotes_what_needs_it_and_leaves_out_what_is_absent(tmp_path: Path) -> None:
    log = AccessLog(AccessLogConfig(format="logfmt", file=tmp_path / "a.log"))
    log.write(_fields(1) | {"error_code": 'say "hi"'})
    log.close()
    line = (tmp_path / "a.log").read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    parsed = dict(item.split("=", 1) for item in shlex.split(line))
    assert parsed == {"time": "2026-12-05T10:11:12.345Z", "method": "GET", "route": "/v1/runs/{id}", "status": "200",
                      "duration_ms": "1.5", "bytes": "101", "run_id": "r 1", "cost_usd": "0.25",
                      "error_code": 'say "hi"'}
    assert "team=" not in line  # absent: left out


def _writer(path: str, start: int, count: int) -> None:
    log = AccessLog(AccessLogConfig(file=Path(path), max_mb=0.01, keep=50))
    for i in range(start, start + count):
        log.write(_fields(i))
    log.close()


def test_a_rotated_file_shared_by_processes_loses_no_line(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_writer, args=(str(path), n * 1000, 300)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    files = [path, *sorted((f for f in tmp_path.glob("access.log.*") if f.suffix[1:].isdigit()),
                           key=lambda f: int(f.suffix[1:]))]
    assert len(files) > 3  # it rotated (10 kB each)
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert sorted(line["bytes"] for line in lines) == sorted(100 + n * 1000 + i for n in range(3) for i in range(300))
    assert all(list(line) == list(FIELDS) for line in lines)


async def test_every_store_operation_is_timed_and_what_is_not_one_passes_through() -> None:
    seen: list[tuple[str, float]] = []
    inner = MemoryStore()
    store = timed(inner, lambda op, s: seen.append((op, s)))
    assert timed(store, lambda op, s: None) is store and unwrapped(store) is inner
    assert {"admit", "commit_turn", "load_run", "events", "acquire_lease"} <= set(OPERATIONS)
    assert "close" not in OPERATIONS
    await store.create_run(RunState.new("m", [], run_id="demo/r1", team="demo", policy="passthrough"))
    assert (await store.load_run("demo/r1")) is not None
    assert [op for op, _ in seen] == ["create_run", "load_run"] and all(s >= 0 for _, s in seen)
    with pytest.raises(Exception):
        await store.create_run(RunState.new("m", [], run_id="demo/r1", team="demo", policy="passthrough"))
    assert seen[-1][0] == "create_run"  # a call that raised is timed too
    assert store.lookup_in_admission == inner.lookup_in_admission  # not an operation: the store's own
    def rule(run_id: str, events: Any) -> list[Any]:
        return []

    store.notice_rule = rule  # set on the store itself (the webhooks' rule: `notify.delivery`)
    assert inner.notice_rule is rule and "notice_rule" not in vars(store)
