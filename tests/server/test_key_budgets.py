"""Keys' and users' budgets and model access against real gateway processes: two replicas on
one redis-server, and `--workers 2` on one SQLite file, in front of a real HTTP upstream that
bills calls of known cost.

- a key's budget and a user's budget are held in the admission step with the team's: under
  64 concurrent calls across replicas, with budget B and calls of cost c (the hold sized
  exactly: `max_tokens` is what the upstream bills), exactly floor(B / c) are served, the
  rest refused `key_budget_exceeded` / `user_budget_exceeded` with `x-should-retry: false`
  before anything is forwarded, and nothing is left held;
- a key with a `user` cannot be overridden by the body or the header;
- team and key `models:` allow-lists: 403 `model_not_allowed` naming the model, nothing
  forwarded; `GET /v1/models` lists only what the caller may use;
- every booked call is in the spend rows, attributed to its key, user, model and policy, and
  they sum to the team's ledger to the micro-dollar.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.config.keys import config_key_id, key_scope_of
from gateway.harness.usage import Usage
from gateway.store.base import Hold, Store, spend_day
from gateway.tokens import get_counter
from tests.server.test_admission import (  # noqa: F401  (session, upstream: the fixtures of the admission tests)
    PRICE,
    TASK,
    Upstream,
    chat,
    session,
    two_replicas,
    upstream,
    write_policies,
)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.shared_store import SHARED_KINDS, shared_store, view
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway

KEYED, USERS, FIXED, NARROW, WIDE_KEY = "sk-kb", "sk-ub", "sk-fixed", "sk-narrow", "sk-narrow-key"
PER_CALL = 10
"""Completion tokens the counting upstream bills a call with `max_tokens: 10`: its hold is its cost."""
COST = PRICE.cost(Usage(get_counter().count_request(TASK), PER_CALL))
BUDGET = COST * 7.5
"""Room for exactly 7 calls."""


def write_config(folder: Path, port: int, upstream_url: str, store: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    team = {"budget_usd": 100.0, "budget_period": "total", "policies": ["passthrough"]}
    route = {"upstream": "counting", "price_in": 2.0, "price_out": 12.0}
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store,
        "policies_dir": str(write_policies(folder.parent)),
        "upstreams": [{"name": "counting", "base_url": upstream_url}],
        "models": [{"match": "allowed-one", **route}, {"match": "other", **route}, {"match": "*", **route}],
        "teams": [
            {"name": "kb", "keys": [{"key": KEYED, "budget_usd": BUDGET, "budget_period": "total"}], **team},
            {"name": "ub", "keys": [USERS, {"key": FIXED, "user": "carol"}], "user_budget_usd": BUDGET,
             "user_budget_period": "week", **team},
            {"name": "narrow", "keys": [NARROW, {"key": WIDE_KEY, "models": ["allowed-one"]}],
             "models": ["allowed-*", "other"], **team},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def starter(write: Callable[[Path, int, str, dict[str, Any]], Path]) -> Starter:
    """A module's `start`: a gateway of the config `write(folder, port, upstream_url, store)` makes."""

    def start(folder: Path, upstream_url: str, store: dict[str, Any], workers: int = 1) -> Proc:
        port = free_port()
        config = write(folder, port, upstream_url, store)
        return start_gateway(["serve", "--config", str(config), "--workers", str(workers)], "/healthz", port,
                             folder / "gateway.log", timeout=START_TIMEOUT_S)

    return start


Starter = Callable[..., Proc]
"""`start(folder, upstream_url, store, workers=1)` of a test module."""
start = starter(write_config)


class Deployment:
    """Two processes on one store (replicas on Redis, or workers of one SQLite gateway), the
    store's settings, the folder everything is in, and views of that store for the test."""

    def __init__(self, procs: tuple[Proc, Proc], store: dict[str, Any], folder: Path) -> None:
        self.procs = procs
        self.spec = store
        self.folder = folder

    def store(self) -> Store:
        return view(self.spec)


