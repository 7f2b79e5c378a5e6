"""The admin keys API against real gateway processes: two replicas on one redis-server, and
`--workers 2` on one SQLite file, in front of a real HTTP upstream.

- a key created on one process works on every process at once (a process that does not
  know a key reads the store's new keys before refusing it); revoked, it is refused (401)
  on every process within 1 s; rotated with `grace_s: 5`, both secrets work, then only
  the new one;
- no secret is ever written to the store (the SQLite file and its WAL, every Redis key's
  dump), the logs, the trace file or /metrics;
- a key manager manages its own team's keys only, never grants more than it has, and no key
  widens its own scope; other keys may not manage keys at all;
- bad input is refused by name (unknown fields, wrong types, oversize strings, a team that
  does not exist, an expiry in the past), globs that match nothing warn, never a 5xx;
- a budget set below what the key spent is allowed, and the key is refused until the period
  turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from tests.server.test_admission import (  # noqa: F401  (session, upstream: the fixtures of the admission tests)
    TASK,
    Upstream,
    chat,
    session,
    upstream,
    write_policies,
)
from tests.server.test_key_budgets import Deployment, deployed, starter
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.procs import Proc
from tests.support.shared_store import SHARED_KINDS

ADMIN, DEMO, MANAGER, OTHER = "sk-ops-admin", "sk-demo-plain", "sk-demo-manager", "sk-other"
WITHIN_S = 1.0
"""How soon every process must see a change (docs/keys.md)."""


def write_config(folder: Path, port: int, upstream_url: str, store: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    route = {"upstream": "counting", "price_in": 2.0, "price_out": 12.0}
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store,
        "policies_dir": str(write_policies(folder.parent)),
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "counting", "base_url": upstream_url}],
        "models": [{"match": "allowed-one", **route}, {"match": "allowed-two", **route}, {"match": "keys*", **route}],
        "teams": [
            {"name": "ops", "keys": [ADMIN], "admin": True, "policies": ["passthrough"]},
            {"name": "demo", "keys": [DEMO, {"key": MANAGER, "manage_keys": True, "models": ["allowed-*"],
                                             "name": "demo's manager"}],
             "budget_usd": 50.0, "budget_period": "total", "policies": ["passthrough", "wide"]},
            {"name": "other", "keys": [OTHER], "policies": ["passthrough"]},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


start = starter(write_config)


@pytest.fixture(scope="module", params=[*SHARED_KINDS, "sqlite-workers"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               upstream: Upstream) -> Iterator[Deployment]:
    with deployed(request, tmp_path_factory, start, upstream.url) as d:
        yield d


async def api(session: aiohttp.ClientSession, proc: Proc, key: str, method: str, path: str,
              body: Any = None) -> tuple[int, Any]:
    async with session.request(method, proc.url + path, json=body,
                               headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.json()


async def works(session: aiohttp.ClientSession, proc: Proc, key: str) -> int:
    status, _, _ = await chat(session, proc, key, {"model": "keys", "messages": TASK, "max_tokens": 5})
    return status


async def until(check: Any, deadline_s: float) -> float:
    """Seconds until `check()` is true (polled), or fail past the deadline."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < deadline_s, f"not within {deadline_s} s"
        await asyncio.sleep(0.02)  # polling the processes, which learn from the store on their own clock
    return time.monotonic() - start


async def on_every_process(session: aiohttp.ClientSession, d: Deployment, key: str, status: int) -> bool:
    # Several calls per process: on --workers 2 each lands on either worker.
    results = await asyncio.gather(*(works(session, d.procs[i % 2], key) for i in range(8)))
    return all(s == status for s in results)


SECRETS: list[str] = []
"""Every secret the module's tests were given: none may be found in files, store or metrics."""


async def create(session: aiohttp.ClientSession, proc: Proc, key: str = ADMIN, **body: Any) -> dict[str, Any]:
    status, made = await api(session, proc, key, "POST", "/v1/admin/keys", {"team": "demo", "name": "ci", **body})
    assert status == 201, made
    SECRETS.append(made["key"])
    return dict(made)


