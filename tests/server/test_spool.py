"""Turns paid upstream while the store is down are booked once it is back (the spool).

Two gateway processes (replicas, each with a spool file of its own) share a store that this
test really stops: a durable redis-server (an append-only file, so a restart keeps its data)
or a PostgreSQL cluster of the test's own (its data folder survives `pg_ctl stop`/`start`
on the same port). They front an upstream served by this test that holds its replies until
told: the calls are admitted on both replicas, the store is stopped, the upstream answers;
the clients get their answers, the turns wait in each gateway's spool, a new call forwards
nothing, and once the store is back every turn is booked exactly once: ledger = sum of the
runs' costs = what the upstream's own usage says, to the micro-dollar.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.store import Store, open_store
from gateway.store.base import to_micros
from gateway.tokens import get_counter
from tests.server.test_admission import KEY, TASK, chat, write_config
from tests.store.conftest import _start_redis
from tests.support.postgres import Cluster
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.shared_store import SHARED_KINDS
from tests.support.upstreams import chat_app, serving_app

PRICE = Price(2.0, 12.0)


@dataclass
class HeldUpstream:
    """Answers every call (10 completion tokens) only once `release` is set."""

    url: str = ""
    calls: Counter[str] = field(default_factory=Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    wanted: int = 0
    billed: list[Usage] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls[body["model"]] += 1
        if self.calls[body["model"]] >= self.wanted:
            self.arrived.set()
        await self.release.wait()
        usage = Usage(get_counter().count_request(body["messages"]), 10)
        self.billed.append(usage)
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {**usage.to_json()}})

    async def embed(self, request: web.Request) -> web.Response:
        """Embeddings: 3 input tokens billed (price_in alone), once `release` is set."""
        body = await request.json()
        self.calls[body["model"]] += 1
        if self.calls[body["model"]] >= self.wanted:
            self.arrived.set()
        await self.release.wait()
        self.billed.append(Usage(3, 0))
        return web.json_response({"object": "list", "model": body["model"], "usage": {"prompt_tokens": 3,
                                                                                     "total_tokens": 3},
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]})


def start_redis(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    """A durable redis-server on `port` (its data survives a restart in `workdir`)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    return _start_redis(exe, workdir, port=port, durable=True)[0]


class StoreServer:
    """The store the replicas share, on a server of the test's own that `stop` really stops
    (redis-server terminated; PostgreSQL's fast shutdown, as in a failover) and `start`
    brings back on the same port with its data."""

    def __init__(self, kind: str, folder: Path) -> None:
        self.kind = kind
        self.folder = folder
        self.port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.cluster = Cluster() if kind == "postgres" else None
        if self.cluster is None:
            folder.mkdir()
            self.config: dict[str, Any] = {"kind": "redis", "url": f"redis://127.0.0.1:{self.port}/0",
                                           "prefix": f"spool-{uuid.uuid4().hex[:8]}:"}
        else:
            self.config = self.cluster.store()

    def start(self) -> None:
        if self.cluster is not None:
            self.cluster.start()
        else:
            self.redis = start_redis(self.folder, self.port)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        elif self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)

    def remove(self) -> None:
        if self.cluster is not None:
            self.cluster.remove()
        elif self.redis is not None:
            self.redis.kill()
            self.redis.wait()

    def view(self) -> Store:
        """A client of the store, to read what the gateways booked."""
        return open_store(self.config)


@pytest.fixture(params=SHARED_KINDS)
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreServer]:
    store = StoreServer(request.param, tmp_path / "store")
    store.start()
    try:
        yield store
    finally:
        store.remove()


def start_replica(tmp_path: Path, name: str, held: HeldUpstream, server: StoreServer) -> Proc:
    """A gateway on the shared store, in a folder of its own (its spool file there)."""
    folder, port = tmp_path / name, free_port()
    path = write_config(folder, port, held.url, server.config)
    config = yaml.safe_load(path.read_text())
    config["teams"][0].update(user_budget_usd=5.0, user_budget_period="total")  # a user's hold on each call
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return restart(folder, port)


