"""Admission holds under concurrency, across replicas and against a lying upstream.

Real gateway processes (one on SQLite, two on one real redis-server) in front of a real
HTTP upstream served by this test (so it can count what reaches it, bill every choice of
`n`, or report absurd usage):

- 64 concurrent calls on one run with `max_turns: 20`, split over two replicas: exactly 20
  reach the upstream, the rest are refused before anything is forwarded;
- a strict team budget is never passed by calls asking `n=8` choices, on two replicas;
- 48 concurrent first calls on one new run: every call that was forwarded is answered and
  booked (none is refused after it was paid), and the ledger equals the run's cost;
- an upstream reporting 1e9/1e9 tokens is booked at the gateway's own count, traced and
  counted as `usage_clamped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.store import Store
from gateway.store.sqlite import SqliteStore
from gateway.tokens import get_counter
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.shared_store import SHARED_KINDS, shared_store, view
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import chat_app, in_thread, serving  # serving: other tests import it from here

KEY, THRIFTY = "sk-adm", "sk-thrifty"
PRICE = Price(2.0, 12.0)
TASK = [{"role": "user", "content": "Say ok."}]
PER_CHOICE = 10
"""Completion tokens one choice of the counting upstream bills when `max_tokens` allows."""


@dataclass
class Upstream:
    """An OpenAI-compatible upstream that counts the calls reaching it, by model."""

    url: str = ""
    calls: Counter[str] = field(default_factory=Counter)
    delay_s: dict[str, float] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    """Models whose calls get no answer while they are in this set (the test lets them go)."""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        model, n = body["model"], int(body.get("n") or 1)
        self.calls[model] += 1
        await asyncio.sleep(self.delay_s.get(model, 0.05))  # the upstream's own latency: calls overlap in flight
        while model in self.held:
            await asyncio.sleep(0.01)  # polling the test's release (a set shared across threads)
        prompt = get_counter().count_request(body["messages"], body.get("tools"))
        if model == "liar":
            usage = {"prompt_tokens": 10**9, "completion_tokens": 10**9, "total_tokens": 2 * 10**9}
        else:  # "many" writes every choice up to its max_tokens, as a long answer would
            cap = body.get("max_tokens") or PER_CHOICE
            per_choice = cap if model == "many" else min(PER_CHOICE, cap)
            usage = {"prompt_tokens": prompt, "completion_tokens": n * per_choice,
                     "total_tokens": prompt + n * per_choice}
        choices = [{"index": i, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                   for i in range(n)]
        return web.json_response({"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
                                  "choices": choices, "usage": usage})


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    """One counting upstream for the module's tests (each test asks for models of its own
    names, so the counts it reads are its own)."""
    state = Upstream()
    with in_thread(lambda: chat_app(state.handle)) as root:
        state.url = root + "/v1"
        yield state


def write_policies(parent: Path) -> Path:
    """The shipped policies plus `wide` and `brief`, once per folder (replicas share them)."""
    policies = parent / "policies"
    if policies.exists():
        return policies
    staging = parent / f"policies-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    for path in (ROOT / "policies").glob("*.yaml"):
        (staging / path.name).write_text(path.read_text())
    (staging / "wide.yaml").write_text(yaml.safe_dump(
        {"name": "wide", "description": "pass-through with room for many turns",
         "limits": {"max_turns": 100, "max_budget_usd": None}}))
    (staging / "brief.yaml").write_text(yaml.safe_dump(
        {"name": "brief", "description": "pass-through runs that last a second and a half",
         "limits": {"max_turns": 100, "max_duration_s": 1.5}}))
    try:
        staging.rename(policies)  # atomic: a replica started at the same time sees all or nothing
    except OSError:  # the other replica's thread got there first: the same files
        shutil.rmtree(staging)
    return policies


def write_config(folder: Path, port: int, upstream_url: str, store: dict[str, Any], budget_usd: float = 10.0,
                 lease_ttl_s: float = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    policies = write_policies(folder.parent)
    config = {
        "server": {"host": "127.0.0.1", "port": port, "lease_ttl_s": lease_ttl_s},
        "store": store,
        "policies_dir": str(policies),
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "counting", "base_url": upstream_url}],
        "models": [{"match": "*", "upstream": "counting", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "adm", "keys": [KEY], "budget_usd": budget_usd, "budget_period": "total",
             "policies": ["passthrough", "wide", "brief", "files"]},
            {"name": "thrifty", "keys": [THRIFTY], "budget_usd": 0.01, "budget_period": "total",
             "budget_mode": "strict", "policies": ["passthrough"]},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(folder: Path, upstream_url: str, store: dict[str, Any], budget_usd: float = 10.0,
          lease_ttl_s: float = 5) -> Proc:
    port = free_port()
    config = write_config(folder, port, upstream_url, store, budget_usd, lease_ttl_s)
    return start_gateway(["serve", "--config", str(config)], "/healthz", port, folder / "gateway.log",
                         timeout=START_TIMEOUT_S)


@contextlib.contextmanager
def two_replicas(starter: Callable[[Path, str, dict[str, Any]], Proc], tmp_path: Path, upstream_url: str,
                 store: dict[str, Any]) -> Iterator[tuple[Proc, Proc]]:
    """Two gateway processes on one store, started at once by `starter(folder, upstream_url,
    store)`; stopped at the end, and the other one too when one fails to start."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(starter, tmp_path / name, upstream_url, store) for name in ("a", "b")]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:  # one failed to start: stop the other, then fail with the reason
            for f in futures:
                f.result()
        yield started[0], started[1]
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="module", params=SHARED_KINDS)
def replicas(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
             upstream: Upstream) -> Iterator[tuple[Proc, Proc, dict[str, Any]]]:
    """Two replicas on one redis-server (or one PostgreSQL), shared by the module's tests (of
    distinct teams); the store's config."""
    store = shared_store(request.param, request, "adm")
    with two_replicas(start, tmp_path_factory.mktemp("pair"), upstream.url, store) as (a, b):
        yield a, b, store


