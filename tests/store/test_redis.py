"""Redis specifics: key prefixes isolate deployments, and ledger records do not pile up."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.harness.state import RunState
from gateway.store.base import EXPIRED_RETENTION_S
from gateway.store.redis import RedisStore, redact


async def test_prefixes_keep_two_deployments_apart(redis_url: str) -> None:
    blue, green = RedisStore(redis_url, prefix="blue:"), RedisStore(redis_url, prefix="green:")
    try:
        await blue.create_run(RunState.new("m", [], run_id="run_a", team="demo"))
        await green.create_run(RunState.new("m", [], run_id="run_a", team="demo"))  # same id, other deployment
        await blue.charge("demo", "total", 1.0)
        assert [r.run_id for r in await green.list_runs(team="demo")] == ["run_a"]
        assert await green.team_spend("demo", "total") == (0.0, 0.0)
        assert await green.reserve("demo", "total", 1.0, 1.0) is not None
    finally:
        await blue.close()
        await green.close()


async def test_reservation_records_are_deleted_or_expire(redis_url: str) -> None:
    prefix = "gc:"
    store = RedisStore(redis_url, prefix=prefix)
    client = aioredis.Redis.from_url(redis_url)
    try:
        settled = await store.reserve("demo", "total", 0.01, 1.0)
        released = await store.reserve("demo", "total", 0.01, 1.0)
        dead = await store.reserve("demo", "total", 0.01, 1.0, ttl_s=0)
        assert settled and released and dead
        await store.settle(settled, 0.01)
        await store.release(released)
        assert await client.exists(f"{prefix}res:{settled}", f"{prefix}res:{released}") == 0
        assert await store.team_spend("demo", "total") == (0.01, 0.0)  # reclaims the dead one
        ttl_ms = await client.pttl(f"{prefix}res:{dead}")
        assert 0 < ttl_ms <= EXPIRED_RETENTION_S * 1000  # kept for a late settle, then gone
        assert await client.zcard(f"{prefix}held:demo") == 0
    finally:
        await client.aclose()
        await store.close()


def test_redact_hides_only_the_password() -> None:
    assert redact("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://:pw@host/1") == "redis://:***@host/1"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