def restart(folder: Path, port: int, log: str = "gateway.log") -> Proc:
    return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/livez", port, folder / log,
                         timeout=START_TIMEOUT_S)


def spool_of(gateway: Proc) -> Path:
    return gateway.log.parent / "spool.jsonl"


async def replayed(*spools: Path) -> None:
    """Until every spool is empty (the gateways replay on their own; this polls for it)."""
    deadline = time.monotonic() + 20
    while any(s.read_bytes() for s in spools):
        assert time.monotonic() < deadline, "the spool was not replayed"
        await asyncio.sleep(0.1)  # poll interval


@pytest.fixture
async def held() -> AsyncIterator[HeldUpstream]:
    state = HeldUpstream()
    app = chat_app(state.handle)
    app.router.add_post("/v1/embeddings", state.embed)
    async with serving_app(app) as root:
        state.url = root + "/v1"
        yield state
        state.release.set()


async def test_turns_paid_during_a_store_outage_are_booked_once_when_it_returns(
        tmp_path: Path, held: HeldUpstream, server: StoreServer) -> None:
    replicas = [start_replica(tmp_path, "gw-a", held, server), start_replica(tmp_path, "gw-b", held, server)]
    runs = [f"outage-{i}" for i in range(6)]
    held.wanted = len(runs)
    try:
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(chat(session, replicas[i % 2], KEY, {"model": "paid", "messages": TASK},
                                                {"X-Run-Id": run_id})) for i, run_id in enumerate(runs)]
            await asyncio.wait_for(held.arrived.wait(), 30)  # all admitted and forwarded
            server.stop()
            held.release.set()  # the upstream answers: these turns are paid, the store is gone
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * len(runs), results
            assert [reply["run"]["turns"] for _, _, reply in results] == [1] * len(runs), results
            spools = [spool_of(gw) for gw in replicas]
            assert [len(s.read_bytes().splitlines()) for s in spools] == [3, 3]  # each replica's own turns

            for gw in replicas:
                status, headers, reply = await chat(session, gw, KEY, {"model": "down", "messages": TASK})
                assert status >= 500, reply
                assert "Error" not in reply["error"]["message"]
            assert held.calls["down"] == 0  # nothing forwarded while the store is down

            server.start()
            await replayed(*spools)
        store = server.view()
        try:
            costs = []
            for run_id in runs:
                run = await store.load_run(scoped_run_id("adm", run_id))
                assert run is not None and run.turns == 1, run_id
                costs.append(to_micros(run.cost_usd, "cost"))
            spent, reserved = await store.team_spend("adm", "total")
            events = [e for _, e in await store.events(scoped_run_id("adm", runs[0]))]
        finally:
            await store.close()
        billed = sum(to_micros(PRICE.cost(u), "cost") for u in held.billed)
        assert (to_micros(spent, "spent"), sum(costs)) == (billed, billed) and reserved == 0.0
        assert [e["type"] for e in events].count("turn") == 1
    finally:
        for gw in replicas:
            gw.stop()


