"""The keyring (gateway/server/http/auth.py) over a real store: config keys as before, store
keys seen after a sync, and every way a key stops working (revoked, expired, rotated out
past its grace, its team gone), with no store round trip on a lookup of a known secret; an
unknown secret is looked for in the store's new keys first, by one read shared by every
call waiting."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gateway.config.keys import config_key_id
from gateway.config.rates import RateLimits
from gateway.config.settings import TeamConfig
from gateway.server.http.auth import KeyRing
from gateway.store.keys import KeyRecord, new_key_id, new_secret, secret_hash, visible_prefix
from gateway.store.sqlite import SqliteStore
from gateway.config.keys import ConfigKey

TEAMS = (TeamConfig("demo", ("sk-demo",), ("passthrough", "files"), config_keys=(ConfigKey("sk-demo"),)),
         TeamConfig("ops", ("sk-ops",), ("passthrough",), admin=True, config_keys=(ConfigKey("sk-ops"),)))


def issued(team: str = "demo", **kw: object) -> tuple[str, KeyRecord]:
    secret = new_secret()
    fields: dict[str, object] = {"id": new_key_id(), "team": team, "name": "agent", "prefix": visible_prefix(secret),
                                 "secret_hash": secret_hash(secret), "created_at": time.time()}
    fields.update(kw)
    return secret, KeyRecord(**fields)  # type: ignore[arg-type]


async def test_store_keys_work_once_synced_and_stop_as_their_records_say(tmp_path: Path) -> None:
    store, other = SqliteStore(tmp_path / "s.db"), SqliteStore(tmp_path / "s.db")  # this process, another replica
    ring = KeyRing(TEAMS, store)
    try:
        config = ring.team("sk-demo")
        assert config is not None and config.caller is not None and config.caller.key_id == config_key_id("sk-demo")
        assert config.caller.source == "config"
        secret, record = issued(policies=("files",), models=("gpt-*",), user="ana",
                                rate_limits={"requests_per_minute": 5}, budget_usd=2.0)
        stored = await other.put_key(record, None)
        assert ring.team(secret) is None  # not synced yet: no store round trip on a lookup
        assert await ring.sync() == 1 and await ring.sync() == 0
        view = ring.team(secret)
        assert view is not None and view.name == "demo" and view.policies == ("files",)
        assert view.caller is not None and view.caller.key_id == record.id and view.caller.user == "ana"
        assert view.caller.models == ("gpt-*",) and view.caller.budget_usd == 2.0
        assert view.caller.limits == RateLimits(60.0, 5) and view.caller.scope == "key:" + record.id
        assert ring.used.keys() == {record.id}

        # rotated with a grace: both secrets work until it ends, then only the new one
        new = new_secret()
        rotated = await other.put_key(stored.with_changes(
            secret_hash=secret_hash(new), prefix=visible_prefix(new), previous_hash=stored.secret_hash,
            previous_until=time.time() + 0.3, generation=2), stored.revision)
        await ring.sync()
        assert ring.team(secret) is not None and ring.team(new) is not None
        assert ring.view_by_id(record.id, generation=1) is None and ring.view_by_id(record.id, generation=2)
        deadline = time.monotonic() + 5
        while ring.team(secret) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the grace ends by the clock, no sync needed
        assert ring.team(secret) is None and "rotated out" in ring.refusal(secret)
        assert ring.team(new) is not None

        revoked = await other.put_key(rotated.with_changes(revoked_at=time.time()), rotated.revision)
        await ring.sync()
        assert ring.team(new) is None and "revoked" in ring.refusal(new)
        assert ring.view_by_id(record.id) is None

        secret2, expiring = issued(expires_at=time.time() - 1)
        await other.put_key(expiring, None)
        await ring.sync()
        assert ring.team(secret2) is None and "expired" in ring.refusal(secret2)
        assert revoked.revision < ring.revision
    finally:
        await store.close()
        await other.close()


async def test_a_key_whose_team_left_the_config_is_refused_and_comes_back_with_it(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    ring = KeyRing(TEAMS, store)
    try:
        secret, record = issued("gone")
        await store.put_key(record, None)
        await ring.sync()
        assert ring.team(secret) is None and "no longer in the gateway's config" in ring.refusal(secret)
        ring.set_teams([*TEAMS, TeamConfig("gone", ("sk-gone",), ("passthrough",))])
        assert ring.team(secret) is not None
        assert ring.team("sk-gone") is None  # no config_keys given: only those are keys
        assert "no team has this key" in ring.refusal("sk-nobody")
    finally:
        await store.close()


async def test_last_use_is_written_coarsely(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    ring = KeyRing(TEAMS, store)
    try:
        secret, record = issued()
        await store.put_key(record, None)
        await ring.sync()
        for _ in range(50):
            assert ring.team(secret) is not None
        await ring.flush_used()
        got = await store.get_key(record.id)
        assert got is not None and got.last_used_at is not None and ring.used == {}
    finally:
        await store.close()


class CountingStore(SqliteStore):
    """A real SQLite store that counts its key reads, each answered a little later, as a
    store across the network (Redis) answers: calls arrive while a read is in flight."""

    reads = 0

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        self.reads += 1
        await asyncio.sleep(0.01)
        return await super().keys_since(revision)


async def test_an_unknown_secret_is_looked_for_in_the_store_by_one_read_shared_by_every_call_waiting(
        tmp_path: Path) -> None:
    store, other = CountingStore(tmp_path / "s.db"), SqliteStore(tmp_path / "s.db")
    ring = KeyRing(TEAMS, store)
    try:
        secret, record = issued()
        await other.put_key(record, None)  # created on another process
        assert ring.team(secret) is None and not ring.knows(secret)
        view = await ring.find(secret)  # the keyring reads the store's new keys before refusing
        assert view is not None and view.caller is not None and view.caller.key_id == record.id
        assert await ring.find_by_id(record.id) is not None and store.reads == 1
        assert await ring.find(secret) is not None and store.reads == 1  # known: no store round trip

        reads = store.reads
        found = await asyncio.gather(*(ring.find(f"gw-nobody-{i}") for i in range(50)))
        assert found == [None] * 50 and store.reads - reads <= 2  # one read in flight, one after it
        assert "no team has this key" in ring.refusal("gw-nobody-0")

        secret2, record2 = issued()
        await other.put_key(record2, None)
        assert await ring.find_by_id(record2.id) is not None  # a console session's key, by id
    finally:
        await store.close()
        await other.close()
