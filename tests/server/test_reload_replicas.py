"""A reload on one replica reloads every replica sharing its store (gateway.server.reload_watch).

Two real `gateway serve` processes, each with its own config.yaml, share one store: a
PostgreSQL schema (LISTEN/NOTIFY), a Redis prefix or a SQLite file (both polled). A key
added to both files is served by replica B once replica A was reloaded by
POST /v1/admin/reload (or a SIGHUP), without B being told; and the other way round, each
process reloading once per reload, never again for its own. A refused reload on one
replica announces nothing, and the other keeps its files. On PostgreSQL, a notification
missed (every listening connection of the schema ended by pg_terminate_backend just
before the reload) is made up for by the poll; and the workers of a `--workers 2` replica
each reload once for another replica's reload (recorded once), and never for their own
server's (the supervisor's fan-out does that).
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import yaml

from gateway.store import Store, open_store
from tests.server.served import poll, request
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.server.test_workers import wait_serving
from gateway.server.reload_watch import ReloadWatch, _moved
from gateway.store.base import ReloadMark
from tests.support.procs import ROOT, START_TIMEOUT_S, TEST_WORKERS, Proc, free_port, start_gateway
from tests.support.shared_store import shared_store

ROOT_KEY, DEMO_KEY = "sk-replica-root", "sk-replica-demo"
KINDS = ("postgres", "redis", "sqlite")
REACHED_S = 15.0
"""How long the other replica may take to serve a reload (notified: ms; polled: RELOAD_POLL_S)."""
BY_REPLICA = "reloaded by another replica"
CALLS = 12
"""Calls on fresh connections per check of a 2-worker replica: all on one worker has odds of 1 in 2**11."""


@dataclass
class Replica:
    folder: Path
    port: int
    store: dict[str, Any]
    proc: Proc | None = None
    workers: int = int(os.environ.get(TEST_WORKERS) or 1)
    """Its processes (the 2-worker pass of the suite starts every replica with `--workers`)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self, keys: tuple[str, ...] = ()) -> dict[str, Any]:
        return {
            "server": {"host": "127.0.0.1", "port": self.port},
            "store": self.store,
            "policies_dir": str(ROOT / "policies"),
            "upstreams": [{"name": "nowhere", "base_url": "http://127.0.0.1:9/v1"}],
            "models": [{"match": "m-*", "upstream": "nowhere", "price_in": 1.0, "price_out": 1.0}],
            "teams": [
                {"name": "root", "keys": [ROOT_KEY], "admin": True, "policies": ["passthrough"]},
                {"name": "demo", "keys": [DEMO_KEY, *keys], "policies": ["passthrough"]},
            ],
        }

    def write(self, keys: tuple[str, ...] = ()) -> None:
        (self.folder / "config.yaml").write_text(yaml.safe_dump(self.config(keys)))

    def write_bad(self) -> None:
        bad = self.config()
        bad["teams"][1]["budget_usd"] = "lots"
        (self.folder / "config.yaml").write_text(yaml.safe_dump(bad))

    def log(self) -> str:
        return (self.folder / "gateway.log").read_text(errors="replace")

    def start(self, *args: str) -> Proc:
        """Write its config and start it (`args` added to `gateway serve`)."""
        self.folder.mkdir()
        self.write()
        self.proc = start_gateway(["serve", "--config", str(self.folder / "config.yaml"), *args], "/healthz",
                                  self.port, self.folder / "gateway.log", timeout=START_TIMEOUT_S)
        return self.proc


@dataclass
class Pair:
    a: Replica
    b: Replica
    store: dict[str, Any]


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    kind: str = request.param
    if kind == "sqlite":
        store: dict[str, Any] = {"kind": "sqlite", "path": str(tmp_path / "shared.db")}
    else:
        store = shared_store(kind, request, "reloads")
    replicas = [Replica(tmp_path / name, free_port(), store) for name in ("a", "b")]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(r.start) for r in replicas]
    for r, f in zip(replicas, futures):
        r.proc = f.result() if f.exception() is None else None
    try:
        for f in futures:
            f.result()
        yield Pair(replicas[0], replicas[1], store)
    finally:
        for r in replicas:
            if r.proc is not None:
                r.proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def new_key() -> str:
    return f"sk-replica-{uuid.uuid4().hex[:12]}"


async def status(session: aiohttp.ClientSession, replica: Replica, key: str) -> int:
    code, _, _ = await request(session, "GET", f"{replica.url}/v1/models", key=key)
    return code


async def reload(session: aiohttp.ClientSession, replica: Replica) -> tuple[int, Any]:
    code, _, body = await request(session, "POST", f"{replica.url}/v1/admin/reload", key=ROOT_KEY)
    return code, body


