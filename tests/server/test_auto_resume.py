"""`approval: {on_decision: resume}` on a real gateway process: a decided run goes on by itself.

No test here calls POST /v1/runs/{id}/resume: the run continues after the approval (or
the rejection) alone, a follower of its events sees it, a streamed chat call that paused
on the approval answers when it is done, and the default policy still waits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.served import OPS, Served, auth, chat_body, events, get_run, request, served_fixture, wait_event

APPROVED_ANSWER = "Deleted access.log to free space."
REJECTED_ANSWER = "I did not delete anything: you declined the deletion."


served = served_fixture("auto_resume")


async def decide(session: aiohttp.ClientSession, url: str, run_id: str, decision: str, reason: str = "") -> None:
    status, _, body = await request(session, "POST", f"{url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": decision, "reason": reason})
    assert status == 200, body


async def sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """(kind, text) of each SSE line: `comment`, `event`, `data` or `id`."""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif ": " in line:
            field, _, value = line.partition(": ")
            yield field, value


async def streamed_chat(session: aiohttp.ClientSession, url: str, run_id: str, policy: str,
                        model: str) -> tuple[str, list[str]]:
    """A streamed chat call starting run `run_id` under `policy`: (its answer, its progress comments)."""
    body = chat_body(model, stream=True)
    content, comments = "", []
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers=auth(**{"X-Policy": policy, "X-Run-Id": run_id})) as resp:
        assert resp.status == 200, await resp.text()
        async for field, value in sse_lines(resp):
            if field == "comment":
                comments.append(value)
            elif field == "data" and value != "[DONE]":
                chunk = orjson.loads(value)
                content += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return content, comments


async def test_a_follower_sees_the_run_go_on_after_the_approval(served: Served,
                                                                 session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files_auto"})
    assert status == 200 and body["run"]["interruption"]["call_id"] == "c2", body
    run_id = headers["X-Run-Id"]
    seen: list[dict[str, Any]] = []
    ended: dict[str, Any] | None = None
    async with session.get(f"{served.url}/v1/runs/{run_id}/events?follow=1", headers=auth()) as resp:
        kind = "message"
        async for field, value in sse_lines(resp):
            if field == "event":
                kind = value
            elif field == "data":
                data = orjson.loads(value)
                if kind == "end":
                    ended = data
                    break
                seen.append(data)
                if data["type"] == "approval_required":  # the follower is still there: decide now
                    await decide(session, served.url, run_id, "approve", "old logs")
    assert ended is not None and ended["status"] == "completed", (ended, seen)
    kinds = [e["type"] for e in seen]
    assert kinds.index("approval_required") < kinds.index("approval_decided") < kinds.index("run_resumed")
    resumed = next(e for e in seen if e["type"] == "run_resumed")
    assert resumed["by"] == "gateway-on-decision"
    run = await get_run(session, served.url, run_id)
    assert run["transcript"][-1]["content"] == APPROVED_ANSWER
    assert served.deleted(run_id) == ["access.log"]
    trace = await events(session, served.url, run_id)
    assert Counter(e["callId"] for e in trace if e["type"] == "tool_start") == {"c1": 1, "c2": 1}


async def test_a_paused_streaming_call_answers_once_the_run_goes_on(served: Served,
                                                                    session: aiohttp.ClientSession) -> None:
    run_id = "auto-stream"
    comments: list[str] = []
    content = ""
    body = chat_body("scripted-destructive", stream=True)
    headers = auth(**{"X-Policy": "files_auto", "X-Run-Id": run_id})
    async with session.post(f"{served.url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
        assert resp.status == 200
        async for field, value in sse_lines(resp):
            if field == "comment":
                comments.append(value)
                if value.startswith("approval_required"):
                    await decide(session, served.url, run_id, "reject", "keep access.log for the audit")
            elif field == "data" and value != "[DONE]":
                chunk = orjson.loads(value)
                content += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert content == REJECTED_ANSWER, comments
    assert any(c.startswith("run_resumed") for c in comments)
    run = await get_run(session, served.url, run_id)
    assert run["status"] == "completed" and run["turns"] == 3
    reply = next(m for m in run["transcript"] if m.get("tool_call_id") == "c2")
    assert "keep access.log for the audit" in reply["content"] and "declined" in reply["content"]
    assert served.deleted(run_id) == []


async def test_the_default_policy_still_waits_for_a_resume(served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200
    run_id = headers["X-Run-Id"]
    await decide(session, served.url, run_id, "approve")
    # an auto-resumed run would have a run_resumed line by the time a second run of it did its
    # whole work: run one (with the on-decision policy) and compare
    _, auto_headers, _ = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                       body=chat_body("scripted-destructive"), headers={"X-Policy": "files_auto"})
    await decide(session, served.url, auto_headers["X-Run-Id"], "approve")
    await wait_event(session, served.url, auto_headers["X-Run-Id"], "run_stopped", count=2)
    run = await get_run(session, served.url, run_id)
    assert (run["status"], run["interruption"]["waiting_for"]) == ("interrupted", "resume"), run
    assert run["turns"] == 2 and served.deleted(run_id) == []
    assert "run_resumed" not in [e["type"] for e in await events(session, served.url, run_id)]


def test_on_decision_resume_needs_a_server_side_policy(tmp_path: Any) -> None:
    from gateway.policy.errors import PolicyError
    from gateway.policy.schema import load_policy as load_policy_file

    path = tmp_path / "p.yaml"
    path.write_text("name: p\ndescription: d\napproval: {on_decision: resume}\n")
    with pytest.raises(PolicyError, match="needs a server-side policy"):
        load_policy_file(path)
    path.write_text("name: p\ndescription: d\napproval: {on_decision: later}\n")
    with pytest.raises(PolicyError, match="on_decision"):
        load_policy_file(path)
