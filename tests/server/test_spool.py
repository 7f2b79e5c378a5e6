"""Turns paid upstream while the store is down are booked once it is back (the spool).

A real gateway on a real redis-server (with an append-only file, so a restart keeps its
data), or on a real PostgreSQL stopped as in a failover, in front of an upstream served by this test that holds its replies until told: the
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

import aiohttp
import pytest
from aiohttp import web

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.store import open_store
from gateway.tokens import get_counter
from tests.server.test_admission import KEY, TASK, chat, serving, start
from tests.store.conftest import _start_redis
from tests.support.postgres import Cluster
from tests.support.shared_store import SHARED_KINDS
from tests.support.procs import free_port

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


def start_redis(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    """A durable redis-server on `port` (its data survives a restart in `workdir`)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    return _start_redis(exe, workdir, port=port, durable=True)[0]


@pytest.fixture
async def held() -> AsyncIterator[HeldUpstream]:
    state = HeldUpstream()
    async with serving(state.handle) as state.url:
        yield state
        state.release.set()


class RedisServer:
    """A durable redis-server that the test stops and starts again on its port."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.folder, self.port = folder, free_port()
        self.popen = start_redis(folder, self.port)
        self.config = {"kind": "redis", "url": f"redis://127.0.0.1:{self.port}/0",
                       "prefix": f"spool-{uuid.uuid4().hex[:8]}:"}

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait(10)

    def start(self) -> None:
        self.popen = start_redis(self.folder, self.port)

    def remove(self) -> None:
        self.popen.kill()
        self.popen.wait()


class PostgresServer:
    """A PostgreSQL cluster of the test's own, stopped (fast: as a failover) and started again."""

    def __init__(self) -> None:
        self.cluster = Cluster()
        self.cluster.start()
        self.config = self.cluster.store()
        self.stop, self.start, self.remove = self.cluster.stop, self.cluster.start, self.cluster.remove


@pytest.mark.parametrize("kind", SHARED_KINDS)
async def test_turns_paid_during_a_store_outage_are_booked_once_when_it_returns(
        tmp_path: Path, held: HeldUpstream, kind: str) -> None:
    server: RedisServer | PostgresServer = RedisServer(tmp_path / "redis") if kind == "redis" else PostgresServer()
    gateway = start(tmp_path / "gw", held.url, server.config)
    runs = [f"outage-{i}" for i in range(6)]
    held.wanted = len(runs)
    try:
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(chat(session, gateway, KEY, {"model": "paid", "messages": TASK},
                                                {"X-Run-Id": run_id})) for run_id in runs]
            await asyncio.wait_for(held.arrived.wait(), 30)  # all admitted and forwarded
            server.stop()
            held.release.set()  # the upstream answers: these turns are paid, the store is gone
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * len(runs), results
            assert [reply["run"]["turns"] for _, _, reply in results] == [1] * len(runs), results
            spool = tmp_path / "gw" / "spool.jsonl"
            assert len(spool.read_bytes().splitlines()) == len(runs)

            status, headers, reply = await chat(session, gateway, KEY, {"model": "down", "messages": TASK})
            assert status >= 500 and held.calls["down"] == 0, reply  # nothing forwarded while the store is down
            assert "Error" not in reply["error"]["message"]

            server.start()
            store = open_store(server.config)
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
        server.remove()