async def serves(session: aiohttp.ClientSession, replica: Replica, key: str) -> None:
    """Until `replica` accepts `key` (bounded): every worker of it, when it has several
    (calls on fresh connections, which the kernel spreads over them)."""
    async def accepted() -> bool:
        if replica.workers == 1:
            return await status(session, replica, key) == 200
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            return all([await status(fresh, replica, key) == 200 for _ in range(CALLS)])

    await poll(accepted, timeout=REACHED_S)


async def log_says(replica: Replica, text: str, times: int = 1) -> int:
    """Until `replica`'s log holds `text` `times` times; how many times it does."""
    async def count() -> int:
        found = replica.log().count(text)
        return found if found >= times else 0

    found: int = await poll(count, timeout=REACHED_S)
    return found


async def replica_records(session: aiohttp.ClientSession, replica: Replica) -> list[dict[str, Any]]:
    """The audit records of reloads made for another replica's (the store's log: every replica's)."""
    code, _, body = await request(session, "GET", f"{replica.url}/v1/admin/audit?action=config.reloaded",
                                  key=ROOT_KEY)
    assert code == 200, body
    return [r for r in body["data"] if r["details"].get("by") == "another replica"]


async def recorded(session: aiohttp.ClientSession, replica: Replica, count: int) -> list[dict[str, Any]]:
    """Until the store's audit log holds `count` reloads made for another replica's."""
    async def found() -> list[dict[str, Any]]:
        records = await replica_records(session, replica)
        return records if len(records) >= count else []

    records: list[dict[str, Any]] = await poll(found, timeout=REACHED_S)
    return records


async def generation(store: dict[str, Any]) -> int:
    view: Store = open_store(store)
    try:
        return (await view.reload_mark()).generation
    finally:
        await view.close()


async def test_a_reload_on_one_replica_reloads_the_other(pair: Pair, session: aiohttp.ClientSession) -> None:
    first = new_key()
    for r in (pair.a, pair.b):  # the new file deployed to both; only A is told
        r.write((first,))
    assert await status(session, pair.b, first) == 401
    code, body = await reload(session, pair.a)
    assert code == 200, body
    assert await status(session, pair.a, first) == 200
    await serves(session, pair.b, first)  # B was never told
    assert await log_says(pair.b, BY_REPLICA, pair.b.workers) == pair.b.workers  # each of its processes, once
    assert len(await recorded(session, pair.a, 1)) == 1  # recorded once however many workers

    second = new_key()  # and the other way round
    for r in (pair.a, pair.b):
        r.write((first, second))
    code, body = await reload(session, pair.b)
    assert code == 200, body
    await serves(session, pair.a, second)
    # A reloaded once for B's reload, never for its own announcement (B alike: its count is unchanged)
    assert await log_says(pair.a, BY_REPLICA, pair.a.workers) == pair.a.workers
    assert pair.b.log().count(BY_REPLICA) == pair.b.workers
    assert await generation(pair.store) == 2
    assert len(await recorded(session, pair.b, 2)) == 2


async def test_a_sighup_to_one_replica_reloads_the_other(pair: Pair, session: aiohttp.ClientSession) -> None:
    key = new_key()
    for r in (pair.a, pair.b):
        r.write((key,))
    assert pair.a.proc is not None
    pair.a.proc.popen.send_signal(signal.SIGHUP)  # the process the user started (a supervisor in the 2-worker pass)
    await serves(session, pair.a, key)
    await serves(session, pair.b, key)
    assert await log_says(pair.b, BY_REPLICA, pair.b.workers) == pair.b.workers


async def test_a_refused_reload_changes_nothing_on_the_other(pair: Pair, session: aiohttp.ClientSession) -> None:
    pending = new_key()
    pair.a.write_bad()
    pair.b.write((pending,))  # B's file has a change it would serve if it reloaded
    code, body = await reload(session, pair.a)
    assert code == 400 and body["error"]["code"] == "invalid_config", body
    assert await generation(pair.store) == 0  # nothing announced: no replica has anything to reload for
    assert await status(session, pair.b, pending) == 401
    assert BY_REPLICA not in pair.b.log()

    pair.a.write((pending,))  # fixed: A's reload now serves, and B follows
    code, body = await reload(session, pair.a)
    assert code == 200, body
    await serves(session, pair.b, pending)


