"""POST /v1/admin/reload over real HTTP: who may call it, what it answers, what it refuses.

The gateway runs on a real aiohttp test server with a SQLite store; team `t` (sk-test) is
the admin, team `o` (sk-other) is not. Policies are the files of the conftest's temp folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gateway.config.settings import ConfigError, parse_config
from tests.server.conftest import (
    KEY,
    OTHER_KEY,
    PLAN_USER,
    POLICIES,
    Gateway,
    MakeGateway,
    config_data,
)

RUNAWAY: dict[str, Any] = {"model": "scripted-runaway", "messages": [PLAN_USER]}


@pytest.fixture
async def admin_gw(make_gateway: MakeGateway) -> Gateway:
    return await make_gateway(team={"admin": True})


async def reload(gw: Gateway, key: str | None = KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with gw.client.post("/v1/admin/reload", headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


def policy_file(gw: Gateway, name: str) -> Path:
    return gw.config.policies_dir / f"{name}.yaml"


def version_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


async def run_version(gw: Gateway, run_id: str) -> str:
    async with gw.client.get(f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200
        version: str = (await resp.json())["policy_version"]
        return version


async def test_only_admin_keys_may_reload(admin_gw: Gateway) -> None:
    status, body = await reload(admin_gw, key=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "missing Authorization header" in body["error"]["message"]
    status, body = await reload(admin_gw, key="sk-nobody")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = await reload(admin_gw, key=OTHER_KEY)
    assert status == 403 and body["error"]["code"] == "not_an_admin"
    assert "team 'o' may not reload policies" in body["error"]["message"] and "admin teams: t" in body["error"]["message"]


async def test_a_gateway_without_admin_teams_refuses_everyone(gw: Gateway) -> None:
    status, body = await reload(gw)
    assert status == 403 and "admin teams: none configured" in body["error"]["message"]


async def test_an_unchanged_reload_lists_every_policy_with_its_version(admin_gw: Gateway) -> None:
    status, body = await reload(admin_gw)
    assert status == 200, body
    assert body["object"] == "policy_reload" and body["changed"] == [] and body["errors"] == []
    assert body["loaded"] == [{"name": name, "version": version_of(policy_file(admin_gw, name))}
                              for name in sorted(POLICIES)]


async def test_an_edited_policy_governs_new_runs_only(admin_gw: Gateway) -> None:
    gw = admin_gw
    for _ in range(2):  # "capped" allows 3 turns
        status, _, _ = await gw.chat(RUNAWAY, run_id="old", headers={"X-Policy": "capped"})
        assert status == 200
    old_version = version_of(policy_file(gw, "capped"))
    policy_file(gw, "capped").write_text(yaml.safe_dump({"name": "capped", "limits": {"max_turns": 1}}))
    new_version = version_of(policy_file(gw, "capped"))

    status, body = await reload(gw)
    assert status == 200, body
    assert body["changed"] == [{"name": "capped", "version": new_version}]
    assert {"name": "capped", "version": new_version} in body["loaded"]

    status, _, _ = await gw.chat(RUNAWAY, run_id="new", headers={"X-Policy": "capped"})
    assert status == 200
    status, _, body = await gw.chat(RUNAWAY, run_id="new")
    assert status == 429 and body["error"]["type"] == "max_turns_exceeded"  # the new cap: 1 turn
    assert await run_version(gw, "new") == new_version
    status, headers, _ = await gw.chat(RUNAWAY, run_id="old")  # the old run keeps its 3 turns
    assert status == 200 and headers["X-Run-Turns"] == "3"
    assert await run_version(gw, "old") == old_version


async def test_a_broken_file_is_refused_and_the_old_set_keeps_serving(admin_gw: Gateway) -> None:
    gw = admin_gw
    path = policy_file(gw, "capped")
    before = version_of(path)
    path.write_text("name: capped\nlimits:\n  max_turns: -2\n")
    status, body = await reload(gw)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_policy"
    assert "previous config and policies keep serving" in body["error"]["message"]
    [error] = body["errors"]
    assert (error["file"], error["line"], error["field"]) == (str(path), 3, "limits.max_turns")
    assert "-2" in error["problem"] and error["message"].startswith(f"{path}:3: limits.max_turns:")
    assert body["changed"] == [] and {"name": "capped", "version": before} in body["loaded"]
    for _ in range(3):  # still the old cap of 3
        status, _, _ = await gw.chat(RUNAWAY, run_id="after-broken", headers={"X-Policy": "capped"})
        assert status == 200
    assert await run_version(gw, "after-broken") == before


async def test_dropping_a_policy_a_team_lists_is_refused(admin_gw: Gateway) -> None:
    gw = admin_gw
    policy_file(gw, "strict").unlink()
    status, body = await reload(gw)
    assert status == 400, body
    [error] = body["errors"]
    index = list(POLICIES).index("strict")
    assert error["file"] == str(gw.config.path) and error["field"] == f"teams[0].policies[{index}]"
    assert "team 't' lists policy 'strict'" in error["problem"]
    status, _, _ = await gw.chat(RUNAWAY, headers={"X-Policy": "strict"})  # still served
    assert status == 200


def test_admin_is_a_boolean_and_defaults_to_false(tmp_path: Path) -> None:
    config = parse_config(config_data(team={"admin": True}), tmp_path / "config.yaml")
    assert [t.admin for t in config.teams] == [True, False]
    with pytest.raises(ConfigError) as caught:
        parse_config(config_data(other={"admin": "yes"}), tmp_path / "config.yaml")
    assert caught.value.path == "teams[1].admin" and "must be true or false" in caught.value.problem


def test_the_shipped_config_keeps_the_approver_team_out_of_admin() -> None:
    """Admins may steer any run: the approver of the shipped policies must not be one."""
    from gateway.config.settings import load_config
    from tests.support.procs import ROOT

    config = load_config(ROOT / "config.yaml")
    assert [t.name for t in config.teams if t.admin] == ["root"]
