"""The Store contract, run against every backend: memory, SQLite file, real redis-server."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from gateway.harness.state import RunState
from gateway.harness.usage import Usage
from gateway.store.audit import AuditEntry
from gateway.store.base import Attribution, Booking, Claim, Lease, Store
from gateway.store.errors import LeaseLost, RunExists, RunNotFound, StaleRun, StoreError
from gateway.store.outbox import Notice
from gateway.store.periods import period_key
from tests.store.conftest import Stores


def make_run(run_id: str, *, team: str = "demo", created_at: float = 1_800_000_000.0, n: int = 2) -> RunState:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(n)]
    return RunState.new("scripted-plan", messages, run_id=run_id, team=team, policy="files", created_at=created_at)


# --- runs ---------------------------------------------------------------------------------


async def test_create_then_load_gives_back_the_same_run(store: Store) -> None:
    run = make_run("run_a")
    run.turns, run.usage, run.cost_usd = 2, Usage(473, 40), 0.001426
    await store.create_run(run)
    loaded = await store.load_run("run_a")
    assert loaded is not None
    assert loaded.to_json() == run.to_json()
    assert await store.load_run("run_missing") is None


async def test_create_refuses_an_existing_id(store: Store) -> None:
    await store.create_run(make_run("run_a"))
    with pytest.raises(RunExists, match="run_a"):
        await store.create_run(make_run("run_a", team="other"))
    loaded = await store.load_run("run_a")
    assert loaded is not None and loaded.team == "demo"


async def test_save_bumps_revision_and_stores_the_change(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    before = run.updated_at
    run.messages.append({"role": "user", "content": "more"})
    run.turns = 1
    await store.save_run(run)
    assert run.revision == 1 and run.updated_at > before
    await store.save_run(run)
    assert run.revision == 2
    loaded = await store.load_run("run_a")
    assert loaded is not None
    assert (loaded.revision, loaded.turns, len(loaded.messages)) == (2, 1, 3)
    assert loaded.updated_at == run.updated_at


async def test_a_loaded_copy_is_not_shared_with_the_store(store: Store) -> None:
    run = make_run("run_a")
    await store.create_run(run)
    run.messages.append({"role": "user", "content": "not saved"})
    loaded = await store.load_run("run_a")
    assert loaded is not None and len(loaded.messages) == 2


async def test_a_stale_copy_cannot_overwrite_a_newer_save(stores: Stores) -> None:
    first, second = stores.open(), stores.open()  # two replicas of the same data
    await first.create_run(make_run("run_a"))
    mine, theirs = await first.load_run("run_a"), await second.load_run("run_a")
    assert mine is not None and theirs is not None
    mine.status = "completed"
    await first.save_run(mine)
    theirs.status = "failed"
    with pytest.raises(StaleRun) as caught:
        await second.save_run(theirs)
    assert (caught.value.expected, caught.value.stored) == (0, 1)
    assert theirs.revision == 0  # a refused save leaves the caller's copy as it was
    stored = await second.load_run("run_a")
    assert stored is not None and stored.status == "completed" and stored.revision == 1
    stored.status = "failed"
    await second.save_run(stored)  # reload, decide again, save: accepted
    assert stored.revision == 2


async def test_concurrent_saves_of_one_revision_let_exactly_one_win(stores: Stores) -> None:
    await stores.open().create_run(make_run("run_a"))
    views = [stores.open() for _ in range(2)]
    copies = [await views[i % 2].load_run("run_a") for i in range(10)]
    results = await asyncio.gather(
        *(views[i % 2].save_run(c) for i, c in enumerate(copies) if c is not None), return_exceptions=True
    )
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, StaleRun) for r in results if r is not None)


async def test_save_of_a_run_never_created_is_refused(store: Store) -> None:
    with pytest.raises(RunNotFound, match="run_ghost"):
        await store.save_run(make_run("run_ghost"))


async def test_list_runs_filters_by_team_and_status_newest_first(store: Store) -> None:
    specs = [("r1", "a", "completed"), ("r2", "b", "running"), ("r3", "a", "running"),
             ("r4", "a", "failed"), ("r5", "b", "completed")]
    for i, (run_id, team, status) in enumerate(specs):
        run = make_run(run_id, team=team, created_at=1_800_000_000.0 + i)
        run.status = status  # type: ignore[assignment]
        await store.create_run(run)

    def ids(runs: list[RunState]) -> list[str]:
        return [r.run_id for r in runs]

    assert ids(await store.list_runs()) == ["r5", "r4", "r3", "r2", "r1"]
    assert ids(await store.list_runs(team="a")) == ["r4", "r3", "r1"]
    assert ids(await store.list_runs(status="running")) == ["r3", "r2"]
    assert ids(await store.list_runs(team="a", status="completed")) == ["r1"]
    assert ids(await store.list_runs(team="nobody")) == []
    assert ids(await store.list_runs(limit=2)) == ["r5", "r4"]
    assert ids(await store.list_runs(team="a", limit=2)) == ["r4", "r3"]

    r3 = await store.load_run("r3")
    assert r3 is not None
    r3.status = "completed"
    await store.save_run(r3)  # a status change moves the run between filters
    assert ids(await store.list_runs(status="running")) == ["r2"]
    assert ids(await store.list_runs(team="a", status="completed")) == ["r3", "r1"]


async def test_list_runs_reads_only_the_runs_of_the_policies_asked_for(store: Store) -> None:
    # The recovery sweep asks for the runs of server-side policies only: whichever way a run
    # was stored (create_run, or its first admission), its policy is what it is filtered by.
    for i, (run_id, policy) in enumerate([("p1", "passthrough"), ("d1", "driven"), ("p2", "passthrough")]):
        run = make_run(run_id, created_at=1_800_000_000.0 + i)
        run.policy = policy
        await store.create_run(run)
    first = make_run("d2", created_at=1_800_000_010.0)
    first.policy = "driven"
    assert (await store.admit(Claim("demo", "total", run_id="d2", create=first))).reservation_id is not None

    def ids(runs: list[RunState]) -> list[str]:
        return [r.run_id for r in runs]

    assert ids(await store.list_runs(policies={"driven"})) == ["d2", "d1"]
    assert ids(await store.list_runs(policies=["driven", "passthrough"], limit=3)) == ["d2", "p2", "d1"]
    assert ids(await store.list_runs(status="running", policies={"passthrough"})) == ["p2", "p1"]
    assert ids(await store.list_runs(policies=())) == []
    d1 = await store.load_run("d1")
    assert d1 is not None
    d1.status = "interrupted"
    await store.save_run(d1)  # a save keeps the run's policy
    assert ids(await store.list_runs(status="interrupted", policies={"driven"})) == ["d1"]
    with pytest.raises(TypeError, match="policies"):
        await store.list_runs(policies="driven")


async def test_list_runs_names_bad_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="unknown run status 'done'"):
        await store.list_runs(status="done")
    with pytest.raises(ValueError, match="limit"):
        await store.list_runs(limit=0)


# --- events -------------------------------------------------------------------------------


async def test_events_keep_their_order_and_sequence_numbers(store: Store) -> None:
    await store.append_events("run_a", [{"type": "turn", "turn": 1}, {"type": "tool_start", "toolName": "list_files"}])
    await store.append_events("run_b", [{"type": "turn", "turn": 1}])
    await store.append_events("run_a", [])
    await store.append_events("run_a", [{"type": "tool_result", "ok": True}])
    assert await store.events("run_a") == [
        (1, {"type": "turn", "turn": 1}),
        (2, {"type": "tool_start", "toolName": "list_files"}),
        (3, {"type": "tool_result", "ok": True}),
    ]
    assert await store.events("run_a", after=2) == [(3, {"type": "tool_result", "ok": True})]
    assert await store.events("run_a", after=3) == []
    assert await store.events("run_b") == [(1, {"type": "turn", "turn": 1})]
    assert await store.events("run_none") == []


async def test_concurrent_appends_get_distinct_consecutive_numbers(stores: Stores) -> None:
    views = [stores.open(), stores.open()]
    await asyncio.gather(
        *(views[w % 2].append_events("run_a", [{"w": w, "i": i} for i in range(3)]) for w in range(8))
    )
    got = await views[0].events("run_a")
    assert [seq for seq, _ in got] == list(range(1, 25))
    for w in range(8):  # each batch stays contiguous and in order
        seqs = [seq for seq, e in got if e["w"] == w]
        assert [e["i"] for _, e in got if e["w"] == w] == [0, 1, 2]
        assert seqs == list(range(seqs[0], seqs[0] + 3))


# --- ledger -------------------------------------------------------------------------------


async def test_fifty_concurrent_reservations_never_exceed_the_budget(stores: Stores) -> None:
    views = [stores.open(), stores.open()]  # two replicas racing for one team budget
    results = await asyncio.gather(*(views[i % 2].reserve("demo", "2026-11", 0.01, 0.10) for i in range(50)))
    granted = [r for r in results if r is not None]
    assert len(granted) == 10 and len(set(granted)) == 10
    assert await views[0].team_spend("demo", "2026-11") == (0.0, 0.10)
    assert await views[1].reserve("demo", "2026-11", 0.000001, 0.10) is None


async def test_settle_books_the_actual_amount_once(store: Store) -> None:
    rid = await store.reserve("demo", "total", 0.05, 0.10)
    assert rid is not None
    assert await store.team_spend("demo", "total") == (0.0, 0.05)
    await store.settle(rid, 0.03)  # cheaper than reserved: the difference comes back
    assert await store.team_spend("demo", "total") == (0.03, 0.0)
    await store.settle(rid, 0.03)
    await store.settle(rid, 0.09)
    await store.release(rid)
    assert await store.team_spend("demo", "total") == (0.03, 0.0)
    assert await store.reserve("demo", "total", 0.07, 0.10) is not None  # exactly what is left
    assert await store.reserve("demo", "total", 0.000001, 0.10) is None


async def test_settle_may_book_more_than_reserved(store: Store) -> None:
    rid = await store.reserve("demo", "total", 0.01, 0.10)
    assert rid is not None
    await store.settle(rid, 0.012)
    assert await store.team_spend("demo", "total") == (0.012, 0.0)


async def test_release_gives_the_reservation_back_once(store: Store) -> None:
    rid = await store.reserve("demo", "total", 0.10, 0.10)
    assert rid is not None
    assert await store.reserve("demo", "total", 0.01, 0.10) is None
    await store.release(rid)
    await store.release(rid)
    await store.settle(rid, 0.10)  # too late: released money is not spent
    assert await store.team_spend("demo", "total") == (0.0, 0.0)
    assert await store.reserve("demo", "total", 0.10, 0.10) is not None


async def test_unknown_reservation_ids_are_no_ops(store: Store) -> None:
    await store.settle("res_unknown", 1.0)
    await store.release("res_unknown")
    assert await store.team_spend("demo", "total") == (0.0, 0.0)


async def test_sums_are_exact_in_micro_dollars(store: Store) -> None:
    for amount in (0.1, 0.2, 0.000247, 0.00247):
        await store.charge("demo", "total", amount)
    assert await store.team_spend("demo", "total") == (0.302717, 0.0)  # floats would give 0.30271700000000004
    big = await store.reserve("demo", "big", 1_234_567.891234, 5_000_000.0)
    assert big is not None
    await store.settle(big, 4_999_999.999999)
    assert await store.team_spend("demo", "big") == (4_999_999.999999, 0.0)
    assert await store.reserve("demo", "big", 0.000001, 5_000_000.0) is not None
    assert await store.reserve("demo", "big", 0.000001, 5_000_000.0) is None


async def test_expired_reservations_are_reclaimed_on_the_next_reserve(store: Store) -> None:
    dead = await store.reserve("demo", "total", 0.10, 0.10, ttl_s=0)  # its process "died" at once
    assert dead is not None
    assert (await store.team_spend("demo", "total"))[1] == 0.0
    alive = await store.reserve("demo", "total", 0.10, 0.10, ttl_s=60)
    assert alive is not None
    assert await store.reserve("demo", "total", 0.01, 0.10, ttl_s=60) is None  # live ones are not reclaimed
    await store.settle(dead, 0.004)  # a late settle still books the money that was really spent
    await store.settle(dead, 0.004)
    assert await store.team_spend("demo", "total") == (0.004, 0.10)


async def test_charge_books_spend_even_past_the_budget(store: Store) -> None:
    await store.charge("demo", "total", 0.15)
    assert await store.team_spend("demo", "total") == (0.15, 0.0)
    assert await store.reserve("demo", "total", 0.01, 0.10) is None


async def test_ledgers_are_per_team_and_per_period(store: Store) -> None:
    last_day = period_key("day", datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC))
    next_day = period_key("day", datetime(2026, 12, 1, 0, 0, 0, tzinfo=UTC))
    await store.charge("demo", last_day, 1.0)
    assert await store.reserve("demo", last_day, 0.01, 1.0) is None
    assert await store.reserve("demo", next_day, 1.0, 1.0) is not None  # the day rolled over: a fresh budget
    assert await store.reserve("ops", last_day, 1.0, 1.0) is not None
    assert await store.team_spend("demo", last_day) == (1.0, 0.0)
    assert await store.team_spend("demo", next_day) == (0.0, 1.0)


async def test_ledger_names_bad_amounts(store: Store) -> None:
    with pytest.raises(ValueError, match="amount_usd"):
        await store.reserve("demo", "total", -0.01, 1.0)
    with pytest.raises(ValueError, match="budget_usd"):
        await store.reserve("demo", "total", 0.01, float("nan"))
    with pytest.raises(ValueError, match="ttl_s"):
        await store.reserve("demo", "total", 0.01, 1.0, ttl_s=-1)
    with pytest.raises(ValueError, match="actual_usd"):
        await store.settle("res_x", float("inf"))
    with pytest.raises(TypeError, match="amount_usd"):
        await store.charge("demo", "total", "1")  # type: ignore[arg-type]


# --- leases -------------------------------------------------------------------------------


async def test_a_lease_has_one_owner_at_a_time(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    assert await a.acquire_lease("run_a", "replica-a", 30)
    assert not await b.acquire_lease("run_a", "replica-b", 30)
    assert await a.acquire_lease("run_a", "replica-a", 30)  # renewing our own lease
    assert await b.acquire_lease("run_b", "replica-b", 30)  # leases are per run
    await b.release_lease("run_a", "replica-b")  # not b's to release
    assert not await b.acquire_lease("run_a", "replica-b", 30)
    await a.release_lease("run_a", "replica-a")
    assert await b.acquire_lease("run_a", "replica-b", 30)
    assert not await a.acquire_lease("run_a", "replica-a", 30)


async def test_an_expired_lease_can_be_taken_over(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    ttl = 0.5
    taken = time.monotonic()
    assert await a.acquire_lease("run_a", "replica-a", ttl)
    assert not await b.acquire_lease("run_a", "replica-b", ttl)
    deadline = taken + 10
    while not await b.acquire_lease("run_a", "replica-b", 30):
        assert time.monotonic() < deadline, "the expired lease was never released"
        await asyncio.sleep(0.02)  # polling for expiry, the thing under test
    assert time.monotonic() - taken >= ttl * 0.9  # not before it expired (clocks differ by ms at most)
    assert not await a.acquire_lease("run_a", "replica-a", ttl)


async def test_a_restarted_owner_frees_the_leases_of_its_previous_life(stores: Stores) -> None:
    # A worker's owner name is the same after a restart: the runs its dead life drove may be
    # taken by any other worker at once, not only after the leases expire.
    a, b = stores.open(), stores.open()
    assert await a.acquire_lease("run_a", "host/w0", 30)
    assert await a.acquire_lease("run_b", "host/w0", 30)
    assert await b.acquire_lease("run_c", "host/w1", 30)
    await a.release_lease("run_b", "host/w0")
    assert await b.acquire_lease("run_b", "host/w1", 30)  # released earlier: w1's now
    assert not await b.acquire_lease("run_a", "host/w1", 30)
    await stores.open().release_owner("host/w0")  # w0 restarted
    assert await b.acquire_lease("run_a", "host/w1", 30)
    assert not await a.acquire_lease("run_b", "host/w0", 30)  # w1's leases are untouched
    assert not await a.acquire_lease("run_c", "host/w0", 30)


async def test_a_lease_keeps_its_epoch_until_another_takes_the_run(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    first = await a.acquire_lease("run_a", "replica-a", 30)
    assert first is not None and (first.run_id, first.owner) == ("run_a", "replica-a")
    assert await a.acquire_lease("run_a", "replica-a", 30) == first  # renewed: the same lease
    await a.release_lease("run_a", "replica-a")
    taken = time.monotonic()
    second = await b.acquire_lease("run_a", "replica-b", 0.3)
    assert second is not None and second.epoch > first.epoch
    await asyncio.sleep(max(0.0, taken + 0.4 - time.monotonic()))  # the TTL passing is the thing under test
    # lapsed, and nobody took the run meanwhile: its holder takes it back, the same lease
    assert await b.acquire_lease("run_a", "replica-b", 0.3) == second
    await asyncio.sleep(0.4)
    third = await a.acquire_lease("run_a", "replica-a", 30)  # lapsed again, and now another takes it
    assert third is not None and third.epoch > second.epoch
    assert await b.acquire_lease("run_a", "replica-b", 30) is None
    await a.release_lease("run_a", "replica-a")
    fourth = await a.acquire_lease("run_a", "replica-a", 30)  # after a release: a new lease, even for its owner
    assert fourth is not None and fourth.epoch > third.epoch


async def a_leased_run(store: Store, owner: str, ttl_s: float) -> tuple[RunState, Lease]:
    """A new run `run_a` and a lease on it for `owner`."""
    run = make_run("run_a")
    await store.create_run(run)
    lease = await store.acquire_lease("run_a", owner, ttl_s)
    assert lease is not None
    return run, lease


async def taken_over(store: Store) -> Lease:
    """`run_a`'s lease taken by replica-b through `store`, polled until the last one expired."""
    deadline = time.monotonic() + 10
    while (taken := await store.acquire_lease("run_a", "replica-b", 30)) is None:
        assert time.monotonic() < deadline, "the lease never expired"
        await asyncio.sleep(0.05)  # polling for expiry, the thing under test
    return taken


