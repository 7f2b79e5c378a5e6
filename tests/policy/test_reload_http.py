"""Reloading policies of a running `gateway serve` process, by HTTP and by SIGHUP.

A real process on a temp folder (tests.server.served: the shipped policies copied, a SQLite
store; team ops is made an admin here). The `files` policy is edited to cap runs at 2
turns: a run started before keeps the version and the 20-turn cap it started with (it is
approved and resumed to its third turn), new runs get the new version and stop at 2.
A broken file is refused and the old policies keep serving.

One process serves the module's tests: each puts the shipped `files.yaml` back and reloads
it when it ends (`served`), and reads only the log lines written since it began.
"""

from __future__ import annotations

import hashlib
import json
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest
import yaml

from tests.server.served import DEMO, OPS, OTHER, Served, auth, chat_body, get_run, poll, request, write_config
from tests.support.procs import START_TIMEOUT_S, free_port, start_gateway

How = Literal["http", "sighup"]


async def reloads_recorded(session: aiohttp.ClientSession, served: Served) -> list[dict[str, Any]]:
    """The audit log's `config.reloaded` records."""
    status, _, body = await request(session, "GET", f"{served.url}/v1/admin/audit?action=config.reloaded&limit=1000",
                                    key=OPS)
    assert status == 200, body
    return list(body["data"])


def start_served(folder: Path, *args: str, timeout: float = START_TIMEOUT_S) -> Served:
    """The served.py gateway, with team ops marked `admin: true` (`args`: more `serve` flags)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    for team in config["teams"]:
        team["admin"] = team["name"] == "ops"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(path), *args], "/healthz", port, folder / "gateway-1.log",
                         timeout=timeout)
    return Served(folder, port, proc)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = start_served(tmp_path_factory.mktemp("reload") / "gw")
    yield gateway
    gateway.proc.stop()


@pytest.fixture
def served(gateway: Served) -> Iterator[Served]:
    """The module's gateway; afterwards its `files.yaml` is the shipped one again, reloaded."""
    shipped = files_policy(gateway).read_text()
    yield gateway
    files_policy(gateway).write_text(shipped)
    with urllib.request.urlopen(urllib.request.Request(f"{gateway.url}/v1/admin/reload", method="POST",
                                                       headers=auth(OPS)), timeout=30) as resp:
        assert json.loads(resp.read())["errors"] == []


def log_since(served: Served, start: int) -> str:
    return served.proc.output()[start:]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def files_policy(served: Served) -> Path:
    return served.folder / "policies" / "files.yaml"


def version_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


async def start_run(session: aiohttp.ClientSession, served: Served, model: str) -> dict[str, Any]:
    """A new server-side run under `files`, driven until it stops; returns the run as the API shows it."""
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body(model), headers={"X-Policy": "files"})
    assert status == 200, body
    return await get_run(session, served.url, headers["X-Run-Id"])


async def reload_by_http(session: aiohttp.ClientSession, served: Served) -> tuple[int, Any]:
    status, _, body = await request(session, "POST", f"{served.url}/v1/admin/reload", key=OPS)
    return status, body


@pytest.mark.parametrize("how", ["http", "sighup"])
async def test_an_edited_policy_governs_new_runs_while_old_runs_keep_theirs(
        served: Served, session: aiohttp.ClientSession, how: How) -> None:
    logged = len(served.proc.output())
    old = await start_run(session, served, "scripted-destructive")
    assert old["status"] == "interrupted" and old["interruption"]["call_id"] == "c2" and old["turns"] == 2
    v1 = version_of(files_policy(served))
    assert old["policy_version"] == v1 and old["limits"]["max_turns"] == 20

    text = files_policy(served).read_text()
    assert "max_turns: 20," in text
    files_policy(served).write_text(text.replace("max_turns: 20,", "max_turns: 2,"))
    v2 = version_of(files_policy(served))

    if how == "http":
        status, body = await reload_by_http(session, served)
        assert status == 200, body
        assert body["changed"] == [{"name": "files", "version": v2}] and body["errors"] == []
        assert {"name": "files", "version": v2} in body["loaded"]
        new = await start_run(session, served, "scripted-plan")
    else:
        earlier = {r["seq"] for r in await reloads_recorded(session, served)}
        served.proc.popen.send_signal(signal.SIGHUP)

        async def a_new_run_under_v2() -> dict[str, Any] | None:
            run = await start_run(session, served, "scripted-plan")
            return run if run["policy_version"] == v2 else None

        new = await poll(a_new_run_under_v2)
        log = log_since(served, logged)
        assert "policies reloaded by SIGHUP" in log and f"files@{v2}" in log, log

        async def recorded() -> list[dict[str, Any]]:  # the signal's reload, as the gateway's own act
            return [r for r in await reloads_recorded(session, served) if r["seq"] not in earlier]

        by_signal = await poll(recorded)
        assert [(r["actor"], r["details"]) for r in by_signal] == [
            ({"team": "", "key_id": ""}, {"by": "SIGHUP", "changed": [["files", v2]], "config": []})], by_signal
    assert new["policy_version"] == v2 and new["limits"]["max_turns"] == 2
    assert new["status"] == "max_turns_exceeded" and new["turns"] == 2  # the plan needs 3 turns

    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/{old['id']}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve", "reason": "old logs"})
    assert status == 200, body
    status, headers, body = await request(session, "POST", f"{served.url}/v1/runs/{old['id']}/resume", body={})
    assert status == 200, body
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "3"  # past the new cap of 2
    resumed = await get_run(session, served.url, old["id"])
    assert resumed["policy_version"] == v1 and resumed["limits"]["max_turns"] == 20
    assert served.deleted(old["id"]) == ["access.log"]


@pytest.mark.parametrize("how", ["http", "sighup"])
async def test_a_broken_policy_file_is_refused_and_the_old_set_keeps_serving(
        served: Served, session: aiohttp.ClientSession, how: How) -> None:
    logged = len(served.proc.output())
    v1 = version_of(files_policy(served))
    text = files_policy(served).read_text()
    files_policy(served).write_text(text.replace("max_turns: 20,", "max_turns: many,"))
    line = 1 + next(i for i, t in enumerate(files_policy(served).read_text().splitlines()) if "max_turns: many" in t)

    if how == "http":
        status, body = await reload_by_http(session, served)
        assert status == 400, body
        assert body["error"]["code"] == "invalid_policy"
        # research.yaml's agent tool names `files`, so it is refused along with it
        error = next(e for e in body["errors"] if e["file"] == str(files_policy(served)))
        assert (error["line"], error["field"]) == (line, "limits.max_turns") and "'many'" in error["problem"]
        assert {"name": "files", "version": v1} in body["loaded"] and body["changed"] == []
        status, _, body = await request(session, "POST", f"{served.url}/v1/admin/reload", key=DEMO)
        assert status == 403 and body["error"]["code"] == "not_an_admin"
        status, _, body = await request(session, "POST", f"{served.url}/v1/admin/reload", key=OTHER)
        assert status == 403
    else:
        earlier = {r["seq"] for r in await reloads_recorded(session, served)}
        served.proc.popen.send_signal(signal.SIGHUP)

        async def refusal_logged() -> bool:
            return "reload by SIGHUP refused, the previous config and policies kept" in log_since(served, logged)

        await poll(refusal_logged)
        assert f"{files_policy(served)}:{line}: limits.max_turns:" in log_since(served, logged)

    run = await start_run(session, served, "scripted-plan")
    assert run["policy_version"] == v1 and run["status"] == "completed" and run["turns"] == 3