@pytest.fixture
def pair(replicas: tuple[Proc, Proc, dict[str, Any]], upstream: Upstream) -> tuple[Proc, Proc, Store]:
    """The module's two replicas, and a view of their store for this test; the upstream's
    counts start over (a test runs once per store kind, and reads the counts of its own model)."""
    a, b, store = replicas
    upstream.calls.clear()
    return a, b, view(store)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[Proc]:
    """One gateway on SQLite for the module's tests (`database(single)` is its file)."""
    proc = start(tmp_path_factory.mktemp("single") / "one", upstream.url, {"kind": "sqlite", "path": "./gateway.db"})
    yield proc
    proc.stop()


def database(proc: Proc) -> Path:
    """The SQLite file of a gateway `start`ed with the store at ./gateway.db."""
    return proc.log.parent / "gateway.db"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def chat(session: aiohttp.ClientSession, proc: Proc, key: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with session.post(f"{proc.url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {key}", **(headers or {})}) as resp:
        return resp.status, dict(resp.headers), orjson.loads(await resp.read())


async def test_a_turn_cap_is_exact_across_two_replicas(pair: tuple[Proc, Proc, Store], upstream: Upstream,
                                                       session: aiohttp.ClientSession) -> None:
    a, b, store = pair
    run_id = f"cap-{uuid.uuid4().hex[:8]}"
    body = {"model": "cap", "messages": TASK}
    results = await asyncio.gather(*(chat(session, (a, b)[i % 2], KEY, body, {"X-Run-Id": run_id})
                                     for i in range(64)))
    statuses = Counter(status for status, _, _ in results)
    assert upstream.calls["cap"] == 20  # forwarded: exactly the cap
    assert statuses == {200: 20, 429: 44}, statuses
    for status, headers, reply in results:
        if status == 429:
            assert reply["error"]["type"] == "max_turns_exceeded" and headers["x-should-retry"] == "false"
    run = await store.load_run(scoped_run_id("adm", run_id))
    assert run is not None and run.turns == 20
    spent, reserved = await store.team_spend("adm", "total")
    assert reserved == 0.0 and spent == pytest.approx(run.cost_usd, abs=1e-6)
    await store.close()


async def test_a_strict_team_budget_holds_with_n_choices_on_two_replicas(
        pair: tuple[Proc, Proc, Store], upstream: Upstream, session: aiohttp.ClientSession) -> None:
    a, b, store = pair
    results = await asyncio.gather(*(chat(session, (a, b)[i % 2], THRIFTY, {"model": "many", "messages": TASK, "n": 8})
                                     for i in range(24)))
    ok = [headers for status, headers, _ in results if status == 200]
    refused = [reply for status, _, reply in results if status != 200]
    assert ok and refused and upstream.calls["many"] == len(ok)
    assert all(r["error"]["type"] == "team_budget_exceeded" for r in refused), refused
    spent, reserved = await store.team_spend("thrifty", "total")
    assert reserved == 0.0 and spent <= 0.01 + 1e-9, spent
    assert spent == pytest.approx(sum(float(h["X-Run-Cost-Usd"]) for h in ok), abs=1e-6)
    await store.close()


