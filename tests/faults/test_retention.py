"""Retention against real processes: `gateway prune`, the background pass, trace rotation.

Ages are configured tiny (`runs_days: 1e-9`, about 86 µs) so that every finished run is
already old enough when the pass runs; a `running` run is never pruned whatever its age.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.store.sqlite import SqliteStore
from tests.faults.support import FILES_HEADERS, chat, serve
from tests.server.served import DEMO, poll, request
from tests.support.procs import run_gateway

SQLITE = {"kind": "sqlite", "path": "./gateway.db"}
TINY_DAYS = 1e-9
PASS_BODY: dict[str, Any] = {"model": "scripted-plan", "messages": [{"role": "user", "content": "hi"}]}


async def make_runs(session: aiohttp.ClientSession, url: str) -> tuple[list[str], str]:
    """Three completed server-side runs and one pass-through run left `running` (tool calls)."""
    done = []
    for _ in range(3):
        status, headers, body = await chat(session, url, headers=FILES_HEADERS)
        assert status == 200, body
        done.append(headers["X-Run-Id"])
    status, headers, body = await chat(session, url, PASS_BODY, headers={"X-Policy": "passthrough"})
    assert status == 200 and headers["X-Run-Status"] == "running", (headers, body)
    return done, headers["X-Run-Id"]


async def test_gateway_prune_deletes_finished_runs_and_rotates_the_trace_file(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    folder = tmp_path / "gw"
    retention = {"runs_days": TINY_DAYS, "events_days": TINY_DAYS, "trace_file_max_mb": 0.002,
                 "trace_file_keep": 2, "interval_s": 3600}
    gw = serve(folder, SQLITE, extra={"retention": {**retention, "runs_days": None, "events_days": None}})
    try:
        done, running = await make_runs(session, gw.url)
        for _ in range(5):  # enough trace lines to cross the 2 KB limit a few times
            await make_runs(session, gw.url)
    finally:
        gw.stop()
    files = sorted(p.name for p in folder.glob("trace.jsonl*"))
    assert files[-2:] == ["trace.jsonl.1", "trace.jsonl.2"] and set(files) <= {"trace.jsonl", *files[-2:]}
    for old in files[-2:]:  # each rotated on the append that took it past the limit
        assert 0.002 * 1024 * 1024 <= (folder / old).stat().st_size < 0.002 * 1024 * 1024 + 8192
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["retention"] = retention
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    out = run_gateway(["prune", "--config", str(folder / "config.yaml")])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pruned 18 finished run(s)"), out.stdout
    store = SqliteStore(folder / "gateway.db")
    try:
        for rid in done:
            assert await store.load_run(f"demo/{rid}") is None and await store.events(f"demo/{rid}") == []
        kept = await store.load_run(f"demo/{running}")
        assert kept is not None and kept.status == "running"
        assert len(await store.list_runs(limit=100)) == 6  # the six pass-through runs between calls
    finally:
        await store.close()


async def test_the_background_pass_prunes_without_anyone_acting(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    gw = serve(tmp_path / "gw", SQLITE, extra={"retention": {"runs_days": TINY_DAYS, "interval_s": 0.2}})
    try:
        done, running = await make_runs(session, gw.url)

        async def gone() -> bool:
            found = [(await request(session, "GET", f"{gw.url}/v1/runs/{rid}", key=DEMO))[0] for rid in done]
            return found == [404, 404, 404]

        await poll(gone)
        status, _, run = await request(session, "GET", f"{gw.url}/v1/runs/{running}", key=DEMO)
        assert status == 200 and run["status"] == "running"
    finally:
        gw.stop()


def test_retention_settings_parse_with_defaults_nulls_and_named_errors(tmp_path: Path) -> None:
    import pytest

    from gateway.config.settings import ConfigError, RetentionConfig, parse_config
    from tests.server.conftest import config_data

    file = tmp_path / "config.yaml"
    assert parse_config(config_data(), file).retention == RetentionConfig()
    parsed = parse_config({**config_data(), "retention": {"runs_days": None, "events_days": 0.5,
                                                          "trace_file_keep": 0, "interval_s": 60}}, file)
    assert parsed.retention == RetentionConfig(runs_days=None, events_days=0.5, trace_file_keep=0, interval_s=60)
    for bad, message in [({"runs_days": -1}, r"retention.runs_days.*> 0"),
                         ({"trace_file_keep": 1.5}, r"retention.trace_file_keep.*integer"),
                         ({"interval_s": None, "days": 3}, r"retention.*days")]:
        with pytest.raises(ConfigError, match=message):
            parse_config({**config_data(), "retention": bad}, file)
