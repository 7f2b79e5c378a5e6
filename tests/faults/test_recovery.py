"""Runs cut by a crash and approvals nobody decides are settled without anyone acting.

Real processes: a gateway (SQLite, `server.lease_ttl_s: 1`, so recovery sweeps every
0.5 s) is SIGKILLed while server-side runs are inside a slow tool; the restarted process
stops them as `interrupted`/`crashed` (they can be resumed and then complete), or, under
a policy with `recovery: resume`, finishes them by itself. A run waiting for a decision
past `expires_after_s` gets the expiry's rejection from the sweeper. One crash (a module
fixture: runs of both policies cut at once) serves the first three tests; the last one
crashes a replica of a pair on Redis.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.faults.support import RedisProc, chat, files_variant, restart, serve
from tests.server.served import DEMO, TASK, events, get_run, poll, request, wait_event
from tests.support.procs import Proc

SLOW_BODY: dict[str, Any] = {"model": "scripted-slow", "messages": TASK}
RUNS = 6
SQLITE = {"kind": "sqlite", "path": "./gateway.db"}
CUT_POLICIES = ("files", "files_resume")


async def start_slow_runs(session: aiohttp.ClientSession, gw: Proc, policy: str) -> tuple[list[str], list[Any]]:
    """RUNS server-side runs, each inside its 3-second scan_archive tool when this returns."""
    ids = [f"run_crash_{policy}_{i}" for i in range(RUNS)]
    calls = [asyncio.ensure_future(chat(session, gw.url, SLOW_BODY, headers={"X-Policy": policy, "X-Run-Id": rid}))
             for rid in ids]
    for rid in ids:
        await wait_event(session, gw.url, rid, "tool_start")
    return ids, calls


async def kill(gw: Proc, calls: list[Any]) -> None:
    gw.kill()
    await asyncio.gather(*calls, return_exceptions=True)  # the client sees its connection cut


async def statuses(session: aiohttp.ClientSession, url: str, ids: list[str]) -> dict[str, str]:
    return {rid: (await get_run(session, url, rid))["status"] for rid in ids}


@dataclass
class Crashed:
    """The module's gateway after its crash: restarted, with the ids of the runs it cut."""

    gw: Proc
    cut: dict[str, list[str]]
    """policy -> the runs it was driving inside their slow tool when it was SIGKILLed"""
    stored: dict[str, str]
    """what the SQLite file said of the cut runs before the restart"""


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crashed]:
    """One gateway (SQLite, lease 1 s) SIGKILLed while runs under `files` and under
    `files_resume` (recovery: resume) are inside their slow tool, then restarted: the
    module's tests check what the restarted process did with each."""
    folder = tmp_path_factory.mktemp("recovery") / "gw"
    expiring = files_variant("files_expiring")
    expiring["approval"]["expires_after_s"] = 0.3
    gw = serve(folder, SQLITE, server={"lease_ttl_s": 1},
               variants=[files_variant("files_resume", recovery="resume"), expiring])
    try:
        async def cut() -> tuple[dict[str, list[str]], dict[str, str]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                started = [await start_slow_runs(session, gw, policy) for policy in CUT_POLICIES]
                await kill(gw, [call for _, calls in started for call in calls])
            ids = {policy: rids for policy, (rids, _) in zip(CUT_POLICIES, started)}
            return ids, await _stored_statuses(folder, [rid for rids in ids.values() for rid in rids])

        with ThreadPoolExecutor(1) as thread:  # a loop of its own, outside the tests' loops
            ids, stored = thread.submit(asyncio.run, cut()).result()
        gw = restart(gw, folder)
        yield Crashed(gw, ids, stored)
    finally:
        gw.stop()


async def test_runs_cut_by_a_crash_are_interrupted_as_crashed_and_resumable(
        crashed: Crashed, session: aiohttp.ClientSession) -> None:
    gw, ids = crashed.gw, crashed.cut["files"]
    assert {crashed.stored[rid] for rid in ids} == {"running"}

    async def settled() -> dict[str, str] | None:
        found = await statuses(session, gw.url, ids)
        return found if "running" not in found.values() else None

    assert set((await poll(settled)).values()) == {"interrupted"}
    for rid in ids:
        run = await get_run(session, gw.url, rid)
        assert run["reason"] == "crashed"
        assert run["interruption"]["type"] == "crashed"
        stops = [e for e in await events(session, gw.url, rid) if e["type"] == "run_stopped"]
        assert [(e["status"], e["reason"]) for e in stops] == [("interrupted", "crashed")]
    status, _, body = await request(session, "POST", f"{gw.url}/v1/runs/{ids[0]}/resume", body={})
    assert status == 200, body
    assert (await get_run(session, gw.url, ids[0]))["status"] == "completed"
    turns = [e for e in await events(session, gw.url, ids[0]) if e["type"] == "turn"]
    assert len(turns) == 2  # the turn paid before the crash is not paid again


async def test_a_policy_with_recovery_resume_finishes_crashed_runs_by_itself(
        crashed: Crashed, session: aiohttp.ClientSession) -> None:
    gw, ids = crashed.gw, crashed.cut["files_resume"]
    assert {crashed.stored[rid] for rid in ids} == {"running"}

    async def completed() -> bool:
        return set((await statuses(session, gw.url, ids)).values()) == {"completed"}

    await poll(completed, timeout=30)
    for rid in ids:
        kinds = [e["type"] for e in await events(session, gw.url, rid)]
        assert kinds.count("run_resumed") == 1 and kinds.count("turn") == 2


async def test_an_expired_approval_is_swept_without_anyone_acting(
        crashed: Crashed, session: aiohttp.ClientSession) -> None:
    gw = crashed.gw
    status, headers, body = await chat(session, gw.url, {"model": "scripted-destructive", "messages": TASK},
                                       headers={"X-Policy": "files_expiring"})
    assert status == 200, body
    rid = headers["X-Run-Id"]
    run = await get_run(session, gw.url, rid)
    assert run["status"] == "interrupted" and run["interruption"]["type"] == "approval"
    call_id = run["interruption"]["call_id"]
    [swept] = await wait_event(session, gw.url, rid, "approval_expired")
    assert swept["callId"] == call_id and swept["decision"] == "reject" and swept["by"] == "approval-expiry"
    run = await get_run(session, gw.url, rid)
    assert run["decisions"][call_id]["decision"] == "reject"
    assert "expired" in run["decisions"][call_id]["reason"]
    async with session.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    assert re.search(r'^gateway_approvals_pending\{team="demo"\} 0\.0$', text, re.M), text
    status, _, body = await request(session, "POST", f"{gw.url}/v1/runs/{rid}/resume", body={}, key=DEMO)
    assert status == 200, body
    final = await get_run(session, gw.url, rid)
    assert final["status"] == "completed"
    assert "did not delete" in body["choices"][0]["message"]["content"]


async def _stored_statuses(folder: Path, ids: list[str]) -> dict[str, str]:
    """What the SQLite file says while no gateway runs (the crash left them `running`)."""
    from gateway.store.sqlite import SqliteStore

    store = SqliteStore(folder / "gateway.db")
    try:
        return {rid: run.status for rid in ids if (run := await store.load_run(f"demo/{rid}")) is not None}
    finally:
        await store.close()


async def test_another_replica_interrupts_the_runs_of_a_replica_that_died(
        tmp_path: Path, redis_proc: RedisProc, session: aiohttp.ClientSession) -> None:
    store = {"kind": "redis", "url": redis_proc.url, "prefix": "replicas:"}
    a = serve(tmp_path / "a", store, server={"lease_ttl_s": 1})
    b = serve(tmp_path / "b", store, server={"lease_ttl_s": 1})
    try:
        ids, calls = await start_slow_runs(session, a, "files")
        await kill(a, calls)  # b is never told: its sweeper finds the runs once a's leases expire

        async def settled() -> dict[str, str] | None:
            found = await statuses(session, b.url, ids)
            return found if "running" not in found.values() else None

        assert set((await poll(settled)).values()) == {"interrupted"}
        for rid in ids:
            assert (await get_run(session, b.url, rid))["reason"] == "crashed"
        status, _, body = await request(session, "POST", f"{b.url}/v1/runs/{ids[0]}/resume", body={})
        assert status == 200, body
        assert (await get_run(session, b.url, ids[0]))["status"] == "completed"
    finally:
        a.stop()
        b.stop()
