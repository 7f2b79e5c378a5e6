"""Limit requests across two replicas on one real redis-server (test_replicas.py's pair).

A run started by a streamed call on replica B pauses at its turn cap (`max_turns: 2,
on_exceed: ask, on_decision: resume`), shows in the inbox and `gateway approvals` of
replica A, is granted 3 more turns there, and completes by itself, B's paused call
answering. A grant whose replica died before driving it is driven by a recovery sweep,
once; under `on_decision: wait` a granted run waits for its owner however many sweeps
pass (it is never taken for crashed). The sweeps are not waited for by the clock: a run
whose approval expires at once (`files_expiring`) is started only once the granted run has
waited longer than a lease TTL, and the sweep that expires it is one that passed since.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.harness import limit_requests
from gateway.harness.state import Decision, scoped_run_id
from tests.server.served import DEMO, OPS, PLAN_ANSWER, chat_body, events, get_run, poll, request
from tests.server.test_limit_requests import inbox, settled, streamed
from tests.server.test_replicas import LEASE_TTL_S, Pair, session, start_pair  # noqa: F401  (fixtures)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.procs import ROOT, run_gateway


def expiring() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())
    data["approval"]["expires_after_s"] = 0.05
    return data


def asking(on_decision: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())
    data["limits"].update(max_turns=2, on_exceed="ask", ask={"grant": {"max_turns": 3}})
    data["approval"]["on_decision"] = on_decision
    return data


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Pair]:  # noqa: F811
    started = start_pair(tmp_path_factory.mktemp("limit_replicas"), redis_url,
                         {"files_ask": asking("resume"), "files_ask_wait": asking("wait"),
                          "files_expiring": expiring()})
    yield started
    started.a.stop()
    started.b.stop()


async def test_granted_on_a_the_run_paused_on_b_completes_by_itself(pair: Pair,
                                                                    session: aiohttp.ClientSession) -> None:
    run_id = f"ask-{uuid.uuid4().hex[:8]}"
    paused = asyncio.ensure_future(streamed(session, pair.b.url, "files_ask", run_id))

    async def asked() -> dict[str, Any] | None:
        status, _, run = await request(session, "GET", f"{pair.a.url}/v1/runs/{run_id}")
        return run if status == 200 and run["reason"] == "limit" else None

    run = await poll(asked, timeout=30)
    assert run["turns"] == 2 and run["interruption"]["limit"] == "max_turns"
    request_id = run["interruption"]["call_id"]
    assert [i["kind"] for i in await inbox(pair.a.url) if i["run_id"] == run_id] == ["limit"]
    env = {**os.environ, "GATEWAY_URL": pair.a.url, "GATEWAY_KEY": OPS}
    listed = await asyncio.to_thread(run_gateway, ["approvals", "list"], env=env)
    assert any(r.startswith(f"demo/{run_id} ") and request_id in r for r in listed.stdout.splitlines()), listed

    granted = await asyncio.to_thread(run_gateway, ["approvals", "approve", f"demo/{run_id}", request_id,
                                                    "--grant", "max_turns=3"], env=env)
    assert granted.returncode == 0, granted.stderr
    content, comments = await asyncio.wait_for(paused, timeout=30)
    assert content == PLAN_ANSWER, comments
    run = await get_run(session, pair.b.url, run_id)
    assert run["status"] == "completed" and run["turns"] <= 5 and run["limits"]["max_turns"] == 5
    trace = await events(session, pair.a.url, run_id)
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["gateway-on-decision"]
    assert Counter(e["callId"] for e in trace if e["type"] == "tool_start") == {"c1": 1, "c2": 1}
    granted_line = next(e for e in trace if e["type"] == "limit_granted")
    assert (granted_line["by"], granted_line["before"], granted_line["after"]) == (
        "ops", {"max_turns": 2}, {"max_turns": 5})


async def grant_in_store(pair: Pair, run_id: str) -> None:
    """What a replica that died right after recording a grant leaves: granted, undriven."""
    store = pair.store()
    try:
        state = await store.load_run(scoped_run_id("demo", run_id))
        assert state is not None and state.interruption is not None and state.interruption.call_id is not None
        limit_requests.grant(state, state.interruption.call_id, Decision("approve", "", "ops"), {"max_turns": 3},
                             time.time())
        await store.save_run(state)
    finally:
        await store.close()


async def a_sweep_after(session: aiohttp.ClientSession, pair: Pair, moment: float) -> None:
    """Return once a recovery sweep that started after `moment` (epoch seconds) has run."""
    await poll(lambda: _past(moment), timeout=30)
    status, headers, body = await request(session, "POST", f"{pair.a.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"),
                                          headers={"X-Policy": "files_expiring"})
    assert status == 200 and body["run"]["interruption"]["type"] == "approval", body
    run_id = headers["X-Run-Id"]

    async def expired() -> bool:
        return any(e["type"] == "approval_expired" for e in await events(session, pair.a.url, run_id))

    await poll(expired, timeout=30)


async def _past(moment: float) -> bool:
    return time.time() > moment


async def paused(session: aiohttp.ClientSession, url: str, policy: str) -> tuple[str, dict[str, Any]]:
    """A new scripted-plan run that paused at its turn cap: (its id, its run object)."""
    status, headers, body = await request(session, "POST", f"{url}/v1/chat/completions",
                                          body=chat_body("scripted-plan"), headers={"X-Policy": policy})
    assert status == 200 and body["run"]["reason"] == "limit", body
    return headers["X-Run-Id"], body["run"]


async def test_a_grant_whose_replica_died_before_driving_is_driven_by_recovery_once(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    run_id, _ = await paused(session, pair.a.url, "files_ask")
    await grant_in_store(pair, run_id)

    run = await settled(session, pair.a.url, run_id, timeout=10 * LEASE_TTL_S + 10)  # a sweep waits a lease TTL
    assert run["status"] == "completed" and run["turns"] == 3
    trace = await events(session, pair.a.url, run_id)
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["gateway-recovery"]


async def test_a_granted_run_that_waits_for_its_owner_is_never_taken_for_crashed(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    run_id, run = await paused(session, pair.b.url, "files_ask_wait")
    request_id = run["interruption"]["call_id"]
    status, _, answer = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/approvals", key=OPS,
                                      body={"call_id": request_id, "decision": "approve"})
    assert status == 200, answer
    granted = await get_run(session, pair.a.url, run_id)
    assert (granted["interruption"]["decision"], granted["interruption"]["waiting_for"]) == ("approve", "resume")
    # Sweeps run every LEASE_TTL_S / 2 on both replicas and leave a decided run alone for one
    # lease TTL: wait for a sweep that began once this run had waited two.
    await a_sweep_after(session, pair, granted["updated_at"] + 2 * LEASE_TTL_S)
    run = await get_run(session, pair.a.url, run_id)
    assert (run["status"], run["reason"]) == ("interrupted", "limit") and request_id in run["decisions"]
    assert not [e for e in await events(session, pair.a.url, run_id) if e["type"] == "run_resumed"]
    status, _, body = await request(session, "POST", f"{pair.b.url}/v1/runs/{run_id}/resume", key=DEMO, body={})
    assert status == 200 and body["run"]["status"] == "completed" and body["run"]["turns"] == 3, body
    assert body["choices"][0]["message"]["content"] == PLAN_ANSWER