async def test_concurrent_first_calls_of_a_new_run_are_each_paid_and_booked(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    run_id = f"storm-{uuid.uuid4().hex[:8]}"
    body = {"model": "storm", "messages": TASK}
    store = SqliteStore(database(single))
    spent_before, _ = await store.team_spend("adm", "total")  # the module's other tests' spending
    results = await asyncio.gather(*(chat(session, single, KEY, body, {"X-Run-Id": run_id, "X-Policy": "wide"})
                                     for _ in range(48)))
    assert [status for status, _, _ in results] == [200] * 48, [r for s, _, r in results if s != 200][:3]
    assert upstream.calls["storm"] == 48
    run = await store.load_run(scoped_run_id("adm", run_id))
    assert run is not None and run.turns == 48
    spent, reserved = await store.team_spend("adm", "total")
    assert reserved == 0.0 and spent - spent_before == pytest.approx(run.cost_usd, abs=1e-6)
    await store.close()


async def clamped_total(session: aiohttp.ClientSession, proc: Proc) -> dict[str, float]:
    """gateway_usage_clamped_total of the counting upstream, by kind."""
    async with session.get(f"{proc.url}/metrics") as r:
        text = await r.text()
    found = {}
    for kind in ("prompt", "completion"):
        prefix = f'gateway_usage_clamped_total{{kind="{kind}",upstream="counting"}} '
        found[kind] = next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)
    return found