async def test_a_missed_notification_is_made_up_for_by_the_poll(request: pytest.FixtureRequest,
                                                                 session: aiohttp.ClientSession,
                                                                 tmp_path: Path) -> None:
    """Every LISTEN connection of the schema is ended just before A's reload, so its
    NOTIFY reaches nobody (checked: each listening connection afterwards started after the
    reload's answer); B serves the new key anyway, from its poll."""
    store = shared_store("postgres", request, "reloads")
    dsn, schema = store["dsn"], store["schema"]
    channel = f"{schema}_reload"
    replicas = [Replica(tmp_path / name, free_port(), store) for name in ("a", "b")]
    for r in replicas:
        r.start()
    a, b = replicas
    conn = await asyncpg.connect(dsn)
    try:
        async def listeners() -> list[int]:
            rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE query LIKE $1", f"LISTEN %{channel}%")
            return [int(r["pid"]) for r in rows]

        await poll(lambda: _at_least(listeners, 2), timeout=REACHED_S)  # both listen (the watcher waits on it)
        keys: tuple[str, ...] = ()
        for _attempt in range(5):  # a reload slower than the listeners' reconnection is tried again
            key = new_key()
            keys = (*keys, key)
            for r in replicas:
                r.write(keys)
            for pid in await listeners():
                await conn.execute("SELECT pg_terminate_backend($1)", pid)
            code, body = await reload(session, a)
            answered = await conn.fetchval("SELECT clock_timestamp()")
            assert code == 200, body
            await serves(session, b, key)
            started = await conn.fetch("SELECT backend_start FROM pg_stat_activity WHERE query LIKE $1",
                                       f"LISTEN %{channel}%")
            if all(row["backend_start"] > answered for row in started):
                break  # nobody listened when the NOTIFY went: B's poll found the reload
        else:
            raise AssertionError("the listeners reconnected before every reload's answer")
    finally:
        await conn.close()
        for r in replicas:
            if r.proc is not None:
                r.proc.stop()


async def _at_least(read: Any, count: int) -> bool:
    return len(await read()) >= count



@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
async def test_the_workers_of_one_server_reload_once_per_reload(request: pytest.FixtureRequest, kind: str,
                                                              session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Replica A (one process) and B (`--workers 2`) on PostgreSQL (notified) and a shared
    SQLite file (polled: B's two reloads of round 2 then land within one poll, and its
    watchers see the count move by two, both B's own). A's reload reaches each
    of B's workers through its own watcher, once, and is recorded once. B's own reloads
    (a SIGHUP and at once a POST on one worker, each reloading both workers) are not
    reloaded again by B's watchers: a third reload, on A, finds each of B's workers at two
    reloads for replicas."""
    store = (shared_store("postgres", request, "reloads") if kind == "postgres"
             else {"kind": "sqlite", "path": str(tmp_path / "shared.db")})
    a = Replica(tmp_path / "a", free_port(), store, workers=1)
    b = Replica(tmp_path / "b", free_port(), store, workers=2)
    try:
        for r in (a, b):
            r.start("--workers", str(r.workers))
        wait_serving(b.proc)  # type: ignore[arg-type]
        keys: tuple[str, ...] = ()
        for told, other, round_ in ((a, b, 1), (b, a, 2), (a, b, 3)):
            keys = (*keys, new_key())
            for r in (a, b):
                r.write(keys)
            if told is b:  # a SIGHUP, and at once a POST: two reloads of B's own within one poll
                sighups = b.log().count("reloaded by SIGHUP")
                assert b.proc is not None
                b.proc.popen.send_signal(signal.SIGHUP)
            code, body = await reload(session, told)
            assert code == 200, body
            if told is b:
                assert body["workers"] == {"count": 2, "reloaded": 2}, body  # the fan-out, as before
                await log_says(b, "reloaded by SIGHUP", sighups + 2)
            await serves(session, other, keys[-1])
            if round_ == 3:
                assert await log_says(b, BY_REPLICA, 4) == 4  # rounds 1 and 3, each worker once; none for round 2
        # A reloads for B's two of round 2 once or twice (whether its poll fell between them)
        assert await log_says(a, BY_REPLICA) in (1, 2)
        assert len(await recorded(session, a, 3)) == 2 + a.log().count(BY_REPLICA)  # one record per reload for a replica's
    finally:
        for r in (a, b):
            if r.proc is not None:
                r.proc.stop()


def test_a_count_moved_by_two_reloads_of_its_own_is_not_reloaded_again() -> None:
    """The rule the watchers apply (the polled stores): two reloads of this server within
    one poll move the count by two, still its own; another server's latest one is not."""
    watch = ReloadWatch(origin="b")
    assert not _moved(watch, ReloadMark(3, "a"))  # the first read: taken as seen
    assert not _moved(watch, ReloadMark(5, "b"))  # B's SIGHUP and B's POST, between two polls
    assert _moved(watch, ReloadMark(6, "a"))
    assert not _moved(watch, ReloadMark(6, "a"))  # nothing new