async def test_a_key_works_everywhere_within_a_second_and_revoked_is_refused_everywhere_within_a_second(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, b = deployment.procs
    made = await create(session, a, metadata={"owner": "ana"})
    assert made["key"].startswith("gw-") and len(made["key"]) == 46 and made["prefix"] == made["key"][:9]
    assert made["source"] == "store" and made["team"] == "demo" and made["created_by"].startswith("ops/cfg_")
    assert await until(lambda: on_every_process(session, deployment, made["key"], 200), 5.0) < WITHIN_S
    status, shown = await api(session, b, ADMIN, "GET", f"/v1/admin/keys/{made['id']}")
    assert status == 200 and "key" not in shown and "secret_hash" not in str(shown)
    status, revoked = await api(session, b, ADMIN, "DELETE", f"/v1/admin/keys/{made['id']}")
    assert status == 200 and revoked["revoked_at"] is not None
    assert await until(lambda: on_every_process(session, deployment, made["key"], 401), 5.0) < WITHIN_S
    status, _, reply = await chat(session, a, made["key"], {"model": "keys", "messages": TASK})
    assert status == 401 and "revoked" in reply["error"]["message"]
    status, again = await api(session, a, ADMIN, "DELETE", f"/v1/admin/keys/{made['id']}")
    assert status == 200 and again["revoked_at"] == revoked["revoked_at"]  # idempotent


async def test_a_key_just_created_works_on_every_process_at_once(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, b = deployment.procs
    for creator, other in ((a, b), (b, a), (a, b)):
        made = await create(session, creator)
        assert await works(session, other, made["key"]) == 200  # the next call, on the other process
        assert await on_every_process(session, deployment, made["key"], 200)
    status, _, reply = await chat(session, b, "gw-" + "x" * 43, {"model": "keys", "messages": TASK})
    assert status == 401 and "no team has this key" in reply["error"]["message"]  # unknown stays unknown


async def test_rotating_with_a_grace_keeps_both_secrets_then_only_the_new_one(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, b = deployment.procs
    made = await create(session, a)
    await until(lambda: on_every_process(session, deployment, made["key"], 200), 5.0)
    status, rotated = await api(session, b, ADMIN, "POST", f"/v1/admin/keys/{made['id']}/rotate", {"grace_s": 5})
    assert status == 200, rotated
    SECRETS.append(rotated["key"])
    assert rotated["id"] == made["id"] and rotated["key"] != made["key"] and rotated["previous_valid_until"]
    rotated_at = time.monotonic()
    await until(lambda: on_every_process(session, deployment, rotated["key"], 200), 5.0)
    assert await on_every_process(session, deployment, made["key"], 200)  # still in its grace
    await until(lambda: on_every_process(session, deployment, made["key"], 401), 10.0)
    assert time.monotonic() - rotated_at >= 5.0 - 0.5  # not before the grace ended (the store's clock)
    assert await on_every_process(session, deployment, rotated["key"], 200)
    status, _ = await api(session, a, ADMIN, "POST", f"/v1/admin/keys/{made['id']}/rotate")  # no grace
    assert status == 200


async def test_no_secret_is_written_to_the_store_logs_trace_or_metrics(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, b = deployment.procs
    made = await create(session, a, user="ana", budget_usd=5.0)
    await until(lambda: on_every_process(session, deployment, made["key"], 200), 5.0)
    for proc in (a, b):
        await works(session, proc, made["key"])
        await chat(session, proc, made["key"] + "x", {"model": "keys", "messages": TASK})  # a wrong one, logged?
    async with session.get(a.url + "/metrics") as resp:
        metrics = await resp.text()
    blobs: list[tuple[str, bytes]] = [("metrics", metrics.encode())]
    for path in deployment.folder.rglob("*"):
        if path.is_file():
            blobs.append((str(path), path.read_bytes()))  # logs, trace file, SQLite file and WAL
    if deployment.spec["kind"] == "redis":
        client = redis.Redis.from_url(deployment.spec["url"])
        try:
            for key in client.scan_iter(match=deployment.spec["prefix"] + "*"):
                blobs.append((key.decode(), client.dump(key) or b""))
        finally:
            client.close()
    assert len(blobs) > 4
    for secret in SECRETS:
        for where, data in blobs:
            assert secret.encode() not in data, f"a secret is in {where}"
            assert secret[3:].encode() not in data, f"a secret's random part is in {where}"


async def test_a_key_manager_stays_within_its_team_and_its_own_scope(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, _ = deployment.procs
    status, reply = await api(session, a, DEMO, "POST", "/v1/admin/keys", {"team": "demo", "name": "x"})
    assert status == 403 and reply["error"]["code"] == "not_a_key_manager"
    status, reply = await api(session, a, DEMO, "GET", "/v1/admin/keys")
    assert status == 403 and reply["error"]["code"] == "not_a_key_manager"
    made = await create(session, a, MANAGER, models=["allowed-one"], policies=["passthrough"], budget_usd=10.0)
    assert made["team"] == "demo"
    for body, param in ((dict(models=["*"]), "models"), (dict(models=None), "models"),
                        (dict(budget_usd=51.0), "budget_usd")):
        status, reply = await api(session, a, MANAGER, "POST", "/v1/admin/keys", {"team": "demo", "name": "x", **body})
        assert status == 403 and reply["error"]["code"] == "scope_not_allowed" and reply["error"]["param"] == param
    status, reply = await api(session, a, MANAGER, "POST", "/v1/admin/keys", {"team": "other", "name": "x"})
    assert status == 403 and reply["error"]["code"] == "not_a_key_manager"
    theirs = await create(session, a, ADMIN, team="other")
    status, reply = await api(session, a, MANAGER, "GET", f"/v1/admin/keys/{theirs['id']}")
    assert status == 404 and reply["error"]["code"] == "key_not_found"
    status, reply = await api(session, a, MANAGER, "PATCH", f"/v1/admin/keys/{made['id']}", {"models": ["*"]})
    assert status == 403 and reply["error"]["code"] == "scope_not_allowed"
    # a manager key issued by an admin cannot widen itself
    sub = await create(session, a, ADMIN, manage_keys=True, models=["allowed-one"], budget_usd=2.0)
    await until(lambda: on_every_process(session, deployment, sub["key"], 403), 5.0)  # "keys" is not allowed-one
    for change in ({"models": ["allowed-*"]}, {"budget_usd": 3.0}, {"models": None}):
        status, reply = await api(session, a, sub["key"], "PATCH", f"/v1/admin/keys/{sub['id']}", change)
        assert status == 403 and reply["error"]["code"] in ("cannot_widen_own_key", "scope_not_allowed"), reply
    status, narrowed = await api(session, a, sub["key"], "PATCH", f"/v1/admin/keys/{sub['id']}", {"budget_usd": 1.0})
    assert status == 200 and narrowed["budget_usd"] == 1.0
    status, listed = await api(session, a, MANAGER, "GET", "/v1/admin/keys")
    assert status == 200 and {k["team"] for k in listed["data"]} == {"demo"}
    assert any(k["source"] == "config" and k["manage_keys"] for k in listed["data"])
    status, reply = await api(session, a, MANAGER, "DELETE", f"/v1/admin/keys/{listed['data'][0]['id']}")
    assert status == 409 and reply["error"]["code"] == "key_read_only"  # a config key


async def test_bad_input_is_refused_by_name_and_globs_that_match_nothing_warn(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, _ = deployment.procs
    bad = [
        ({"team": "demo", "name": "x", "colour": "red"}, "colour", "unsupported_field"),
        ({"team": "demo", "name": 7}, "name", "invalid_type"),
        ({"team": "demo", "name": "x" * 101}, "name", "invalid_value"),
        ({"team": "nope", "name": "x"}, "team", "team_not_found"),
        ({"team": "demo", "name": "x", "expires_at": time.time() - 60}, "expires_at", "invalid_value"),
        ({"team": "demo", "name": "x", "expires_at": 1, "expires_in_s": 5}, "expires_in_s", "invalid_value"),
        ({"team": "demo", "name": "x", "budget_usd": -1}, "budget_usd", "invalid_value"),
        ({"team": "demo", "name": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"team": "demo", "name": "x", "policies": ["files-of-others"]}, "policies[0]", "invalid_value"),
        ({"team": "demo", "name": "x", "rate_limits": {"requests_per_minute": 0}},
         "rate_limits.requests_per_minute", "invalid_value"),
        ({"team": "demo", "name": "x", "user": "no spaces"}, "user", "invalid_value"),
        ({"team": "demo"}, "name", "missing_field"),
    ]
    for body, param, code in bad:
        status, reply = await api(session, a, ADMIN, "POST", "/v1/admin/keys", body)
        assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == code, (body, reply)
    status, reply = await api(session, a, ADMIN, "GET", "/v1/admin/keys/key_nope")
    assert status == 404
    status, reply = await api(session, a, ADMIN, "GET", "/v1/admin/keys?limit=0")
    assert status == 400 and reply["error"]["param"] == "limit"
    made = await create(session, a, models=["zzz-*", "allowed-one"])
    assert made["warnings"] == ["model glob 'zzz-*' matches no model this gateway routes"]
    status, reply = await api(session, a, ADMIN, "PATCH", f"/v1/admin/keys/{made['id']}", {})
    assert status == 400


async def test_a_budget_below_what_was_spent_is_allowed_and_refuses_until_the_period_turns(
        deployment: Deployment, session: aiohttp.ClientSession) -> None:
    a, b = deployment.procs
    made = await create(session, a, budget_usd=1.0, budget_period="day")
    await until(lambda: on_every_process(session, deployment, made["key"], 200), 5.0)
    status, shown = await api(session, a, ADMIN, "GET", f"/v1/admin/keys/{made['id']}")
    assert status == 200 and shown["budget"]["spent_usd"] > 0
    status, changed = await api(session, b, ADMIN, "PATCH", f"/v1/admin/keys/{made['id']}", {"budget_usd": 0.0})
    assert status == 200 and changed["budget_usd"] == 0.0
    assert any("refused until the period turns" in w for w in changed["warnings"])
    await until(lambda: on_every_process(session, deployment, made["key"], 429), 5.0)
    status, _, reply = await chat(session, a, made["key"], {"model": "keys", "messages": TASK, "max_tokens": 5})
    assert reply["error"]["type"] == "key_budget_exceeded" and made["id"] in reply["error"]["message"]
