"""`on_decision: resume` across two replicas on one real redis-server (tests/server/test_replicas.py's pair).

Approve on replica A a run that B started and whose streamed call on B is paused: the run
completes by itself, driven by whichever replica takes its lease, and B's paused call
answers. If the deciding replica dies before driving (the decision is written straight to
the store here), a replica's recovery sweep resumes the run. Either way no tool runs twice.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import aiohttp
import orjson

from gateway.harness.approvals import decide
from gateway.harness.state import Decision, scoped_run_id
from tests.server.served import OPS, chat_body, events, get_run, poll, request, wait_event
from tests.server.test_auto_resume import streamed_chat
from tests.server.test_replicas import LEASE_TTL_S, Pair, pair, replica_pair, session  # noqa: F401  (fixtures)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)

DELETED = "Deleted access.log to free space."


async def streamed_answer(session: aiohttp.ClientSession, url: str, run_id: str) -> tuple[str, list[str]]:
    """A streamed chat call starting a files_auto run: (its answer, its progress comments)."""
    return await streamed_chat(session, url, run_id, "files_auto", "scripted-destructive")


def tool_starts(pair: Pair, run_id: str) -> dict[str, Counter[str]]:
    """Which replica ran which call (each writes its own trace file)."""
    return {name: Counter(e["callId"] for e in pair.trace_file(name, run_id) if e["type"] == "tool_start")
            for name in ("a", "b")}


async def test_approved_on_a_the_run_paused_on_b_completes_by_itself_once(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    run_id = f"auto-{uuid.uuid4().hex[:8]}"
    paused = asyncio.ensure_future(streamed_answer(session, pair.b.url, run_id))
    await wait_event(session, pair.a.url, run_id, "approval_required")
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve", "reason": "old logs"})
    assert status == 200, body
    content, comments = await asyncio.wait_for(paused, timeout=30)
    assert content == DELETED, comments
    assert any(c.startswith("run_resumed") for c in comments)  # B's caller saw the run go on

    run = await get_run(session, pair.b.url, run_id)
    assert run["status"] == "completed" and run["turns"] == 3
    trace = await events(session, pair.a.url, run_id)
    assert Counter(e["callId"] for e in trace if e["type"] == "tool_start") == {"c1": 1, "c2": 1}
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["gateway-on-decision"]
    starts = tool_starts(pair, run_id)
    assert starts["a"]["c2"] + starts["b"]["c2"] == 1  # driven by one replica: the one that took the lease
    journal = [orjson.loads(line)["path"] for line in (pair.sandbox(run_id) / ".deleted.jsonl").read_bytes().splitlines()]
    assert journal == ["access.log"]


async def test_a_decision_whose_replica_died_before_driving_is_resumed_by_recovery(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{pair.a.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files_auto"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    run_id = headers["X-Run-Id"]
    # what a replica that died right after recording the decision leaves: decided, `running`, undriven
    store = pair.store()
    try:
        state = await store.load_run(scoped_run_id("demo", run_id))
        assert state is not None
        decide(state, "c2", Decision("approve", "", "ops"))
        await store.save_run(state)
    finally:
        await store.close()

    async def completed() -> dict[str, Any] | None:
        run = await get_run(session, pair.a.url, run_id)
        return run if run["status"] == "completed" else None

    run = await poll(completed, timeout=10 * LEASE_TTL_S + 10)  # the sweep waits one lease TTL, then resumes
    assert run["transcript"][-1]["content"] == DELETED
    trace = await events(session, pair.a.url, run_id)
    assert Counter(e["callId"] for e in trace if e["type"] == "tool_start") == {"c1": 1, "c2": 1}
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["gateway-recovery"]
    starts = tool_starts(pair, run_id)
    assert starts["a"]["c2"] + starts["b"]["c2"] == 1