async def test_absurd_upstream_usage_is_booked_at_the_gateways_count(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    before = await clamped_total(session, single)  # the module's other tests' clamps
    status, headers, reply = await chat(session, single, KEY, {"model": "liar", "messages": TASK, "max_tokens": 50},
                                        {"X-Run-Id": "liar-1"})
    assert status == 200, reply
    prompt = get_counter().count_request(TASK)
    expected = PRICE.cost(Usage(prompt, get_counter().count_completion({"content": "ok"})))
    assert float(headers["X-Run-Cost-Usd"]) == pytest.approx(expected, abs=1e-9)
    async with session.get(f"{single.url}/v1/runs/liar-1/events", headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = [orjson.loads(line) for line in (await r.read()).splitlines()]
    clamped = [e for e in events if e["type"] == "usage_clamped"]
    assert len(clamped) == 1 and clamped[0]["reported"]["prompt_tokens"] == 10**9
    assert clamped[0]["kinds"] == ["prompt", "completion"]
    after = await clamped_total(session, single)
    assert {kind: after[kind] - before[kind] for kind in after} == {"prompt": 1.0, "completion": 1.0}


@dataclass
class Hanging(Upstream):
    """An upstream whose "hang" calls never answer: they stay in flight until the caller dies."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    wanted: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["model"] != "hang":
            return await super().handle(request)
        self.calls["hang"] += 1
        if self.calls["hang"] >= self.wanted:
            self.arrived.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


CRASH_LEASE_S = 2
"""server.lease_ttl_s of the crash test: how long a dead process's holds may last."""


@pytest.mark.parametrize("same_address", [True, False], ids=["restarted-in-place", "another-process"])
async def test_a_crash_under_load_blocks_the_team_no_longer_than_the_lease(
        tmp_path: Path, session: aiohttp.ClientSession, same_address: bool) -> None:
    hanging = Hanging(wanted=32)
    async with serving(hanging.handle) as url:
        store = {"kind": "sqlite", "path": "./gateway.db"}
        first = start(tmp_path / "one", url, store, budget_usd=1.0, lease_ttl_s=CRASH_LEASE_S)
        try:
            # 32 calls of team adm ($1 budget) in flight, each holding its prompt + 2,600 tokens:
            # the whole budget is held when the process dies.
            flying = [asyncio.ensure_future(chat(session, first, KEY, {"model": "hang", "messages": TASK,
                                                                       "max_tokens": 2600}))
                      for _ in range(32)]
            await asyncio.wait_for(hanging.arrived.wait(), 30)
            held = await SqliteStore(tmp_path / "one" / "gateway.db").team_spend("adm", "total")
            assert held[1] > 0.99  # 32 x (prompt + 2,600 tokens): nothing is left for another call
            first.kill()
            for task in flying:
                task.cancel()
            await asyncio.gather(*flying, return_exceptions=True)
            if same_address:
                port = int(first.url.rsplit(":", 1)[1])
                config = tmp_path / "one" / "config.yaml"
                second = start_gateway(["serve", "--config", str(config)], "/healthz", port,
                                       tmp_path / "one" / "2.log", timeout=START_TIMEOUT_S)
            else:
                second = start(tmp_path / "two", url, {"kind": "sqlite", "path": str(tmp_path / "one" / "gateway.db")},
                               budget_usd=1.0, lease_ttl_s=CRASH_LEASE_S)
            try:
                loop = asyncio.get_running_loop()
                crashed_at = loop.time()
                store_view = SqliteStore(tmp_path / "one" / "gateway.db")
                if same_address:  # its own holds were released at start, before it answered /healthz
                    assert (await store_view.team_spend("adm", "total"))[1] == 0
                while (await store_view.team_spend("adm", "total"))[1] > 0:
                    # the acceptance bound: server.lease_ttl_s + 5 s
                    assert loop.time() - crashed_at < CRASH_LEASE_S + 5, "the dead process's holds outlived its lease"
                    await asyncio.sleep(0.1)  # polling the ledger, as an operator's dashboard would
                status, _, reply = await chat(session, second, KEY, {"model": "ok", "messages": TASK})
                assert status == 200, reply
                await store_view.close()
            finally:
                second.stop()
        finally:
            first.stop()


async def test_a_pass_through_run_past_its_wall_clock_cap_is_refused(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    headers = {"X-Run-Id": f"brief-{uuid.uuid4().hex[:8]}", "X-Policy": "brief"}
    status, _, _ = await chat(session, single, KEY, {"model": "brief", "messages": TASK}, headers)
    assert status == 200
    await asyncio.sleep(1.6)  # the cap is wall-clock time: let it pass
    status, got, reply = await chat(session, single, KEY, {"model": "brief", "messages": TASK}, headers)
    assert status == 429 and reply["error"]["type"] == "max_duration_exceeded", reply
    assert got["X-Run-Status"] == "max_duration_exceeded" and got["x-should-retry"] == "false"
    assert upstream.calls["brief"] == 1


async def test_run_ids_are_per_team(single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """Two teams give the same X-Run-Id: two runs, each its team's, neither blocking the other."""
    for key in (KEY, THRIFTY, KEY):
        status, headers, reply = await chat(session, single, key, {"model": "shared", "messages": TASK},
                                            {"X-Run-Id": "same-id"})
        assert status == 200 and headers["X-Run-Id"] == "same-id" and reply["run"]["id"] == "same-id", reply
    turns = {}
    for key, team in ((KEY, "adm"), (THRIFTY, "thrifty")):
        async with session.get(f"{single.url}/v1/runs/same-id", headers={"Authorization": f"Bearer {key}"}) as r:
            shown = orjson.loads(await r.read())
        assert r.status == 200 and shown["id"] == "same-id" and shown["team"] == team, shown
        turns[team] = shown["turns"]
    assert turns == {"adm": 2, "thrifty": 1}
    store = SqliteStore(database(single))
    try:  # (the module's other tests keep runs of other ids in this database)
        assert {r.run_id for r in await store.list_runs() if "same-id" in r.run_id} == {"adm/same-id",
                                                                                       "thrifty/same-id"}
    finally:
        await store.close()


async def test_a_call_longer_than_the_lease_keeps_its_reservation(tmp_path: Path, upstream: Upstream,
                                                                  session: aiohttp.ClientSession) -> None:
    """Holds live `server.lease_ttl_s` (1 s here) and are renewed while their call is in flight:
    a call the upstream holds until the test lets it go keeps the team's budget held the whole
    time, so a second call that would overspend is refused until the first one is booked."""
    proc = start(tmp_path / "slow", upstream.url, {"kind": "sqlite", "path": "./gateway.db"}, budget_usd=0.05,
                 lease_ttl_s=1)
    upstream.held.add("slow")
    try:
        body = {"model": "slow", "messages": TASK, "max_tokens": 3000}  # holds ~$0.036 of the $0.05
        first = asyncio.ensure_future(chat(session, proc, KEY, body))
        while upstream.calls["slow"] == 0:
            await asyncio.sleep(0.01)  # until the first call is in flight at the upstream
        await asyncio.sleep(2.0)  # twice the hold's ttl: only renewals keep it
        status, _, reply = await chat(session, proc, KEY, {"model": "ok", "messages": TASK, "max_tokens": 3000})
        assert status == 429 and reply["error"]["type"] == "team_budget_exceeded", reply
        assert not first.done()  # still in flight: the refusal was the renewed hold's
        upstream.held.discard("slow")
        assert (await first)[0] == 200
        status, _, reply = await chat(session, proc, KEY, {"model": "ok", "messages": TASK, "max_tokens": 3000})
        assert status == 200, reply  # the first call is booked at its real (small) cost: room again
    finally:
        upstream.held.discard("slow")
        proc.stop()


async def test_a_server_side_turn_with_absurd_usage_is_booked_at_the_gateways_count(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    status, headers, reply = await chat(session, single, KEY, {"model": "liar", "messages": TASK},
                                        {"X-Run-Id": "liar-ss", "X-Policy": "files"})
    assert status == 200 and reply["run"]["status"] == "completed", reply
    assert float(headers["X-Run-Cost-Usd"]) < 0.01  # not the $14,000 the upstream claimed
    async with session.get(f"{single.url}/v1/runs/liar-ss/events", headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = [orjson.loads(line) for line in (await r.read()).splitlines()]
    clamped = [e for e in events if e["type"] == "usage_clamped"]
    assert len(clamped) == 1 and clamped[0]["kinds"] == ["prompt", "completion"]
    assert clamped[0]["upstream"] == "counting" and clamped[0]["reported"]["completion_tokens"] == 10**9