@contextlib.contextmanager
def deployed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, starter: Starter,
             upstream_url: str) -> Iterator[Deployment]:
    """The module's deployment for `request.param`: "redis" or "postgres" (two replicas on one
    redis-server, one PostgreSQL) or "sqlite-workers" (one gateway with `--workers 2` on a SQLite file)."""
    folder = tmp_path_factory.mktemp(str(request.param))
    if request.param in SHARED_KINDS:
        store: dict[str, Any] = shared_store(str(request.param), request, "d")
        with two_replicas(starter, folder, upstream_url, store) as (a, b):
            yield Deployment((a, b), store, folder)
        return
    store = {"kind": "sqlite", "path": str(folder / "gateway.db")}
    proc = starter(folder / "one", upstream_url, store, workers=2)
    try:
        yield Deployment((proc, proc), store, folder)  # the kernel spreads the calls over both workers
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=[*SHARED_KINDS, "sqlite-workers"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               upstream: Upstream) -> Iterator[Deployment]:
    with deployed(request, tmp_path_factory, start, upstream.url) as d:
        yield d


async def storm(session: aiohttp.ClientSession, d: Deployment, key: str, model: str, **extra: Any
                ) -> list[tuple[int, dict[str, str], Any]]:
    body = {"model": model, "messages": TASK, "max_tokens": PER_CALL, **extra}
    return await asyncio.gather(*(chat(session, d.procs[i % 2], key, body) for i in range(64)))


def refused_as(results: list[tuple[int, dict[str, str], Any]], kind: str) -> int:
    out = 0
    for status, headers, reply in results:
        if status != 200:
            assert status == 429 and reply["error"]["type"] == kind and reply["error"]["code"] == kind, reply
            assert headers["x-should-retry"] == "false"
            out += 1
    return out


