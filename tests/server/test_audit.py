"""The audit log against a real gateway (`--workers 2` on one SQLite file): each administrative
act appears exactly once, with its actor (team and key id, never a secret), and the chain of
hashes verifies (`gateway audit verify`), then fails once a record is changed in the file.

The acts: a key created, updated, rotated and revoked; an approval decided; a limit request
granted (its limits old -> new) and one rejected (`on_exceed: ask`); a run resumed with
raised limits; a run cancelled by an admin team (not its owner; its owner's own cancel is
not an administrative act); the policies reloaded; a console sign-in and sign-out.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.config.keys import config_key_id
from tests.server.served import ASK_GRANT_TURNS, ASK_MAX_TURNS, DEMO, OPS, Served, chat_body, request, write_config
from tests.support.procs import START_TIMEOUT_S, free_port, run_gateway, start_gateway

ROOT = "sk-audit-root"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("audit") / "gw"
    folder.mkdir(parents=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    config["teams"].append({"name": "root", "keys": [ROOT], "admin": True, "policies": ["passthrough"]})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(path), "--workers", "2"], "/healthz", port,
                         folder / "gateway-1.log", timeout=START_TIMEOUT_S * 2)
    yield Served(folder, port, proc)
    proc.stop()


async def destructive(session: aiohttp.ClientSession, served: Served) -> str:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    return str(headers["X-Run-Id"])


async def asking(session: aiohttp.ClientSession, served: Served) -> tuple[str, str]:
    """A run of `files_ask` paused at its turn cap, asking for more: (its id, the request's id)."""
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-plan"), headers={"X-Policy": "files_ask"})
    assert status == 200 and body["run"]["reason"] == "limit", body
    return str(headers["X-Run-Id"]), str(body["run"]["interruption"]["call_id"])


async def audit_log(session: aiohttp.ClientSession, served: Served, **query: Any) -> list[dict[str, Any]]:
    status, _, body = await request(session, "GET", f"{served.url}/v1/admin/audit", key=ROOT,
                                    headers=None) if not query else await request(
        session, "GET", f"{served.url}/v1/admin/audit?" + "&".join(f"{k}={v}" for k, v in query.items()), key=ROOT)
    assert status == 200, body
    return list(body["data"])


async def test_each_administrative_act_is_recorded_once_with_its_actor(served: Served,
                                                                      session: aiohttp.ClientSession) -> None:
    url, root_id = served.url, config_key_id(ROOT)
    status, _, made = await request(session, "POST", f"{url}/v1/admin/keys", key=ROOT,
                                    body={"team": "demo", "name": "audited", "budget_usd": 2.0})
    assert status == 201
    key_id = made["id"]
    for method, path, body in (("PATCH", f"/v1/admin/keys/{key_id}", {"budget_usd": 3.0}),
                               ("POST", f"/v1/admin/keys/{key_id}/rotate", {"grace_s": 0}),
                               ("DELETE", f"/v1/admin/keys/{key_id}", None),
                               ("DELETE", f"/v1/admin/keys/{key_id}", None)):  # revoked already: no new record
        status, _, answer = await request(session, method, url + path, key=ROOT, body=body)
        assert status == 200, answer

    decided = await destructive(session, served)
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{decided}/approvals", key=OPS,
                                      body={"call_id": "c2", "decision": "approve"})
    assert status == 200, answer
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{decided}/resume",
                                      body={"max_turns": 40})
    assert status == 200, answer
    granted, grant_id = await asking(session, served)
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{granted}/approvals", key=OPS,
                                      body={"call_id": grant_id, "decision": "approve", "reason": "nearly done"})
    assert status == 200 and answer["decision"]["after"] == {"max_turns": ASK_MAX_TURNS + ASK_GRANT_TURNS}, answer
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{granted}/approvals", key=OPS,
                                      body={"call_id": grant_id, "decision": "approve"})
    assert status == 409, answer  # decided already: no second grant, no second record
    refused, refused_id = await asking(session, served)
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{refused}/approvals", key=OPS,
                                      body={"call_id": refused_id, "decision": "reject", "reason": "not worth it"})
    assert status == 200 and answer["run"]["status"] == "max_turns_exceeded", answer
    cancelled = await destructive(session, served)
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{cancelled}/cancel", key=ROOT,
                                      body={"reason": "stop it"})
    assert status == 200 and answer["cancel"] == "done", answer
    own = await destructive(session, served)
    status, _, answer = await request(session, "POST", f"{url}/v1/runs/{own}/cancel", body={})
    assert status == 200  # the owner's own cancel: not an administrative act
    status, _, answer = await request(session, "POST", f"{url}/v1/admin/reload", key=ROOT)
    assert status == 200, answer

    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as browser:
        async with browser.post(f"{url}/console/session", json={"key": DEMO}) as resp:
            csrf = (await resp.json())["csrf_token"]
        async with browser.delete(f"{url}/console/session", headers={"X-CSRF-Token": csrf}) as resp:
            assert resp.status == 200

    records = await audit_log(session, served, limit=1000)
    mine = [r for r in records if r["target"] in (key_id, decided, granted, refused, cancelled, own, "policies",
                                                  "console")]
    counts = Counter((r["action"], r["target"]) for r in mine)
    assert counts == {("key.created", key_id): 1, ("key.updated", key_id): 1, ("key.rotated", key_id): 1,
                      ("key.revoked", key_id): 1, ("approval.decided", decided): 1,
                      ("limit.granted", granted): 1, ("limit.rejected", refused): 1,
                      ("run.resumed_with_limits", decided): 1, ("run.cancelled", cancelled): 1,
                      ("config.reloaded", "policies"): 1, ("console.signed_in", "console"): 1,
                      ("console.signed_out", "console"): 1}, counts
    by = {r["action"]: r for r in mine}
    for action in ("key.created", "key.updated", "key.rotated", "key.revoked", "run.cancelled", "config.reloaded"):
        assert by[action]["actor"] == {"team": "root", "key_id": root_id}, by[action]
    assert by["approval.decided"]["actor"] == {"team": "ops", "key_id": config_key_id(OPS)}
    assert by["approval.decided"]["details"]["decision"] == "approve" and by["approval.decided"]["team"] == "demo"
    for action in ("limit.granted", "limit.rejected"):
        assert by[action]["actor"] == {"team": "ops", "key_id": config_key_id(OPS)}, by[action]
        assert by[action]["team"] == "demo" and by[action]["details"]["limit"] == "max_turns", by[action]
    assert by["limit.granted"]["details"]["max_turns"] == [ASK_MAX_TURNS, ASK_MAX_TURNS + ASK_GRANT_TURNS]
    assert by["limit.granted"]["details"]["call_id"] == grant_id
    assert by["limit.granted"]["details"]["reason"] == "nearly done"
    assert by["limit.rejected"]["details"]["max_turns"] == [ASK_MAX_TURNS, ASK_MAX_TURNS]  # unchanged
    assert by["limit.rejected"]["details"]["reason"] == "not worth it"
    assert by["run.resumed_with_limits"]["actor"]["team"] == "demo"
    assert by["run.resumed_with_limits"]["details"]["max_turns"][1] == 40
    assert by["key.updated"]["details"] == {"budget_usd": [2.0, 3.0]}
    assert by["console.signed_in"]["actor"] == {"team": "demo", "key_id": config_key_id(DEMO)}
    raw = orjson.dumps(records)
    assert made["key"].encode() not in raw and DEMO.encode() not in raw and ROOT.encode() not in raw
    only = await audit_log(session, served, action="key.rotated")
    assert {r["action"] for r in only} == {"key.rotated"}

    status, _, refused = await request(session, "GET", f"{url}/v1/admin/audit")  # a team that is not an admin
    assert status == 403 and refused["error"]["code"] == "not_an_admin"


def test_gateway_audit_verify_checks_the_chain(served: Served) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_URL", "GATEWAY_KEY")}
    env.update(GATEWAY_URL=served.url, GATEWAY_KEY=ROOT)
    done = run_gateway(["audit", "verify"], env=env)
    assert done.returncode == 0 and done.stdout.startswith("ok: "), done.stdout + done.stderr
    listed = run_gateway(["audit", "--action", "key.created"], env=env)
    assert listed.returncode == 0 and "key.created" in listed.stdout and "root/cfg_" in listed.stdout
    with sqlite3.connect(Path(served.folder) / "gateway.db") as db:  # someone edits the log behind the gateway
        seq, body = db.execute("SELECT seq, body FROM audit ORDER BY seq LIMIT 1").fetchone()
        db.execute("UPDATE audit SET body = ? WHERE seq = ?", (bytes(body).replace(b'"root"', b'"evil"'), seq))
    done = run_gateway(["audit", "verify"], env=env)
    assert done.returncode == 1 and "does not verify" in done.stderr and f"record {seq}" in done.stderr
