"""The runs API of a real gateway process: approvals, resume, cancel, list, read, trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.served import (
    DEMO,
    EXPIRES_AFTER_S,
    OPS,
    OTHER,
    PLAN_ANSWER,
    Served,
    auth,
    chat_body,
    events,
    get_run,
    request,
    wait_event,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("runs_api") / "gw")
    yield gateway
    gateway.proc.stop()


async def chat(session: aiohttp.ClientSession, served: Served, model: str, *, policy: str = "files",
               run_id: str | None = None, **extra: Any) -> tuple[int, dict[str, str], Any]:
    headers = {"X-Policy": policy, **({"X-Run-Id": run_id} if run_id else {})}
    return await request(session, "POST", f"{served.url}/v1/chat/completions", body=chat_body(model, **extra),
                         headers=headers)


async def destructive_run(session: aiohttp.ClientSession, served: Served, policy: str = "files") -> str:
    status, headers, body = await chat(session, served, "scripted-destructive", policy=policy)
    assert status == 200 and body["run"]["status"] == "interrupted", body
    return headers["X-Run-Id"]


def url(served: Served, run_id: str, tail: str = "") -> str:
    return f"{served.url}/v1/runs/{run_id}{tail}"


async def pending_gauge(session: aiohttp.ClientSession, served: Served) -> float:
    async with session.get(f"{served.url}/metrics") as resp:
        text = await resp.text()
    line = next((ln for ln in text.splitlines() if ln.startswith('gateway_approvals_pending{team="demo"}')), None)
    return float(line.split()[-1]) if line else 0.0


async def test_only_approver_keys_decide_and_only_the_waiting_call(served: Served,
                                                                  session: aiohttp.ClientSession) -> None:
    waiting_before = await pending_gauge(session, served)
    run_id = await destructive_run(session, served)
    assert await pending_gauge(session, served) == waiting_before + 1
    decision = {"call_id": "c2", "decision": "approve"}
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=DEMO, body=decision)
    assert status == 403 and body["error"]["type"] == "permission_error"
    assert "ops" in body["error"]["message"]  # names who may decide
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OTHER, body=decision)
    assert status == 404 and body["error"]["code"] == "run_not_found"
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c1", "decision": "approve"})
    assert status == 409 and body["error"]["type"] == "conflict_error"
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c2", "decision": "maybe"})
    assert status == 400 and body["error"]["param"] == "decision"
    assert (await get_run(session, served.url, run_id))["status"] == "interrupted"  # nothing was recorded

    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS, body=decision)
    assert status == 200, body
    assert body["decision"]["decision"] == "approve" and body["decision"]["by"] == "ops"
    assert await pending_gauge(session, served) == waiting_before
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS, body=decision)
    assert status == 409  # already decided: the run no longer waits

    status, headers, body = await request(session, "POST", url(served, run_id, "/resume"), key=DEMO, body={})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "Deleted access.log to free space."
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "3"
    assert served.deleted(run_id) == ["access.log"]
    assert not (served.sandbox(run_id) / "access.log").exists()
    decided = [e for e in await events(session, served.url, run_id) if e["type"] == "approval_decided"]
    assert decided == [{**decided[0], "callId": "c2", "toolName": "delete_file", "decision": "approve", "by": "ops",
                        "expired": False}]


@pytest.mark.parametrize("reason", ["access.log is still needed for the audit", ""])
async def test_rejection_is_written_in_words_and_nothing_is_claimed(served: Served, session: aiohttp.ClientSession,
                                                                   reason: str) -> None:
    run_id = await destructive_run(session, served)
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c2", "decision": "reject", "reason": reason})
    assert status == 200, body
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={})  # the owner resumes
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    assert answer == "I did not delete anything: you declined the deletion."
    assert "Deleted" not in answer
    assert served.deleted(run_id) == [] and (served.sandbox(run_id) / "access.log").exists()
    run = await get_run(session, served.url, run_id)
    written = next(m for m in run["transcript"] if m.get("tool_call_id") == "c2")
    assert "declined" in written["content"] and "not run" in written["content"]
    if reason:
        assert reason in written["content"]
    assert run["decisions"]["c2"]["decision"] == "reject"


async def test_an_expired_approval_becomes_a_rejection_saying_so(served: Served,
                                                                session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served, policy="files_expiring")
    asked = (await wait_event(session, served.url, run_id, "approval_required"))[0]["ts"]
    while time.time() < asked + EXPIRES_AFTER_S:  # the deadline itself is what this test waits for
        await asyncio.sleep(0.01)
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c2", "decision": "approve"})
    assert status == 200, body
    assert body["decision"]["decision"] == "reject" and body["decision"]["expired"] is True
    assert "expired" in body["decision"]["reason"]
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={})  # the owner resumes
    assert body["choices"][0]["message"]["content"] == "I did not delete anything: you declined the deletion."
    assert served.deleted(run_id) == []


async def test_cancel_stops_a_slow_tool_mid_work(served: Served, session: aiohttp.ClientSession) -> None:
    run_id = "slow-cancel"
    call = asyncio.ensure_future(chat(session, served, "scripted-slow", run_id=run_id))
    await wait_event(session, served.url, run_id, "tool_progress")
    status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), key=OTHER,
                                    body={"reason": "user pressed Stop"})
    assert status == 404  # another team cannot even see it
    status, headers, body = await request(session, "POST", url(served, run_id, "/cancel"),
                                          body={"reason": "user pressed Stop"})
    assert status == 200, body
    assert body["run"]["status"] == "interrupted"
    assert body["run"]["interruption"] == {"type": "cancelled", "reason": "user pressed Stop",
                                                 "waiting_for": "resume"}
    status, _, answered = await call
    assert status == 200
    assert answered["choices"][0]["message"]["content"] == "The run was interrupted: user pressed Stop."
    trace = await events(session, served.url, run_id)
    asked = next(e for e in trace if e["type"] == "cancel_requested")
    result = next(e for e in trace if e["type"] == "tool_result")
    stopped = next(e for e in trace if e["type"] == "run_stopped")
    # The Stop cut the 3 s scan: its line says cancelled (how many ms that takes is
    # benchmarks/stop_latency.py's figure, not this test's).
    assert result["toolName"] == "scan_archive" and result["ok"] is False and result["outcome"] == "cancelled"
    assert result["ms"] < 3000 and stopped["reason"] == "cancelled" and stopped["ts"] >= asked["ts"]
    status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), body={})
    assert status == 409 and body["error"]["code"] == "run_not_running"


async def test_cancel_of_a_run_waiting_for_client_tools(served: Served, session: aiohttp.ClientSession) -> None:
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    status, headers, body = await chat(session, served, "scripted-plan", policy="hybrid", tools=[tool])
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    run_id = headers["X-Run-Id"]
    status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), body={"reason": "not needed"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    assert [e["type"] for e in await events(session, served.url, run_id)][-2:] == ["cancel_requested", "run_stopped"]


async def test_list_and_read_show_runs_to_their_team_and_approvers(served: Served,
                                                                  session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served)

    async def listed(key: str, query: str) -> list[str]:
        status, _, body = await request(session, "GET", f"{served.url}/v1/runs{query}", key=key)
        assert status == 200, body
        return [r["id"] for r in body["data"]]

    assert run_id in await listed(DEMO, "?status=interrupted")
    assert run_id in await listed(OPS, "?status=interrupted")  # ops approves the files policy
    assert run_id in await listed(OPS, "?team=demo")
    assert run_id not in await listed(OTHER, "")
    assert run_id not in await listed(DEMO, "?status=completed")
    status, _, body = await request(session, "GET", f"{served.url}/v1/runs?status=sleeping")
    assert status == 400 and body["error"]["param"] == "status"

    run = await get_run(session, served.url, run_id, key=OPS)
    assert run["status"] == "interrupted" and run["turns"] == 2 and run["cost_usd"] > 0
    assert run["usage"]["prompt_tokens"] > 0
    assert run["interruption"]["tool_name"] == "delete_file"
    assert [m["role"] for m in run["transcript"]] == ["user", "assistant", "tool", "assistant"]
    status, _, body = await request(session, "GET", url(served, run_id), key=OTHER)
    assert status == 404 and set(body["error"]) == {"message", "type", "code", "param"}
    status, _, body = await request(session, "GET", url(served, "run_nope"))
    assert status == 404 and body["error"]["code"] == "run_not_found"


async def test_events_are_jsonl_with_run_ids_and_follow_streams_until_stop(
        served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, _ = await chat(session, served, "scripted-plan")
    plan_id = headers["X-Run-Id"]
    async with session.get(url(served, plan_id, "/events"), headers=auth()) as resp:
        lines = (await resp.text()).splitlines()
    assert len(lines) >= 8 and all(orjson.loads(line)["runId"] == plan_id for line in lines)

    run_id = "slow-follow"
    call = asyncio.ensure_future(chat(session, served, "scripted-slow", run_id=run_id))
    await wait_event(session, served.url, run_id, "run_started")
    seen: list[dict[str, Any]] = []
    ids: list[int] = []
    ended = None
    async with session.get(url(served, run_id, "/events?follow=1"), headers=auth()) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        kind = "message"
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line.startswith("data: "):
                data = orjson.loads(line[6:])
                if kind == "end":
                    ended = data
                    continue
                seen.append(data)
                progress = [e for e in seen if e["type"] == "tool_progress"]
                if len(progress) == 2 and not any(e["type"] == "cancel_requested" for e in seen):
                    # live: the scan is still running while we read its progress
                    status, _, _ = await request(session, "POST", url(served, run_id, "/cancel"),
                                                 body={"reason": "seen enough"})
                    assert status == 200
            elif not line:
                kind = "message"
    assert ended is not None and ended["status"] == "interrupted"
    assert seen[-1]["type"] == "run_stopped" and all(e["runId"] == run_id for e in seen)
    assert ids == sorted(ids) and len(ids) == len(seen)
    assert len([e for e in seen if e["type"] == "tool_progress"]) == 2
    await call


async def test_resume_raises_limits_and_can_stream(served: Served, session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served)
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={})
    assert status == 409 and "c2" in body["error"]["message"]  # still waits for a person
    await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                  body={"call_id": "c2", "decision": "approve"})
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={"max_turns": 2})
    assert status == 400 and body["error"]["param"] == "max_turns"
    async with session.post(url(served, run_id, "/resume"), headers=auth(),
                            data=orjson.dumps({"max_turns": 5, "stream": True})) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [raw.decode().rstrip("\n") async for raw in resp.content if raw.strip()]
    assert ": tool_start delete_file" in lines and lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Deleted access.log to free space."
    run = await get_run(session, served.url, run_id)
    assert run["status"] == "completed" and run["limits"]["max_turns"] == 5
    resumed = [e for e in await events(session, served.url, run_id) if e["type"] == "run_resumed"]
    assert resumed[-1]["maxTurns"] == 5 and resumed[-1]["by"] == "demo"


async def test_a_completed_run_cannot_be_resumed_but_a_chat_call_can_go_on(
        served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, body = await chat(session, served, "scripted-plan")
    run_id = headers["X-Run-Id"]
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={})
    assert status == 409 and body["error"]["code"] == "run_not_resumable"
    follow = [*chat_body("scripted-plan")["messages"], {"role": "assistant", "content": PLAN_ANSWER},
              {"role": "user", "content": "Thanks. Which one again?"}]
    status, headers, body = await chat(session, served, "scripted-plan", policy="files", run_id=run_id,
                                       messages=follow)
    assert status == 200 and headers["X-Run-Id"] == run_id
    assert headers["X-Run-Turns"] == "4"  # the same run went on, one more turn


async def test_a_cancelled_pass_through_run_is_reopened_by_resume(served: Served,
                                                                 session: aiohttp.ClientSession) -> None:
    status, headers, body = await chat(session, served, "scripted-plan", policy="passthrough")
    run_id = headers["X-Run-Id"]
    assert status == 200 and headers["X-Run-Status"] == "running"  # the client runs its own tools
    status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), body={"reason": "pause"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    status, _, body = await chat(session, served, "scripted-plan", policy="passthrough", run_id=run_id)
    assert status == 409 and body["error"]["code"] == "run_cancelled"
    status, headers, body = await request(session, "POST", url(served, run_id, "/resume"), body={"max_turns": 9})
    assert status == 200 and body["run"]["status"] == "running" and body["run"]["limits"]["max_turns"] == 9
    assert headers["X-Run-Status"] == "running"
    status, headers, body = await chat(session, served, "scripted-plan", policy="passthrough", run_id=run_id)
    assert status == 200 and headers["X-Run-Turns"] == "2"