async def test_writes_under_a_lease_are_refused_once_another_holds_it(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    rule = lambda run_id, events: [Notice(f"{run_id}:{e['n']}", b"x") for e in events if e.get("n")]  # noqa: E731
    a.notice_rule = b.notice_rule = rule
    run, lease = await a_leased_run(a, "replica-a", 0.3)
    await a.append_events("run_a", [{"type": "tool_start", "n": 1}], lease=lease)
    await a.commit_turn(run, [{"type": "turn"}], lease=lease)
    await a.save_run(run, lease=lease)
    assert run.revision == 2
    taken = await taken_over(b)
    assert taken.epoch > lease.epoch
    late = run.copy()
    late.status = "interrupted"
    late.messages.append({"role": "tool", "tool_call_id": "c1", "name": "write", "content": "late"})
    with pytest.raises(LeaseLost, match="run_a"):
        await a.append_events("run_a", [{"type": "tool_result", "n": 2}], lease=lease)
    with pytest.raises(LeaseLost):
        await a.commit_turn(late, [{"type": "run_stopped", "n": 3}], lease=lease)
    with pytest.raises(LeaseLost):
        await a.save_run(late, lease=lease)
    assert late.revision == 2  # refused: the copy is untouched
    stale = late.copy()
    stale.revision = 1
    with pytest.raises(LeaseLost):  # the fence is checked before the revision
        await a.save_run(stale, lease=lease)
    stored = await b.load_run("run_a")
    assert stored is not None and (stored.revision, stored.status) == (2, "running")
    assert stored.messages == run.messages  # nothing of the refused saves' transcript
    assert [e["type"] for _, e in await b.events("run_a")] == ["tool_start", "turn"]
    assert [c.id for c in await b.claim_notices("b", 10, 30.0)] == ["run_a:1"]  # no notice of a refused line
    await b.commit_turn(stored, [{"type": "run_resumed"}], lease=taken)  # the holder writes
    assert [e["type"] for _, e in await a.events("run_a")] == ["tool_start", "turn", "run_resumed"]


async def test_a_fenced_commit_books_nothing_and_records_nothing(stores: Stores) -> None:
    # The commit step of a drive that lost its lease carries a booking and audit records:
    # refused, none of it lands (no ledger, no spend row, no audit record, no line).
    a, b = stores.open(), stores.open()
    run, lease = await a_leased_run(a, "replica-a", 0.2)
    await taken_over(b)
    period = period_key("day")
    booking = Booking("demo", period, 0.25, attribution=Attribution("key_1", "ana", "gpt-x", "files"))
    entry = AuditEntry("run.resumed", "ops", "key_ops", "run_a", team="demo")
    with pytest.raises(LeaseLost):
        await a.commit_turn(run.copy(), [{"type": "turn"}], booking, [entry], lease=lease)
    assert await b.team_spend("demo", period) == (0.0, 0.0)
    assert await b.spend("2000-01-01", "2999-12-31") == []
    assert await b.audit_log() == [] and await b.events("run_a") == []
    await a.commit_turn(run, [{"type": "turn"}], booking, [entry])  # the same step without the lease lands
    assert (await b.team_spend("demo", period))[0] == pytest.approx(0.25)
    assert [r.action for r in await b.audit_log()] == ["run.resumed"]


async def test_a_write_under_a_lease_that_lapsed_counts_until_another_takes_the_run(store: Store) -> None:
    run, lease = await a_leased_run(store, "replica-a", 0.2)
    await asyncio.sleep(0.3)  # lapsed (the TTL passing is the thing under test), nobody took it
    await store.commit_turn(run, [{"type": "turn"}], lease=lease)
    assert run.revision == 1
    await store.release_lease("run_a", "replica-a")
    with pytest.raises(LeaseLost):  # released: its writes are over
        await store.commit_turn(run, [{"type": "turn"}], lease=lease)
    with pytest.raises(LeaseLost):
        await store.append_events("run_a", [{"type": "turn"}], lease=lease)
    assert [e["type"] for _, e in await store.events("run_a")] == ["turn"] and run.revision == 1


async def test_a_restarted_owners_old_leases_write_nothing(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    run, lease = await a_leased_run(a, "host/w0", 30)
    await b.release_owner("host/w0")  # w0 restarted, under the same owner name
    with pytest.raises(LeaseLost):
        await a.commit_turn(run.copy(), [{"type": "turn"}], lease=lease)
    again = await a.acquire_lease("run_a", "host/w0", 30)  # its new life takes the run: a new lease
    assert again is not None and again.epoch > lease.epoch
    with pytest.raises(LeaseLost):
        await a.save_run(run.copy(), lease=lease)
    await a.commit_turn(run, [{"type": "turn"}], lease=again)
    assert [e["type"] for _, e in await b.events("run_a")] == ["turn"]


async def test_lease_ttl_must_be_positive(store: Store) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        await store.acquire_lease("run_a", "replica-a", 0)


# --- lifecycle ----------------------------------------------------------------------------


async def test_a_closed_store_says_so(stores: Stores) -> None:
    store = stores.open()
    await store.close()
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.load_run("run_a")


# --- responses (Responses API) ------------------------------------------------------------


async def test_a_stored_response_is_seen_by_another_view_and_deleted_once(store: Store, stores: Stores) -> None:
    await store.put_response("resp_1", "demo", b'{"id": "resp_1"}')
    other = stores.open()
    assert await other.get_response("resp_1") == ("demo", b'{"id": "resp_1"}')
    assert await store.get_response("resp_missing") is None
    assert await other.delete_response("resp_1") is True
    assert await store.get_response("resp_1") is None
    assert await store.delete_response("resp_1") is False
