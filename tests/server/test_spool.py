"""Turns paid upstream while the store is down are booked once it is back (the spool).

A real gateway on a real redis-server (with an append-only file, so a restart keeps its
data) in front of an upstream served by this test that holds its replies until told: the
calls are admitted, Redis is stopped, the upstream answers; the clients get their answers,
the turns wait in the gateway's spool file, a new call forwards nothing, and once Redis
is back every turn is booked exactly once: ledger = sum of the runs' costs = what the
upstream's own usage says, to the micro-dollar.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.store.base import to_micros
from gateway.store.redis import RedisStore
from gateway.tokens import get_counter
from tests.server.test_admission import KEY, TASK, chat, write_config
from tests.store.conftest import _start_redis
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway
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


def start_both(tmp_path: Path, held: HeldUpstream) -> tuple[Path, int, subprocess.Popen[bytes], str, str, Proc]:
    """A durable redis-server and a gateway on it: (its folder, port, process, URL, the
    gateway's key prefix, the gateway)."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    port = free_port()
    server = start_redis(redis_dir, port)
    url = f"redis://127.0.0.1:{port}/0"
    prefix = f"spool-{uuid.uuid4().hex[:8]}:"
    folder, gw_port = tmp_path / "gw", free_port()
    path = write_config(folder, gw_port, held.url, {"kind": "redis", "url": url, "prefix": prefix})
    config = yaml.safe_load(path.read_text())
    config["teams"][0].update(user_budget_usd=5.0, user_budget_period="total")  # a user's hold on each call
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    gateway = start_gateway(["serve", "--config", str(path)], "/livez", gw_port, folder / "gateway.log",
                            timeout=START_TIMEOUT_S)
    return redis_dir, port, server, url, prefix, gateway


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
        tmp_path: Path, held: HeldUpstream) -> None:
    redis_dir, port, server, url, prefix, gateway = start_both(tmp_path, held)
    runs = [f"outage-{i}" for i in range(6)]
    held.wanted = len(runs)
    try:
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(chat(session, gateway, KEY, {"model": "paid", "messages": TASK},
                                                {"X-Run-Id": run_id})) for run_id in runs]
            await asyncio.wait_for(held.arrived.wait(), 30)  # all admitted and forwarded
            server.terminate()
            server.wait(10)
            held.release.set()  # the upstream answers: these turns are paid, the store is gone
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * len(runs), results
            assert [reply["run"]["turns"] for _, _, reply in results] == [1] * len(runs), results
            spool = tmp_path / "gw" / "spool.jsonl"
            assert len(spool.read_bytes().splitlines()) == len(runs)

            status, headers, reply = await chat(session, gateway, KEY, {"model": "down", "messages": TASK})
            assert status >= 500 and held.calls["down"] == 0, reply  # nothing forwarded while the store is down
            assert "Error" not in reply["error"]["message"]

            server = start_redis(redis_dir, port)
            store = RedisStore(url, prefix)
            deadline = time.monotonic() + 20
            while spool.read_bytes():
                assert time.monotonic() < deadline, "the spool was not replayed"
                await asyncio.sleep(0.1)  # the gateway replays on its own; this polls for it
            costs = []
            for run_id in runs:
                run = await store.load_run(scoped_run_id("adm", run_id))
                assert run is not None and run.turns == 1, run_id
                costs.append(run.cost_usd)
            spent, reserved = await store.team_spend("adm", "total")
            billed = sum(PRICE.cost(u) for u in held.billed)
            assert round(spent, 6) == round(sum(costs), 6) == round(billed, 6) and reserved == 0.0
            events = [e for _, e in await store.events(scoped_run_id("adm", runs[0]))]
            assert [e["type"] for e in events].count("turn") == 1
            await store.close()
    finally:
        gateway.stop()
        server.kill()
        server.wait()


async def test_turns_spooled_before_a_restart_are_booked_after_it(tmp_path: Path, held: HeldUpstream) -> None:
    """The gateway is killed while its turns wait in the spool; it starts again (the same
    address: the same owner name, whose earlier holds it releases at start) once the store
    is back. The spooled turns' reservations are not released with the rest, nor their
    user's holds: the replay books each of them once, and the team's ledger, the user's and
    the user's spend rows all equal what the upstream billed."""
    redis_dir, port, server, url, prefix, gateway = start_both(tmp_path, held)
    runs = [f"restart-{i}" for i in range(4)]
    held.wanted = len(runs)
    spool = tmp_path / "gw" / "spool.jsonl"
    try:
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(chat(session, gateway, KEY, {"model": "paid", "messages": TASK},
                                                {"X-Run-Id": run_id, "X-Gateway-User": "ana"})) for run_id in runs]
            await asyncio.wait_for(held.arrived.wait(), 30)
            server.terminate()
            server.wait(10)
            held.release.set()
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * len(runs), results
        assert len(spool.read_bytes().splitlines()) == len(runs)
        gateway.kill()  # SIGKILL: the spool is all that remembers these turns

        server = start_redis(redis_dir, port)
        config = tmp_path / "gw" / "config.yaml"
        gateway = start_gateway(["serve", "--config", str(config)], "/livez", int(gateway.url.rsplit(":", 1)[1]),
                                tmp_path / "gw" / "gateway-2.log")
        deadline = time.monotonic() + 20
        while spool.read_bytes():
            assert time.monotonic() < deadline, "the spool was not replayed after the restart"
            await asyncio.sleep(0.1)  # the gateway replays on its own; this polls for it
        store = RedisStore(url, prefix)
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
        gateway.stop()
        server.kill()
        server.wait()


async def test_embeddings_paid_during_a_store_outage_are_booked_when_it_returns(
        tmp_path: Path, held: HeldUpstream) -> None:
    """Embeddings admitted, then the store goes, then the upstream answers: a call without a
    run is answered and its spend spooled; a call on a run, whose step on the run fails,
    answers 503 `store_unavailable` but its spend is spooled too. Once the store is back,
    the team's ledger and the user's equal what the upstream billed, nothing left reserved."""
    redis_dir, port, server, url, prefix, gateway = start_both(tmp_path, held)
    headers = [{"X-Run-Id": f"emb-{i}"} for i in range(3)] + [{}, {}]
    held.wanted = len(headers)
    spool = tmp_path / "gw" / "spool.jsonl"
    try:
        async with aiohttp.ClientSession() as session:

            async def embed(extra: dict[str, str]) -> tuple[int, Any]:
                async with session.post(f"{gateway.url}/v1/embeddings", json={"model": "vec", "input": "hello"},
                                        headers={"Authorization": f"Bearer {KEY}", "X-Gateway-User": "ana",
                                                 **extra}) as resp:
                    return resp.status, await resp.json()

            calls = [asyncio.ensure_future(embed(h)) for h in headers]
            await asyncio.wait_for(held.arrived.wait(), 30)
            server.terminate()
            server.wait(10)
            held.release.set()
            results = await asyncio.gather(*calls)
        on_runs, alone = results[:3], results[3:]
        assert [s for s, _ in alone] == [200, 200], alone
        assert all(s == 503 and r["error"]["code"] == "store_unavailable" for s, r in on_runs), on_runs
        assert len(spool.read_bytes().splitlines()) == len(headers)

        server = start_redis(redis_dir, port)
        deadline = time.monotonic() + 20
        while spool.read_bytes():
            assert time.monotonic() < deadline, "the spool was not replayed"
            await asyncio.sleep(0.1)  # the gateway replays on its own; this polls for it
        store = RedisStore(url, prefix)
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
        gateway.stop()
        server.kill()
        server.wait()
