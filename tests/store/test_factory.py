"""open_store: every configured kind opens a working store; bad config names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.harness.state import RunState
from gateway.store import StoreConfigError, StoreError, open_store
from gateway.store.memory import MemoryStore
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.support.postgres import new_schema
from tests.support.procs import free_port


async def roundtrip(config: dict[str, Any]) -> type:
    store = open_store(config)
    try:
        await store.create_run(RunState.new("m", [], run_id="run_factory"))
        loaded = await store.load_run("run_factory")
        assert loaded is not None and loaded.run_id == "run_factory"
        return type(store)
    finally:
        await store.close()


async def test_each_kind_opens_a_working_store(tmp_path: Path, redis_url: str) -> None:
    assert await roundtrip({"kind": "memory"}) is MemoryStore
    assert await roundtrip({"kind": "sqlite", "path": str(tmp_path / "sub" / "gateway.db")}) is SqliteStore
    assert (tmp_path / "sub" / "gateway.db").exists()
    assert await roundtrip({"kind": "redis", "url": redis_url, "prefix": "factory:"}) is RedisStore


async def test_postgres_opens_from_a_dsn_or_the_environment(postgres_dsn: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.store.postgres import PostgresStore

    assert await roundtrip({"kind": "postgres", "dsn": postgres_dsn, "schema": new_schema()}) is PostgresStore
    monkeypatch.setenv("GATEWAY_PG_DSN", postgres_dsn)  # the default dsn_env
    assert await roundtrip({"kind": "postgres", "schema": new_schema(), "pool": {"min": 0, "max": 2},
                            "timeout_s": 5}) is PostgresStore


def test_postgres_without_asyncpg_is_a_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "asyncpg", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "gateway.store.postgres", raising=False)
    with pytest.raises(StoreConfigError, match=r"store.kind: postgres needs the asyncpg package.*gateway\[postgres\]"):
        open_store({"kind": "postgres", "dsn": "postgresql://127.0.0.1/x"})


async def test_an_unreachable_postgres_is_named_without_its_password() -> None:
    port = free_port()  # nothing listens there
    store = open_store({"kind": "postgres", "dsn": f"postgresql://gw:s3cret@127.0.0.1:{port}/db", "timeout_s": 1})
    try:
        with pytest.raises(StoreError, match=rf"postgres store postgresql://gw:\*\*\*@127.0.0.1:{port}/db") as caught:
            await store.load_run("run_a")
        assert "s3cret" not in str(caught.value)
    finally:
        await store.close()


async def test_a_frozen_postgres_fails_within_the_store_timeout() -> None:
    """A server that accepts the connection and never answers: StoreError, not a wait forever."""
    import asyncio

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = open_store({"kind": "postgres", "dsn": f"postgresql://gw@127.0.0.1:{port}/db", "timeout_s": 0.3})
    try:
        async with asyncio.timeout(5):  # the hang this guards against
            with pytest.raises(StoreError, match="no answer in time|timeout|Timeout"):
                await store.load_run("run_a")
    finally:
        await store.close()
        server.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("sqlite", r"store: expected a mapping"),
        ({}, r"store.kind: expected one of memory, postgres, redis, sqlite, got None"),
        ({"kind": "mysql"}, r"store.kind: .* got 'mysql'"),
        ({"kind": "sqlite"}, r"store.path: missing"),
        ({"kind": "sqlite", "path": 3}, r"store.path: expected a non-empty string, got 3"),
        ({"kind": "sqlite", "path": "x.db", "url": "redis://x"}, r"store: unknown field\(s\) url for kind sqlite"),
        ({"kind": "redis"}, r"store.url: missing"),
        ({"kind": "redis", "url": "http://127.0.0.1:6379"}, r"store.url: expected a redis://"),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "prefix": 7}, r"store.prefix: expected a string"),
        ({"kind": "redis", "url": "redis://127.0.0.1:port"}, r"store.url: "),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "timeout_s": 0}, r"store.timeout_s: expected a number"),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "timeout_s": "2"}, r"store.timeout_s: .* got '2'"),
        ({"kind": "sqlite", "path": "x.db", "timeout_s": 2}, r"store: unknown field\(s\) timeout_s for kind sqlite"),
        ({"kind": "postgres", "dsn_env": "GATEWAY_TEST_NO_SUCH_VAR"},
         r"store.dsn_env: the environment variable GATEWAY_TEST_NO_SUCH_VAR is not set"),
        ({"kind": "postgres", "dsn": "mysql://u:secret@h/db"}, r"store.dsn: expected a postgresql:// .*\*\*\*"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "dsn_env": "X"}, r"store: give dsn or dsn_env, not both"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "schema": "Bad-Name"}, r"store.schema: expected a lower"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "pool": {"min": 5, "max": 2}}, r"store.pool: expected 0 <= min"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "pool": {"size": 2}}, r"store.pool: unknown field\(s\) size"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "pool": {"max": "9"}}, r"store.pool.max: expected a whole"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "timeout_s": -1}, r"store.timeout_s: expected a number"),
        ({"kind": "postgres", "dsn": "postgresql://h/db", "url": "x"}, r"store: unknown field\(s\) url for kind postgres"),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "wait_replicas": -1},
         r"store.wait_replicas: expected a whole number from 0 to 16, got -1"),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "wait_replicas": True}, r"store.wait_replicas: .* got True"),
        ({"kind": "redis", "url": "redis://127.0.0.1:6379", "wait_replicas": 1, "wait_timeout_s": 2},
         r"store.wait_timeout_s: .* below store.timeout_s \(2\), got 2"),
        ({"kind": "sqlite", "path": "x.db", "wait_replicas": 1}, r"store: unknown field\(s\) wait_replicas for kind sqlite"),
    ],
)
def test_bad_config_names_the_field(config: Any, message: str) -> None:
    with pytest.raises(StoreConfigError, match=message):
        open_store(config)


async def test_an_unreachable_redis_is_named_without_its_password() -> None:
    port = free_port()  # nothing listens there
    store = open_store({"kind": "redis", "url": f"redis://user:s3cret@127.0.0.1:{port}/0"})
    try:
        with pytest.raises(StoreError, match=rf"redis store redis://user:\*\*\*@127.0.0.1:{port}/0") as caught:
            await store.load_run("run_a")
        assert "s3cret" not in str(caught.value)
    finally:
        await store.close()


async def test_a_frozen_redis_fails_within_the_store_timeout() -> None:
    """A server that accepts the connection and never answers: StoreError, not a wait forever."""
    import asyncio

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the command, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = open_store({"kind": "redis", "url": f"redis://127.0.0.1:{port}/0", "timeout_s": 0.2})
    try:
        async with asyncio.timeout(5):  # the hang this guards against; the store gives up after 0.2 s
            with pytest.raises(StoreError, match="Timeout"):
                await store.load_run("run_a")
    finally:
        await store.close()
        server.close()
