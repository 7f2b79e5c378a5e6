"""The store contract for keys, console sessions and the audit log, on every backend
(memory, a SQLite file, a real redis-server), with two views of one store as two replicas."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.store.audit import GENESIS, AuditEntry, verify
from gateway.store.base import Store
from gateway.store.errors import KeyExists, KeyNotFound, StaleKey
from gateway.store.keys import (
    ConsoleSession,
    KeyRecord,
    new_key_id,
    new_secret,
    secret_hash,
    session_hash,
    visible_prefix,
)
from tests.store.conftest import Stores


def record(team: str = "demo", name: str = "ci", **kw: object) -> KeyRecord:
    secret = new_secret()
    fields: dict[str, object] = {"id": new_key_id(), "team": team, "name": name, "prefix": visible_prefix(secret),
                                 "secret_hash": secret_hash(secret), "created_at": time.time()}
    fields.update(kw)
    return KeyRecord(**fields)  # type: ignore[arg-type]


def entry(action: str = "key.created", team: str = "demo", target: str = "key_x") -> AuditEntry:
    return AuditEntry(action, "ops", "cfg_1", target, team, {"name": ["old", "new"]})


def test_a_secret_is_gw_and_43_base62_characters_and_its_hash_is_sha256() -> None:
    secrets = {new_secret() for _ in range(100)}
    assert len(secrets) == 100
    for s in secrets:
        assert s.startswith("gw-") and len(s) == 46 and s[3:].isalnum()
    assert len(secret_hash("gw-x")) == 64 and visible_prefix("gw-abcdefghij") == "gw-abcdef"
    ids = [new_key_id(now=t) for t in (1.0, 2.0, 1000.0)]
    assert ids == sorted(ids)  # ids list in creation order


async def test_a_key_is_written_whole_with_revisions_every_view_reads(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    key = record(models=("gpt-*",), metadata={"owner": "ana"}, budget_usd=1.5, budget_period="week")
    stored = await a.put_key(key, None)
    assert stored.revision >= 1 and stored.models == ("gpt-*",)
    with pytest.raises(KeyExists):
        await b.put_key(key, None)
    got = await b.get_key(key.id)
    assert got is not None and got.secret_hash == key.secret_hash and got.metadata == {"owner": "ana"}
    assert got.budget_usd == 1.5 and got.budget_period == "week" and got.revision == stored.revision
    changed = await b.put_key(got.with_changes(name="renamed"), got.revision)
    assert changed.revision > got.revision
    with pytest.raises(StaleKey):  # a's copy is older
        await a.put_key(stored.with_changes(name="lost"), stored.revision)
    with pytest.raises(KeyNotFound):
        await a.put_key(record(), 3)
    again = await a.get_key(key.id)
    assert again is not None and again.name == "renamed"
    assert await a.get_key("key_none") is None


async def test_keys_since_finds_every_write_after_a_revision(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    _, start = await b.keys_since(0)
    written = [await a.put_key(record(name=f"k{i}"), None) for i in range(3)]
    found, last = await b.keys_since(start)
    assert {k.id for k in found} == {k.id for k in written} and last == written[-1].revision
    assert await b.keys_since(last) == ([], last)  # nothing new: nothing read
    revoked = await a.put_key(written[0].with_changes(revoked_at=time.time()), written[0].revision)
    found, last = await b.keys_since(last)
    assert [(k.id, k.revoked_at is not None) for k in found] == [(revoked.id, True)]


async def test_concurrent_writes_of_two_views_each_get_their_own_revision(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    written = await asyncio.gather(*(views[i % 2].put_key(record(name=f"k{i}"), None) for i in range(20)))
    assert len({k.revision for k in written}) == 20
    found, _ = await views[0].keys_since(0)
    assert len(found) == 20


async def test_keys_list_in_creation_order_by_team_with_a_cursor(store: Store) -> None:
    ids = []
    for i in range(5):
        k = record(team="a" if i % 2 else "b", id=new_key_id(now=1000.0 + i))
        ids.append((await store.put_key(k, None)).id)
    every = await store.list_keys()
    assert [k.id for k in every] == ids
    first = await store.list_keys(limit=2)
    rest = await store.list_keys(after=first[-1].id, limit=10)
    assert [k.id for k in first + rest] == ids
    assert [k.id for k in await store.list_keys("a")] == [ids[1], ids[3]]


async def test_last_used_is_kept_beside_the_record_and_never_moves_back(store: Store) -> None:
    k = await store.put_key(record(), None)
    await store.touch_keys({k.id: 200.0, "key_gone": 1.0})
    await store.touch_keys({k.id: 100.0})
    got = await store.get_key(k.id)
    assert got is not None and got.last_used_at == 200.0 and got.revision == k.revision  # no new revision
    assert (await store.list_keys())[0].last_used_at == 200.0


async def test_a_console_session_is_kept_by_its_hash_and_ends(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    now = time.time()
    h = session_hash("the-cookie-value")
    s = ConsoleSession(h, "ops", "cfg_1", 1, now, now + 60, now + 3600)
    await a.put_session(s, [entry("console.sign_in")])
    got = await b.get_session(h)
    assert got == s and got.live(now + 1) and not got.live(now + 61)
    await b.touch_session(h, now + 120)
    await b.touch_session(h, now + 90)  # never back
    got = await a.get_session(h)
    assert got is not None and got.idle_until == now + 120
    assert await b.prune_sessions(now + 121) == 1
    assert await a.get_session(h) is None
    await a.put_session(s)
    assert await b.delete_session(h, [entry("console.sign_out")]) is True
    assert await a.get_session(h) is None and await a.delete_session(h) is False
    assert [r.action for r in await a.audit_log()] == ["console.sign_in", "console.sign_out"]


async def test_audit_records_chain_across_views_under_concurrency(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    await asyncio.gather(*(views[i % 2].append_audit([entry(target=f"key_{i}")]) for i in range(24)),
                         *(views[i % 2].put_key(record(), None, [entry("key.created", target=f"k{i}")])
                           for i in range(8)))
    records = await views[0].audit_log(limit=1000)
    assert [r.seq for r in records] == list(range(1, 33))
    assert records[0].prev == GENESIS
    assert verify(records) == (32, None)
    tampered = [records[0], records[1].__class__(**{**records[1].__dict__, "target": "key_evil"}), *records[2:]]
    checked, problem = verify(tampered)
    assert checked == 1 and problem is not None and "record 2" in problem
    assert verify([records[0], *records[2:]])[1] is not None  # one removed


async def test_the_audit_log_filters_and_pages(store: Store) -> None:
    await store.append_audit([entry("key.created", team="a"), entry("key.revoked", team="b"),
                              AuditEntry("config.reloaded", "a", "cfg_2", "config.yaml", "", {}),
                              entry("key.created", team="b")])
    assert [r.seq for r in await store.audit_log(action="key.created")] == [1, 4]
    assert [r.seq for r in await store.audit_log(team="a")] == [1, 3]  # concerning a, or made by a
    assert [r.seq for r in await store.audit_log(after_seq=2, limit=1)] == [3]
    assert await store.audit_log(since=time.time() + 60) == []


async def test_audit_retention_keeps_the_newest_record_and_the_chain_continues(store: Store) -> None:
    old = await store.append_audit([AuditEntry("key.created", "a", "k", "x", "a", {}, at=1000.0 + i)
                                    for i in range(3)])
    assert await store.prune_audit(time.time()) == 2  # the newest stays
    kept = await store.audit_log()
    assert [r.seq for r in kept] == [3]
    more = await store.append_audit([entry()])
    assert more[0].seq == 4 and more[0].prev == old[-1].hash
    assert verify(await store.audit_log())[1] is None


async def test_a_runs_audit_record_is_written_with_its_save_or_not_at_all(stores: Stores) -> None:
    from gateway.store.errors import StaleRun
    from tests.store.test_admit import new_run

    a, b = stores.open(), stores.open()
    run = await new_run(a)
    stale = run.copy()
    await a.commit_turn(run, [], audit=[entry("approval.decided", target="run_a")])
    with pytest.raises(StaleRun):  # b's copy is older: nothing of the step is written, its record neither
        await b.commit_turn(stale, [], audit=[entry("run.cancelled", target="run_a")])
    assert [r.action for r in await b.audit_log()] == ["approval.decided"]
