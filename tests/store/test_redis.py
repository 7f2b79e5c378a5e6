"""Redis specifics: key prefixes isolate deployments, ledger records do not pile up, and the
store's own round trips (`redis_wire.Lane`) survive a script flush and a restarted server,
and never reuse a connection whose reply is late."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.harness.state import RunState
from gateway.store.base import EXPIRED_RETENTION_S, Booking, Claim, Figures, RateLimit, TokenCharge
from gateway.store.errors import RunExists, StoreError
from gateway.store.dsn import redact
from gateway.store.redis import RedisStore
from gateway.store.redis_wire import Script
from tests.store.conftest import _start_redis


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


async def test_a_teams_clocks_kept_by_an_older_version_still_count(redis_url: str) -> None:
    # Before 2026-12 a team's clocks were a hash `rate:team:NAME`; now they are fields of its
    # ledger. The first claim and the first booking after the upgrade start from the old ones.
    prefix = "upgrade-clocks:"
    store = RedisStore(redis_url, prefix=prefix)
    client = aioredis.Redis.from_url(redis_url)
    limit = RateLimit("team:demo", 3600.0, requests=10, tokens=1000)
    try:
        now = float((await client.time())[0])
        await client.hset(f"{prefix}rate:team:demo", mapping={"r": repr(now + 3240.0), "t": repr(now + 3600.0 * 0.9)})
        assert (await store.admit(Claim("demo", "total", rates=(limit,), tokens=101))).refused == "rate_limit"
        grant = await store.admit(Claim("demo", "total", rates=(limit,), tokens=100))  # the 10th request
        assert grant.reservation_id is not None
        assert (await store.admit(Claim("demo", "total", rates=(limit,)))).refused == "rate_limit"
        assert (await client.hmget(f"{prefix}ledger:demo", ["rate:r", "rate:t"]))[0] is not None
        await client.hdel(f"{prefix}ledger:demo", "rate:t")  # as if an older replica had admitted it
        await client.hset(f"{prefix}rate:team:demo", "t", repr(now + 3600.0 * 0.5))
        await store.settle(grant.reservation_id, 0.0, [TokenCharge("team:demo", 100, 3.6)])
        pushed = float((await client.hget(f"{prefix}ledger:demo", "rate:t")) or 0)
        assert pushed >= now + 3600.0 * 0.5 + 360.0
    finally:
        await client.aclose()
        await store.close()


def test_redact_hides_only_the_password() -> None:
    assert redact("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://:pw@host/1") == "redis://:***@host/1"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


async def test_after_script_flush_the_next_call_books_exactly_once(redis_url: str) -> None:
    """SCRIPT FLUSH (as a restarted server forgets its scripts): the store's next admission
    and turn are NOSCRIPT, load their script and run once, neither lost nor run twice."""
    store = RedisStore(redis_url, prefix="flush:")
    client = aioredis.Redis.from_url(redis_url)
    try:
        run = RunState.new("m", [], run_id="run_f", team="demo")
        await client.script_flush()
        grant = await store.admit(Claim("demo", "total", 0.05, 1.0, run_id="run_f", max_turns=5, create=run))
        assert grant.reservation_id is not None
        assert await store.figures("demo", "total", "run_f") == Figures(0.0, 0.05, 0, 1, 0.0, 0.05)
        await client.script_flush()
        run.turns, run.cost_usd = 1, 0.01
        assert await store.commit_turn(run, [{"type": "turn"}], Booking("demo", "total", 0.01,
                                                                        grant.reservation_id)) == (0.01, 0.0)
        loaded = await store.load_run("run_f")
        assert loaded is not None and (loaded.revision, loaded.turns, loaded.cost_usd) == (1, 1, 0.01)
        assert [e["type"] for _, e in await store.events("run_f")] == ["turn"]
    finally:
        await client.aclose()
        await store.close()


async def test_a_call_that_timed_out_leaves_no_reply_for_the_next(redis_url: str) -> None:
    """A round trip past `timeout_s` is a StoreError, and its connection is never reused:
    the late reply (here, of a script that keeps the server busy longer) is not read as the
    answer to the next call."""
    store = RedisStore(redis_url, prefix="late:", timeout_s=1.0)
    try:
        await store.create_run(RunState.new("m", [], run_id="run_l", team="demo"))
        busy = Script("local function us() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end\n"
                      "local stop = us() + 1300000\n"
                      "while us() < stop do end\n"
                      "return 'late'")  # 1.3 s: past the deadline, and over well within the next one
        with pytest.raises(RedisTimeoutError, match="Timeout"):
            await store._lane.run(busy, [])
        loaded = await store.load_run("run_l")  # waits for the busy script, then gets its own answer
        assert loaded is not None and loaded.run_id == "run_l"
    finally:
        await store.close()


async def test_an_admission_that_finds_its_new_run_stored_reports_it(redis_url: str) -> None:
    """`lookup_in_admission`: a call's run is not looked up first, so an admission whose new
    run is stored already must hand back the stored run (and write nothing)."""
    store = RedisStore(redis_url, prefix="found:")
    try:
        assert store.lookup_in_admission
        stored = RunState.new("m", [{"role": "user", "content": "first"}], run_id="run_s", team="demo")
        await store.create_run(stored)
        stored.turns = 3
        await store.save_run(stored)
        again = RunState.new("m", [{"role": "user", "content": "second"}], run_id="run_s", team="demo")
        with pytest.raises(RunExists) as refused:
            await store.admit(Claim("demo", "total", 0.05, 1.0, run_id="run_s", create=again))
        found = refused.value.stored
        assert found is not None and (found.revision, found.turns, found.messages) == (
            1, 3, [{"role": "user", "content": "first"}])
        assert await store.team_spend("demo", "total") == (0.0, 0.0)  # nothing held
    finally:
        await store.close()


async def test_after_the_server_restarted_the_first_calls_are_served(tmp_path: Path) -> None:
    """Idle connections the server closed (a restart, a failover) are connected again before
    use, the lane's and the client's: nothing was sent on them, so the call is not refused
    with a 503 while the server is up again. (redis-py 8's pool skips that check while its
    maintenance notifications are "auto", the default; the store turns them off.)"""
    exe = shutil.which("redis-server")
    assert exe is not None
    proc, port = _start_redis(exe, tmp_path)
    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="restart:", timeout_s=5.0)
    try:
        await store.create_run(RunState.new("m", [], run_id="run_r", team="demo"))
        await asyncio.gather(*(store.load_run("run_r") for _ in range(3)))  # idle connections
        await asyncio.gather(*(store.events("run_r") for _ in range(3)))  # the client's own
        proc.terminate()
        proc.wait()
        proc, _ = _start_redis(exe, tmp_path, port=port)
        idle = list(store._lane._idle) + list(store._redis().connection_pool._available_connections)
        assert len(idle) == 6
        async with asyncio.timeout(10):  # the loop reads their EOF, as a serving gateway's does between calls
            while not all(c._reader is not None and c._reader.at_eof() for c in idle):
                await asyncio.sleep(0)
        for _ in range(4):
            assert await store.load_run("run_r") is None  # the new server has no data; no error
            assert await store.events("run_r") == []
    finally:
        await store.close()
        proc.kill()
        proc.wait()


async def test_with_wait_replicas_and_none_confirming_writes_fail_and_reads_do_not(redis_url: str) -> None:
    # A lone master (no replica): every write waits for one that never confirms, and fails as
    # a store outage; reads (a run, the ledger, the keys every process polls, the audit log,
    # spend rows) never wait, so they are answered as usual.
    plain = RedisStore(redis_url, "lone:")
    waiting = RedisStore(redis_url, "lone:", wait_replicas=1, wait_timeout_s=0.05)
    try:
        await plain.create_run(RunState.new("m", [{"role": "user", "content": "x"}], run_id="demo/r", team="demo"))
        with pytest.raises(StoreError):
            await waiting.charge("demo", "total", 1.0)
        assert (await waiting.load_run("demo/r")) is not None
        assert await waiting.team_spend("demo", "total") == (1.0, 0.0)  # the master made the write: not confirmed
        assert await waiting.keys_since(0) == ([], 0) and await waiting.list_keys() == []
        assert await waiting.audit_log() == [] and await waiting.events("demo/r") == []
    finally:
        await plain.close()
        await waiting.close()