async def test_a_keys_budget_serves_exactly_what_fits_under_64_concurrent_calls(
        deployment: Deployment, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    model = f"kb-{uuid.uuid4().hex[:6]}"
    results = await storm(session, deployment, KEYED, model)
    assert Counter(s for s, _, _ in results) == {200: 7, 429: 57}
    assert refused_as(results, "key_budget_exceeded") == 57
    assert upstream.calls[model] == 7  # nothing refused reached the upstream
    store = deployment.store()
    try:
        scope = key_scope_of(config_key_id(KEYED))
        figures = await store.figures("kb", "total", None, (Hold("key", scope, "total", BUDGET),))
        assert figures.holds[0] == (pytest.approx(7 * COST, abs=1e-6), 0.0)  # spent <= budget, nothing held
        today = spend_day(time.time())
        rows = [r for r in await store.spend(today, today, "kb") if r.model == model]
        assert [(r.key, r.user, r.policy, r.calls) for r in rows] == [(config_key_id(KEYED), "", "passthrough", 7)]
        spent, _ = await store.team_spend("kb", "total")
        every = await store.spend(today, today, "kb")
        assert sum(r.cost_micros for r in every) == round(spent * 1_000_000)  # the ledger, to the micro-dollar
    finally:
        await store.close()


async def test_a_users_budget_serves_exactly_what_fits_and_other_users_go_on(
        deployment: Deployment, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    model = f"ub-{uuid.uuid4().hex[:6]}"
    user = f"ana-{uuid.uuid4().hex[:6]}"
    results = await storm(session, deployment, USERS, model, user=user)
    assert Counter(s for s, _, _ in results) == {200: 7, 429: 57}
    assert refused_as(results, "user_budget_exceeded") == 57
    assert user in results[[s for s, _, _ in results].index(429)][2]["error"]["message"]
    status, _, reply = await chat(session, deployment.procs[0], USERS,
                                  {"model": model, "messages": TASK, "max_tokens": PER_CALL},
                                  {"X-Gateway-User": f"bob-{uuid.uuid4().hex[:6]}"})
    assert status == 200, reply  # another user of the team has a budget of their own
    assert upstream.calls[model] == 8


async def test_a_keys_user_cannot_be_overridden(deployment: Deployment, session: aiohttp.ClientSession) -> None:
    proc = deployment.procs[0]
    body = {"model": "fixed", "messages": TASK, "max_tokens": PER_CALL}
    status, _, reply = await chat(session, proc, FIXED, {**body, "user": "mallory"})
    assert status == 403 and reply["error"]["code"] == "user_not_allowed" and reply["error"]["param"] == "user"
    status, _, reply = await chat(session, proc, FIXED, body, {"X-Gateway-User": "mallory"})
    assert status == 403 and reply["error"]["param"] == "X-Gateway-User"
    status, _, reply = await chat(session, proc, FIXED, {**body, "user": "carol"})
    assert status == 200, reply
    status, _, reply = await chat(session, proc, USERS, {**body, "user": "no spaces allowed"})
    assert status == 400 and reply["error"]["param"] == "user"


async def test_models_outside_the_allow_lists_are_refused_before_anything_is_counted(
        deployment: Deployment, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    proc = deployment.procs[0]
    forbidden = f"gpt-{uuid.uuid4().hex[:6]}"
    status, _, reply = await chat(session, proc, NARROW, {"model": forbidden, "messages": TASK})
    assert status == 403 and reply["error"]["code"] == "model_not_allowed" and forbidden in reply["error"]["message"]
    status, _, reply = await chat(session, proc, WIDE_KEY, {"model": "other", "messages": TASK})
    assert status == 403 and reply["error"]["code"] == "model_not_allowed" and "this key" in reply["error"]["message"]
    assert upstream.calls[forbidden] == 0
    status, _, reply = await chat(session, proc, NARROW, {"model": "other", "messages": TASK, "max_tokens": 5})
    assert status == 200, reply
    async with session.post(f"{proc.url}/v1/embeddings", json={"model": forbidden, "input": "x"},
                            headers={"Authorization": f"Bearer {NARROW}"}) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "model_not_allowed"
    listed = {}
    for key in (NARROW, WIDE_KEY, KEYED):
        async with session.get(f"{proc.url}/v1/models", headers={"Authorization": f"Bearer {key}"}) as resp:
            listed[key] = sorted(m["id"] for m in (await resp.json())["data"])
    assert listed == {NARROW: ["allowed-one", "other"], WIDE_KEY: ["allowed-one"], KEYED: ["allowed-one", "other"]}
    async with session.get(f"{proc.url}/v1/models/other", headers={"Authorization": f"Bearer {WIDE_KEY}"}) as resp:
        assert resp.status == 404


async def test_the_spend_api_totals_equal_the_ledgers(deployment: Deployment, session: aiohttp.ClientSession) -> None:
    proc = deployment.procs[0]
    status, _, reply = await chat(session, proc, USERS, {"model": "spend-x", "messages": TASK, "max_tokens": PER_CALL},
                                  {"X-Gateway-User": "dora"})
    assert status == 200, reply
    store = deployment.store()
    try:
        for team, key in (("kb", KEYED), ("ub", USERS)):
            async with session.get(f"{proc.url}/v1/spend?group_by=key,user,model,policy,day",
                                   headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 200
                body = await resp.json()
            spent, _ = await store.team_spend(team, "total")
            assert body["team"] == team and body["total_micros"] == round(spent * 1_000_000) > 0
            assert sum(e["cost_micros"] for e in body["data"]) == body["total_micros"]
            assert all(e["policy"] == "passthrough" for e in body["data"])
        async with session.get(f"{proc.url}/v1/spend?group_by=user,model&format=csv",
                               headers={"Authorization": f"Bearer {USERS}"}) as resp:
            assert resp.status == 200 and resp.content_type == "text/csv"
            lines = (await resp.text()).splitlines()
        assert lines[0] == "user,model,cost_usd,calls" and any(line.startswith("dora,spend-x,") for line in lines)
        async with session.get(f"{proc.url}/v1/spend?team=kb", headers={"Authorization": f"Bearer {USERS}"}) as resp:
            assert resp.status == 403  # a team sees its own spend only
        async with session.get(f"{proc.url}/v1/spend?group_by=colour",
                               headers={"Authorization": f"Bearer {USERS}"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "group_by"
    finally:
        await store.close()
