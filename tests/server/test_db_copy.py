"""`gateway db copy` from a SQLite file of 1,000 runs: a gateway on the PostgreSQL copy
answers GET /v1/runs/{id} for every run exactly as the gateway on the SQLite file did.

Real processes: a gateway on the SQLite file (tests/server/served.py), the CLI's copy into a
schema of the session's PostgreSQL, and the same gateway restarted on that schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.store.sqlite import SqliteStore
from tests.server.served import Served, get_run
from tests.store.test_postgres import copy_cli, fill
from tests.support.postgres import new_schema

RUNS = 1_000


async def answers(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    return {i: await get_run(session, url, f"run_{i:04d}") for i in range(RUNS)}


# 2,000 reads of a run through two gateway starts: 26 s on a quiet machine, past the
# suite's 120 s limit at load 20 with 2-worker gateways.
@pytest.mark.timeout(480)
async def test_a_copy_of_1000_runs_answers_every_run_as_the_sqlite_file_did(postgres_dsn: str, tmp_path: Path) -> None:
    folder = tmp_path / "gw"
    folder.mkdir()
    source = SqliteStore(folder / "gateway.db")
    await fill(source, RUNS)
    await source.close()
    served = Served.start(folder)
    try:
        async with aiohttp.ClientSession() as session:
            before = await answers(session, served.url)
        served.proc.stop()
        schema = new_schema("copy")
        done = copy_cli(f"sqlite:{folder / 'gateway.db'}", postgres_dsn, schema)
        assert done.returncode == 0, done.stderr
        config = yaml.safe_load((folder / "config.yaml").read_text())
        config["store"] = {"kind": "postgres", "dsn": postgres_dsn, "schema": schema}
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        served.restart()
        async with aiohttp.ClientSession() as session:
            after = await answers(session, served.url)
    finally:
        served.proc.stop()
    assert len(before) == RUNS and before[7]["status"] == "running" and before[7]["turns"] == 1
    assert after == before
