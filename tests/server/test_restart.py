"""Runs survive a SIGKILL of the gateway (approved on the new process, resumed, nothing run
twice), and replicas sharing one database drive each run one at a time."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from tests.server.served import OPS, TASK, Served, chat_body, events, get_run, request, served_fixture, wait_event


shared = served_fixture("restart")


@pytest.fixture
def served(shared: Served) -> Served:
    """The module's gateway (each test its own runs), running: most tests end it and start
    it again themselves; if one failed before that, it is started again here."""
    if shared.proc.popen.poll() is not None:
        shared.restart()
    return shared


async def test_approval_after_a_crash_then_resume_runs_nothing_twice(served: Served,
                                                                     session: aiohttp.ClientSession) -> None:
    client = served.openai(**{"X-Policy": "files"})
    raw = await client.chat.completions.with_raw_response.create(model="scripted-destructive", messages=TASK)  # type: ignore[arg-type]
    run_id = raw.headers["X-Run-Id"]
    before = await get_run(session, served.url, run_id)
    assert before["status"] == "interrupted" and before["interruption"]["call_id"] == "c2"

    served.proc.kill()  # SIGKILL: no shutdown code runs
    served.restart()

    restored = await get_run(session, served.url, run_id)
    assert (restored["turns"], restored["cost_usd"], len(restored["transcript"])) == (
        before["turns"], before["cost_usd"], len(before["transcript"]))
    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve", "reason": "old logs"})
    assert status == 200, body
    status, headers, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "Deleted access.log to free space."
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "3"
    assert served.deleted(run_id) == ["access.log"]
    assert sorted(p.name for p in served.sandbox(run_id).iterdir() if not p.name.startswith(".")) == [
        "errors.log", "notes.txt"]

    trace = await events(session, served.url, run_id)
    started = Counter(e["callId"] for e in trace if e["type"] == "tool_start")
    assert started == {"c1": 1, "c2": 1}  # across both processes, no tool ran twice
    assert [e["turn"] for e in trace if e["type"] == "turn"] == [1, 2, 3]  # no turn paid twice
    final = await get_run(session, served.url, run_id)
    assert final["cost_usd"] == pytest.approx(sum(
        (u["prompt_tokens"] * 2 + u["completion_tokens"] * 12) / 1e6 for u in final["per_turn"]))


async def test_a_run_killed_mid_tool_resumes_without_paying_its_turn_again(served: Served,
                                                                          session: aiohttp.ClientSession) -> None:
    run_id = "killed-mid-scan"
    call = asyncio.ensure_future(request(session, "POST", f"{served.url}/v1/chat/completions",
                                         body=chat_body("scripted-slow"),
                                         headers={"X-Policy": "files", "X-Run-Id": run_id}))
    await wait_event(session, served.url, run_id, "tool_progress")
    served.proc.kill()
    with pytest.raises(aiohttp.ClientError):
        await call
    served.restart()  # same port: the same lease owner, so the run is not locked out

    restored = await get_run(session, served.url, run_id)
    assert restored["turns"] == 1
    # Still `running`; or, when the restart took longer than the lease TTL (a loaded machine),
    # already stopped by the recovery sweep as `crashed`: resumable either way.
    assert restored["status"] == "running" or (restored["status"], restored["reason"]) == ("interrupted", "crashed"), \
        restored
    status, headers, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200, body
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "2"
    trace = await events(session, served.url, run_id)
    assert [e["turn"] for e in trace if e["type"] == "turn"] == [1, 2]
    results = [e for e in trace if e["type"] == "tool_result"]
    assert [(e["callId"], e["ok"]) for e in results] == [("c1", True)]  # the scan finished once, after resume


async def test_a_replica_cannot_drive_a_run_another_drives_but_can_stop_it(served: Served,
                                                                           session: aiohttp.ClientSession) -> None:
    replica = served.replica()
    try:
        run_id = "two-replicas"
        call = asyncio.ensure_future(request(session, "POST", f"{served.url}/v1/chat/completions",
                                             body=chat_body("scripted-slow"),
                                             headers={"X-Policy": "files", "X-Run-Id": run_id}))
        await wait_event(session, served.url, run_id, "tool_progress")
        status, _, body = await request(session, "POST", f"{replica.url}/v1/runs/{run_id}/resume", body={})
        assert status == 409 and body["error"]["code"] == "run_busy", body
        status, _, body = await request(session, "POST", f"{replica.url}/v1/runs/{run_id}/cancel",
                                        body={"reason": "stopped from the other replica"})
        # the driving replica stops it within one poll of the trace: the answer waits for that
        assert status == 200 and body["cancel"] == "done", body
        assert body["run"]["interruption"] == {"type": "cancelled", "reason": "stopped from the other replica",
                                                 "waiting_for": "resume"}
        status, _, answered = await call  # the driving replica read the request from the shared trace
        assert answered["run"]["interruption"] == {"type": "cancelled", "reason": "stopped from the other replica",
                                                 "waiting_for": "resume"}
        trace = await events(session, replica.url, run_id)
        asked = next(e for e in trace if e["type"] == "cancel_requested")
        stopped = next(e for e in trace if e["type"] == "run_stopped")
        result = next(e for e in trace if e["type"] == "tool_result")
        # the driving replica cut the scan mid-work, not after its 3 s
        assert result["outcome"] == "cancelled" and result["ms"] < 3000 and stopped["ts"] >= asked["ts"]
        status, _, body = await request(session, "POST", f"{replica.url}/v1/runs/{run_id}/resume", body={})
        assert status == 200 and body["run"]["status"] == "completed", body  # free again: any replica drives it
    finally:
        replica.stop()


async def test_a_graceful_stop_saves_running_runs_as_interrupted(served: Served,
                                                                 session: aiohttp.ClientSession) -> None:
    run_id = "stopped-by-sigterm"
    call = asyncio.ensure_future(request(session, "POST", f"{served.url}/v1/chat/completions",
                                         body=chat_body("scripted-slow"),
                                         headers={"X-Policy": "files", "X-Run-Id": run_id}))
    await wait_event(session, served.url, run_id, "tool_progress")
    served.proc.popen.terminate()  # SIGTERM: the gateway stops its runs before it exits
    status, headers, body = await call
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "The run was interrupted: the gateway is shutting down."
    assert served.proc.popen.wait(timeout=10) == 0
    served.restart()
    run = await get_run(session, served.url, run_id)
    assert run["status"] == "interrupted" and run["interruption"]["reason"] == "the gateway is shutting down"
    assert run["turns"] == 1
