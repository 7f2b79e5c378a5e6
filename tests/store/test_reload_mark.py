"""The reload mark (`Store.reload_mark`, `announce_reload`), on every backend, with two views
of one store as two replicas; and on PostgreSQL, its notification."""

from __future__ import annotations

import asyncio

from gateway.store.base import ReloadMark
from gateway.store.postgres import PostgresStore
from tests.store.conftest import Stores
from tests.support.postgres import new_schema


async def test_an_announced_reload_is_counted_and_seen_by_every_view(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    assert await a.reload_mark() == ReloadMark(0, "")  # a new store: none announced
    assert await a.announce_reload("replica-a") == ReloadMark(1, "replica-a")
    assert await b.reload_mark() == ReloadMark(1, "replica-a")
    assert await b.announce_reload("replica-b") == ReloadMark(2, "replica-b")
    assert await a.reload_mark() == ReloadMark(2, "replica-b")


async def test_announcements_at_once_each_count(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    marks = await asyncio.gather(*(views[i % 2].announce_reload(f"r{i}") for i in range(10)))
    assert sorted(m.generation for m in marks) == list(range(1, 11))
    assert (await views[0].reload_mark()).generation == 10


async def test_an_announced_reload_notifies_the_other_replicas_on_postgres(postgres_dsn: str) -> None:
    schema = new_schema()
    a, b = PostgresStore(postgres_dsn, schema), PostgresStore(postgres_dsn, schema)
    try:
        await a.reload_mark()  # migrated
        assert await b.signals.wait("reload", "", 0.3) is False  # nothing announced: the poll's timeout
        for _ in range(200):  # the listener connects on the first wait: announce until it hears one
            waiting = asyncio.ensure_future(b.signals.wait("reload", "", 0.05))
            await a.announce_reload("a")
            if await waiting:
                break
        else:
            raise AssertionError("no reload notification came")
        assert b.signals.received >= 1
    finally:
        await a.close()
        await b.close()