async def test_turns_spooled_before_a_restart_are_booked_after_it(tmp_path: Path, held: HeldUpstream,
                                                                  server: StoreServer) -> None:
    """Replica A is killed while its turns wait in the spool; the store comes back, replica B
    (alive all along) replays its own; A starts again (the same address: the same owner
    name, whose earlier holds it releases at start). A's spooled turns' reservations are not
    released with the rest, nor their user's holds, nor B's: each replay books its turns
    once, and the team's ledger, the user's and the user's spend rows all equal what the
    upstream billed."""
    replicas = [start_replica(tmp_path, "gw-a", held, server), start_replica(tmp_path, "gw-b", held, server)]
    runs = [f"restart-{i}" for i in range(4)]
    held.wanted = len(runs)
    spools = [spool_of(gw) for gw in replicas]
    try:
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(chat(session, replicas[i % 2], KEY, {"model": "paid", "messages": TASK},
                                                {"X-Run-Id": run_id, "X-Gateway-User": "ana"}))
                     for i, run_id in enumerate(runs)]
            await asyncio.wait_for(held.arrived.wait(), 30)
            server.stop()
            held.release.set()
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * len(runs), results
        assert [len(s.read_bytes().splitlines()) for s in spools] == [2, 2]
        replicas[0].kill()  # SIGKILL: the spool is all that remembers A's turns

        server.start()
        await replayed(spools[1])  # B, alive, replays its turns on its own
        replicas[0] = restart(spools[0].parent, int(replicas[0].url.rsplit(":", 1)[1]), "gateway-2.log")
        await replayed(*spools)
        store = server.view()
        try:
            runs_micros = 0
            for run_id in runs:
                run = await store.load_run(scoped_run_id("adm", run_id))
                assert run is not None and run.turns == 1, run_id
                runs_micros += to_micros(run.cost_usd, "cost")
            spent, reserved = await store.team_spend("adm", "total")
            user_spent, user_reserved = await store.team_spend("user:adm:ana", "total")
            rows = await store.spend("1970-01-01", "2999-12-31", "adm")
        finally:
            await store.close()
        billed = sum(to_micros(PRICE.cost(u), "cost") for u in held.billed)
        assert (to_micros(spent, "spent"), runs_micros) == (billed, billed) and reserved == 0.0
        assert to_micros(user_spent, "spent") == billed and user_reserved == 0.0
        assert sum(r.cost_micros for r in rows if r.user == "ana") == billed
    finally:
        for gw in replicas:
            gw.stop()


async def test_embeddings_paid_during_a_store_outage_are_booked_when_it_returns(
        tmp_path: Path, held: HeldUpstream, server: StoreServer) -> None:
    """Embeddings admitted on both replicas, then the store goes, then the upstream answers: a
    call without a run is answered and its spend spooled; a call on a run, whose step on the
    run fails, answers 503 `store_unavailable` but its spend is spooled too. Once the store
    is back, the team's ledger and the user's equal what the upstream billed, nothing left
    reserved."""
    replicas = [start_replica(tmp_path, "gw-a", held, server), start_replica(tmp_path, "gw-b", held, server)]
    headers = [{"X-Run-Id": f"emb-{i}"} for i in range(3)] + [{}, {}]
    held.wanted = len(headers)
    spools = [spool_of(gw) for gw in replicas]
    try:
        async with aiohttp.ClientSession() as session:

            async def embed(gw: Proc, extra: dict[str, str]) -> tuple[int, Any]:
                async with session.post(f"{gw.url}/v1/embeddings", json={"model": "vec", "input": "hello"},
                                        headers={"Authorization": f"Bearer {KEY}", "X-Gateway-User": "ana",
                                                 **extra}) as resp:
                    return resp.status, await resp.json()

            calls = [asyncio.ensure_future(embed(replicas[i % 2], h)) for i, h in enumerate(headers)]
            await asyncio.wait_for(held.arrived.wait(), 30)
            server.stop()
            held.release.set()
            results = await asyncio.gather(*calls)
        on_runs, alone = results[:3], results[3:]
        assert [s for s, _ in alone] == [200, 200], alone
        assert all(s == 503 and r["error"]["code"] == "store_unavailable" for s, r in on_runs), on_runs
        assert [len(s.read_bytes().splitlines()) for s in spools] == [3, 2]

        server.start()
        await replayed(*spools)
        store = server.view()
        try:
            spent, reserved = await store.team_spend("adm", "total")
            user_spent, user_reserved = await store.team_spend("user:adm:ana", "total")
        finally:
            await store.close()
        billed = sum(to_micros(PRICE.cost(u), "cost") for u in held.billed)
        assert len(held.billed) == len(headers)
        assert (to_micros(spent, "spent"), to_micros(user_spent, "spent")) == (billed, billed)
        assert reserved == user_reserved == 0.0
    finally:
        for gw in replicas:
            gw.stop()
