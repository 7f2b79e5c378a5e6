"""Fixtures of the store tests: a real redis-server, a real PostgreSQL, and one Store per backend.

The contract suite runs once per backend through `stores` (memory, a SQLite file in
tmp_path, a real redis-server, a real PostgreSQL cluster). `stores.open()` gives another
view of the same data (a second SQLite connection, a second Redis client, a second
PostgreSQL pool), which is how two replicas see it.

A new store gets the whole contract suite (tests/store/, the lease fence and the transcript
included) by adding its name to BACKENDS and a branch to each method of `Stores` that
reaches past the Protocol (`open`, `stored_head`, `put_whole_body`, `stored_items`): nothing else in the
tests names a backend.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Literal

import asyncpg
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from gateway.store.base import Store
from gateway.store.memory import MemoryStore
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.support import postgres
from tests.support.procs import free_port

Backend = Literal["memory", "sqlite", "redis", "postgres"]
BACKENDS: tuple[Backend, ...] = ("memory", "sqlite", "redis", "postgres")
STORE_TIMEOUT_S = 10.0
"""The Redis views' command deadline in these tests."""


def _start_redis(exe: str, workdir: Path, *, port: int | None = None, durable: bool = False,
                 extra: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], int]:
    """Start redis-server (on `port`, else a free one) and poll PING until it answers.
    `durable`: an append-only file synced on every write, so a restart in `workdir` keeps
    the data. `extra`: more redis-server arguments (e.g. a maxmemory-policy)."""
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    for _attempt in range(1 if port is not None else 3):  # a free port can be taken before it is bound
        port_ = port if port is not None else free_port()
        log = workdir / f"redis-{port_}-{time.monotonic_ns()}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [exe, "--port", str(port_), "--bind", "127.0.0.1", "--save", "", *persistence,
                 "--dir", str(workdir), *extra],
                stdout=out, stderr=subprocess.STDOUT,
            )
        client = redis.Redis(host="127.0.0.1", port=port_, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + 15
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.ping():
                        return proc, port_
                except redis.ConnectionError:
                    time.sleep(0.02)  # poll interval, not a synchronisation stand-in
        finally:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"redis-server on port {port_} did not answer PING within 15 s:\n{log.read_text()}")
        if "Address already in use" not in log.read_text(errors="replace"):
            raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
    raise RuntimeError("redis-server could not bind a free port in 3 attempts")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, throwaway redis-server (no persistence), killed at the end of the session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed; the store tests need it (apt-get install -y redis-server)")
    proc, port = _start_redis(exe, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


class Stores:
    """Opens stores of one backend over the same data, and closes them all at teardown."""

    def __init__(self, backend: Backend, tmp_path: Path, redis_url: str | None) -> None:
        self.backend = backend
        self.path = tmp_path / "store.db"
        self.redis_url = redis_url
        self.prefix = f"test-{uuid.uuid4().hex[:12]}:"  # isolates this test's keys on the shared server
        self.schema = postgres.new_schema()  # the same on the shared PostgreSQL
        self._memory = MemoryStore()
        self._opened: list[Store] = []

    def open(self) -> Store:
        store: Store
        if self.backend == "memory":
            store = self._memory  # one process: every "view" is the same object
        elif self.backend == "sqlite":
            store = SqliteStore(self.path)
        elif self.backend == "postgres":
            assert self.redis_url is not None  # the DSN, for this backend
            store = PostgresStore(self.redis_url, self.schema, timeout_s=STORE_TIMEOUT_S, pool_max=32)
        else:
            assert self.redis_url is not None
            # These tests judge what the store decides, not its deadlines (tests/faults freeze a
            # real server for those): 64 connections opened at once on a loaded machine can
            # take longer than the 2 s default to connect.
            store = RedisStore(self.redis_url, prefix=self.prefix, timeout_s=STORE_TIMEOUT_S)
        self._opened.append(store)
        return store

    async def stored_head(self, store: Store, run_id: str) -> bytes:
        """The bytes `store` rewrites on each save of the run: its head (`RunWrite.head`)."""
        if isinstance(store, MemoryStore):
            return store._runs[run_id].body
        if isinstance(store, SqliteStore):
            return bytes(store._db().execute("SELECT body FROM runs WHERE id = ?", (run_id,)).fetchone()[0])
        if isinstance(store, RedisStore):
            client = aioredis.Redis.from_url(self.redis_url or "")
            try:
                body = await client.hget(f"{self.prefix}run:{run_id}", "body")
            finally:
                await client.aclose()
            assert isinstance(body, bytes)
            return body
        if isinstance(store, PostgresStore):
            return bytes(await self._pg("SELECT body FROM runs WHERE id = $1", run_id))
        raise NotImplementedError(f"Stores.stored_head: add the {self.backend} backend")

    async def put_whole_body(self, store: Store, run_id: str, body: bytes) -> None:
        """Make the stored run `run_id` (created through the Protocol) one whole body with
        nothing beside it, as a gateway before heads (run schema 1 to 4) stored it."""
        if isinstance(store, MemoryStore):
            row = store._runs[run_id]
            row.body, row.messages, row.per_turn = body, [], []
        elif isinstance(store, SqliteStore):
            db = store._db()
            db.execute("UPDATE runs SET body = ? WHERE id = ?", (body.decode(), run_id))  # as a migration left it: TEXT
            db.execute("DELETE FROM transcripts WHERE run_id = ?", (run_id,))
        elif isinstance(store, RedisStore):
            client = aioredis.Redis.from_url(self.redis_url or "")
            try:
                await client.hset(f"{self.prefix}run:{run_id}", "body", body)
                await client.delete(f"{self.prefix}transcript:{run_id}", f"{self.prefix}per_turn:{run_id}")
            finally:
                await client.aclose()
        elif isinstance(store, PostgresStore):
            await self._pg("WITH t AS (DELETE FROM transcripts WHERE run_id = $1) UPDATE runs SET body = $2 WHERE id = $1",
                           run_id, body)
        else:
            raise NotImplementedError(f"Stores.put_whole_body: add the {self.backend} backend")

    async def put_stored(self, store: Store, run_id: str, head: bytes, messages: Sequence[object],
                         per_turn: Sequence[Sequence[int]]) -> None:
        """Make the stored run `run_id` (created through the Protocol) the head `head` with
        `messages` and `per_turn` pairs beside it, as a gateway of run schema 5 stored it."""
        items = [orjson.dumps(m) for m in messages]
        pairs = [f"{p} {c}" for p, c in per_turn]
        if isinstance(store, MemoryStore):
            row = store._runs[run_id]
            row.body, row.messages, row.per_turn = head, items, [t.encode() for t in pairs]
        elif isinstance(store, SqliteStore):
            db = store._db()
            db.execute("UPDATE runs SET body = ? WHERE id = ?", (head, run_id))
            db.execute("DELETE FROM transcripts WHERE run_id = ?", (run_id,))
            db.executemany("INSERT INTO transcripts (run_id, kind, seq, body) VALUES (?, ?, ?, ?)",
                           [(run_id, 0, i, m) for i, m in enumerate(items)]
                           + [(run_id, 1, i, t) for i, t in enumerate(pairs)])
        elif isinstance(store, RedisStore):
            client = aioredis.Redis.from_url(self.redis_url or "")
            try:
                await client.hset(f"{self.prefix}run:{run_id}", "body", head)
                await client.delete(f"{self.prefix}transcript:{run_id}", f"{self.prefix}per_turn:{run_id}")
                await client.rpush(f"{self.prefix}transcript:{run_id}", *items)
                await client.rpush(f"{self.prefix}per_turn:{run_id}", *pairs)
            finally:
                await client.aclose()
        elif isinstance(store, PostgresStore):
            await self._pg("WITH t AS (DELETE FROM transcripts WHERE run_id = $1) UPDATE runs SET body = $2 WHERE id = $1",
                           run_id, head)
            await self._pg("INSERT INTO transcripts (run_id, kind, seq, body)"
                           " SELECT $1, 0, i - 1, b FROM unnest($2::bytea[]) WITH ORDINALITY AS u(b, i)"
                           " UNION ALL SELECT $1, 1, i - 1, b FROM unnest($3::bytea[]) WITH ORDINALITY AS u(b, i)",
                           run_id, items, [t.encode() for t in pairs])
        else:
            raise NotImplementedError(f"Stores.put_stored: add the {self.backend} backend")

    async def stored_items(self, store: Store, run_id: str) -> int:
        """How many transcript items (messages and `per_turn` pairs) `store` keeps beside
        the run's head: what retention must delete with the run."""
        if isinstance(store, MemoryStore):
            row = store._runs.get(run_id)
            return 0 if row is None else len(row.messages) + len(row.per_turn)
        if isinstance(store, SqliteStore):
            return int(store._db().execute("SELECT COUNT(*) FROM transcripts WHERE run_id = ?", (run_id,)).fetchone()[0])
        if isinstance(store, RedisStore):
            client = aioredis.Redis.from_url(self.redis_url or "")
            try:
                return int(await client.llen(f"{self.prefix}transcript:{run_id}")) + int(
                    await client.llen(f"{self.prefix}per_turn:{run_id}"))
            finally:
                await client.aclose()
        if isinstance(store, PostgresStore):
            return int(await self._pg("SELECT count(*) FROM transcripts WHERE run_id = $1", run_id))
        raise NotImplementedError(f"Stores.stored_items: add the {self.backend} backend")

    async def _pg(self, sql: str, *args: object) -> object:
        """One statement on this test's PostgreSQL schema, on a connection of its own."""
        conn = await asyncpg.connect(self.redis_url, server_settings={"search_path": self.schema})
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def close_all(self) -> None:
        for store in self._opened:
            await store.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[Backend, str | None]:
    kind: Backend = request.param
    if kind == "postgres":
        return kind, request.getfixturevalue("postgres_dsn")
    return kind, (request.getfixturevalue("redis_url") if kind == "redis" else None)


@pytest.fixture
async def stores(backend: tuple[Backend, str | None], tmp_path: Path) -> AsyncIterator[Stores]:
    opened = Stores(backend[0], tmp_path, backend[1])
    yield opened
    await opened.close_all()


@pytest.fixture
async def store(stores: Stores) -> Store:
    return stores.open()
