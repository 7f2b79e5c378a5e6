"""The outbox on every backend: notices written with their trace lines, claimed with a lease,
retried, given up, pruned; and a refused commit writes none."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from gateway.harness.state import RunState
from gateway.store.base import Store
from gateway.store.errors import StaleRun
from gateway.store.outbox import Notice
from tests.store.conftest import Stores


def _rule(run_id: str, events: Sequence[dict[str, Any]]) -> list[Notice]:
    return [Notice(f"{run_id}:{e['n']}", f"body {e['n']}".encode()) for e in events if e.get("type") == "ping"]


def make_run(run_id: str) -> RunState:
    return RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id=run_id, team="demo")


async def test_appended_lines_bring_their_notices_in_the_same_step(stores: Stores) -> None:
    store = stores.open()
    store.notice_rule = _rule
    await store.append_events("demo/r1", [{"type": "turn"}, {"type": "ping", "n": 1}])
    run = make_run("demo/r2")
    await store.create_run(run)
    await store.commit_turn(run, [{"type": "ping", "n": 2}])
    assert await store.outbox_depth() == 2
    other = stores.open()  # another replica sees them (and needs no rule to claim them)
    claimed = await other.claim_notices("b", 10, 30.0)
    assert sorted((c.id, c.body, c.attempts) for c in claimed) == [("demo/r1:1", b"body 1", 0),
                                                                  ("demo/r2:2", b"body 2", 0)]


async def test_a_refused_commit_writes_no_notice(store: Store) -> None:
    store.notice_rule = _rule
    run = make_run("demo/r1")
    await store.create_run(run)
    stale = run.copy()
    await store.save_run(run)
    with pytest.raises(StaleRun):
        await store.commit_turn(stale, [{"type": "ping", "n": 1}])
    assert await store.outbox_depth() == 0
    assert await store.claim_notices("a", 10, 30.0) == []


async def test_a_claim_is_held_until_its_lease_ends(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    assert await a.enqueue_notices([Notice("n1", b"x")]) == 1
    assert await a.enqueue_notices([Notice("n1", b"other")]) == 0  # the id is taken
    claimed_at = time.monotonic()
    assert [c.id for c in await a.claim_notices("a", 10, 1.0)] == ["n1"]
    # Held by a: b gets nothing, unless the machine stalled past a's whole lease in between.
    assert await b.claim_notices("b", 10, 30.0) == [] or time.monotonic() - claimed_at >= 1.0
    deadline = time.monotonic() + 10
    while not (got := await b.claim_notices("b", 10, 30.0)) and time.monotonic() < deadline:
        await _tick()
    assert [(c.id, c.body) for c in got] == [("n1", b"x")]  # a's lease ended: anyone's again
    await a.notice_failed("n1", "a", 0.0, "late")  # a no longer holds it: nothing happens
    assert await a.claim_notices("a", 10, 30.0) == []
    await b.notice_sent("n1")
    assert await a.outbox_depth() == 0


async def test_a_restarted_owner_takes_back_the_notices_its_previous_life_held(stores: Stores) -> None:
    """An owner name is never live in two processes: when it starts again (release_owner),
    what its dead previous life was delivering is due again at once, not after the lease."""
    a, b = stores.open(), stores.open()
    await a.enqueue_notices([Notice("n1", b"x"), Notice("n2", b"y")])
    assert sorted(c.id for c in await a.claim_notices("a", 1, 300.0)) == ["n1"]
    assert [c.id for c in await b.claim_notices("b", 1, 300.0)] == ["n2"]
    assert await a.claim_notices("a", 10, 300.0) == []  # both held for 5 minutes
    await a.release_owner("a")  # a restarted
    assert [(c.id, c.body) for c in await a.claim_notices("a", 10, 300.0)] == [("n1", b"x")]  # b's stays b's
    await a.notice_sent("n1")
    await b.notice_sent("n2")
    assert await a.outbox_depth() == 0


async def test_a_failed_attempt_is_retried_later_then_given_up(store: Store) -> None:
    await store.enqueue_notices([Notice("n1", b"x")])
    [claim] = await store.claim_notices("a", 10, 30.0)
    await store.notice_failed("n1", "a", 3600.0, "HTTP 500")
    assert await store.claim_notices("a", 10, 30.0) == []  # not due for an hour
    assert await store.outbox_depth() == 1
    await store.enqueue_notices([Notice("n2", b"y")])
    [claim] = await store.claim_notices("a", 10, 30.0)
    assert claim.id == "n2"
    await store.notice_failed("n2", "a", 0.0, "HTTP 500")
    [claim] = await store.claim_notices("a", 10, 30.0)
    assert (claim.id, claim.attempts) == ("n2", 1)
    await store.notice_failed("n2", "a", None, "HTTP 500")  # given up
    assert await store.outbox_depth() == 1  # n1 still waits
    assert await store.claim_notices("a", 10, 30.0) == []


async def test_retention_forgets_done_notices_but_budget_ones_until_their_period_ended(store: Store) -> None:
    await store.enqueue_notices([Notice("old", b"x"), Notice("ended", b"y", period="2020-01"),
                                 Notice("current", b"y", period="9999-12"), Notice("total", b"z", period="total")])
    for claim in await store.claim_notices("a", 10, 30.0):
        await store.notice_sent(claim.id)
    await store.enqueue_notices([Notice("pending", b"w")])
    assert await store.prune_outbox(time.time() + 1) == 2  # old and ended
    assert await store.enqueue_notices([Notice("total", b"again"), Notice("current", b"again")]) == 0
    assert await store.enqueue_notices([Notice("ended", b"again")]) == 1  # forgotten
    assert await store.outbox_depth() == 2


async def _tick() -> None:
    await asyncio.sleep(0.05)  # poll interval while waiting for a lease to end
