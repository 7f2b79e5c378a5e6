"""Limits that ask a person (`limits: {on_exceed: ask}`) against a real gateway process.

A server-side run that reaches a limit pauses as a request for more (`interrupted`,
reason `limit`), shows in the runs API, the console's inbox, `gateway approvals` and the
`approval_required` webhook (`kind: "limit"`); an approver's grant raises exactly its
limits and the run goes on (by itself under `on_decision: resume`, a streamed call kept
open); a rejection, `max_grants`, `max_total` and the expiry end it as the limit does. A
pass-through run's call at the limit is refused 429 `limit_approval_pending`, and 16
concurrent calls pass neither the old limit nor the granted one. The gateway uses the
scripted upstream, a SQLite file, and a webhook receiver in a thread of this process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.harness.usage import Price, Usage
from gateway.store.periods import period_key
from gateway.store.sqlite import SqliteStore
from gateway.tokens import get_counter
from tests.server.served import (
    ASK_GRANT_TURNS,
    DEMO,
    OPS,
    PLAN_ANSWER,
    TASK,
    Served,
    chat_body,
    events,
    get_run,
    poll,
    request,
    write_config,
)
from tests.server.test_auto_resume import streamed_chat
from tests.support.procs import free_port, run_gateway, start_gateway

ALLOWANCE = 100
"""defaults.output_allowance_tokens: what a budget that asks holds for a call's reply."""
PRICE = Price(2.0, 12.0)
BUDGET = 0.0028
"""ask_budget's max_budget_usd: scripted-plan's first two turns fit whole (prompt + 100
output tokens each), the third does not (its hold would pass the budget)."""
LEASE_TTL_S = 2.0  # the recovery sweep (expiry) runs every second
EXPIRES_S = 0.3
ASKER = "sk-asker"
"""Team `asker`: its only run is the budget test's, so its ledger is that run's cost."""


class Hooks:
    """A webhook receiver on a thread of this process: keeps every body it is sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hooks.bodies.append(orjson.loads(raw))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of(self, run_id: str, event: str) -> list[dict[str, Any]]:
        return [b for b in list(self.bodies) if b.get("run_id") == run_id and b.get("event") == event]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def files_policy(folder: Path, name: str, limits: dict[str, Any], ask: dict[str, Any], **approval: Any) -> None:
    data = yaml.safe_load((folder / "policies" / "files.yaml").read_text())
    data["name"] = name
    data["limits"].update(limits, on_exceed="ask", ask=ask)
    data["approval"].update(approval)
    (folder / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(data))


def passthrough_policy(folder: Path, name: str, limits: dict[str, Any], ask: dict[str, Any]) -> None:
    data = {"name": name, "limits": {**limits, "on_exceed": "ask", "ask": ask}, "approval": {"approvers": [OPS_TEAM]}}
    (folder / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(data))


OPS_TEAM = "ops"
RESUME = {"on_decision": "resume"}
PT_BUDGET = 0.004
"""pt_budget's max_budget_usd: a handful of pass-through calls' holds."""


@pytest.fixture(scope="module")
def hooks() -> Iterator[Hooks]:
    receiver = Hooks()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hooks: Hooks) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("limit_requests") / "gw"
    folder.mkdir()
    port = free_port()
    path = write_config(folder, port)
    grant3 = {"grant": {"max_turns": ASK_GRANT_TURNS}}
    files_policy(folder, "ask_wait", {"max_turns": 2}, grant3)
    files_policy(folder, "ask_budget", {"max_turns": 20, "max_budget_usd": BUDGET},
                 {"grant": {"max_budget_usd": 0.01}}, **RESUME)
    files_policy(folder, "ask_once", {"max_turns": 1}, {"grant": {"max_turns": 1}, "max_grants": 1}, **RESUME)
    files_policy(folder, "ask_total", {"max_turns": 1}, {"grant": {"max_turns": 1}, "max_total": {"max_turns": 2}},
                 **RESUME)
    files_policy(folder, "ask_self", {"max_turns": 2}, {"approvers": ["demo"], **grant3}, **RESUME)
    files_policy(folder, "ask_expiring", {"max_turns": 2}, grant3, expires_after_s=EXPIRES_S)
    files_policy(folder, "ask_tools", {"max_tool_calls": 1}, {"grant": {"max_tool_calls": 2}}, **RESUME)
    files_policy(folder, "ask_time", {"max_duration_s": 1}, {"grant": {"max_duration_s": 30}}, **RESUME)
    passthrough_policy(folder, "pt_ask", {"max_turns": 2}, grant3)
    passthrough_policy(folder, "pt_budget", {"max_budget_usd": PT_BUDGET}, {"grant": {"max_budget_usd": PT_BUDGET}})
    config = yaml.safe_load(path.read_text())
    config["server"].update(lease_ttl_s=LEASE_TTL_S, webhook_poll_s=0.05)
    config["defaults"] = {"output_allowance_tokens": ALLOWANCE}
    mine = ["ask_tools", "ask_time", "ask_wait", "ask_budget", "ask_once", "ask_total", "ask_self", "ask_expiring", "pt_ask", "pt_budget"]
    config["teams"][0]["policies"] += mine
    config["teams"].append({"name": "asker", "keys": [ASKER], "budget_usd": None, "budget_period": "total",
                            "policies": ["ask_budget"]})
    config["webhooks"] = [{"url": hooks.url, "secret_env": "GW_TEST_HOOK_SECRET", "name": "hook",
                           "events": ["approval_required", "approval_decided", "run_stopped"]}]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway-1.log",
                         env={"GW_TEST_HOOK_SECRET": "whsec-limits"})
    yield Served(folder, port, proc)
    proc.stop()


def cli(served: Served, *args: str, key: str = OPS) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GATEWAY_URL": served.url, "GATEWAY_KEY": key}
    return run_gateway(["approvals", *args], env=env)


async def start(session: aiohttp.ClientSession, served: Served, policy: str, run_id: str, *, key: str = DEMO,
                model: str = "scripted-plan") -> dict[str, Any]:
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions", key=key,
                                    body=chat_body(model), headers={"X-Policy": policy, "X-Run-Id": run_id})
    assert status == 200, body
    run: dict[str, Any] = body["run"]
    return run


async def decide(session: aiohttp.ClientSession, served: Served, run_id: str, body: dict[str, Any],
                 key: str = OPS, team: str = "demo") -> tuple[int, Any]:
    status, _, answer = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/approvals?team={team}",
                                      key=key, body=body)
    return status, answer


async def settled(session: aiohttp.ClientSession, url: str, run_id: str, key: str = DEMO,
                  timeout: float = 30) -> dict[str, Any]:
    """The run once it stopped for good (not running, not about to go on after a grant)."""
    async def check() -> dict[str, Any] | None:
        run = await get_run(session, url, run_id, key)
        going = run["status"] == "running" or (run["status"] == "interrupted" and run["interruption"]["type"] == "limit"
                                               and run["interruption"]["call_id"] in run["decisions"])
        return None if going else run

    found: dict[str, Any] = await poll(check, timeout=timeout)
    return found


async def streamed(session: aiohttp.ClientSession, url: str, policy: str, run_id: str) -> tuple[str, list[str]]:
    """A streamed chat call starting a scripted-plan run: (its answer, its progress comments)."""
    return await streamed_chat(session, url, run_id, policy, "scripted-plan")


async def limit_counts(session: aiohttp.ClientSession, served: Served, policy: str) -> dict[str, float]:
    async with session.get(f"{served.url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_limit_requests_total{") and f'policy="{policy}"' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def pending_gauge(session: aiohttp.ClientSession, served: Served) -> int:
    """Team demo's `gateway_approvals_pending` once it shows what the store holds: the demo
    runs waiting for a decision. A scrape may reach a worker whose count is up to a second
    old (pending_approvals.CACHE_S; the other worker made the change), so it is polled."""
    async def agreed() -> int | None:
        status, _, listing = await request(session, "GET", f"{served.url}/v1/runs?status=interrupted&limit=1000")
        assert status == 200, listing
        truth = sum(1 for r in listing["data"] if (r.get("interruption") or {}).get("waiting_for") == "decision")
        async with session.get(f"{served.url}/metrics") as resp:
            text = await resp.text()
        shown = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith('gateway_approvals_pending{team="demo"}'))
        return truth + 1 if shown == truth else None  # + 1: 0 is an answer too

    found: int = await poll(agreed, timeout=10)
    return found - 1


async def inbox(url: str, key: str = OPS) -> list[dict[str, Any]]:
    """The console inbox of `key`'s team at gateway `url` (signed in as the page does)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        async with client.post(f"{url}/console/session", json={"key": key}) as resp:
            assert resp.status == 200, await resp.text()
        async with client.get(f"{url}/console/api/inbox") as resp:
            assert resp.status == 200, await resp.text()
            items: list[dict[str, Any]] = (await resp.json())["data"]
    return items


async def test_a_streamed_run_pauses_at_its_cap_is_granted_from_the_cli_and_completes_by_itself(
        served: Served, session: aiohttp.ClientSession, hooks: Hooks) -> None:
    paused = asyncio.ensure_future(streamed(session, served.url, "files_ask", "grant-me"))

    async def asked() -> dict[str, Any] | None:
        run = (await request(session, "GET", f"{served.url}/v1/runs/grant-me"))[2]
        return run if isinstance(run, dict) and run.get("reason") == "limit" else None

    run = await poll(asked, timeout=30)
    waiting = run["interruption"]
    assert run["status"] == "interrupted" and run["turns"] == 2
    assert {k: waiting[k] for k in ("type", "limit", "used", "cap", "grant")} == {
        "type": "limit", "limit": "max_turns", "used": 2, "cap": 2, "grant": {"max_turns": ASK_GRANT_TURNS}}
    request_id = waiting["call_id"]

    [item] = [i for i in await inbox(served.url) if i["run_id"] == "grant-me"]
    assert (item["kind"], item["limit"], item["used"], item["cap"], item["grant"]) == (
        "limit", "max_turns", 2, 2, {"max_turns": ASK_GRANT_TURNS})
    assert item["call_id"] == request_id and item["cost_usd"] == run["cost_usd"] > 0 and item["turns"] == 2
    assert item["assistant"] == 'read_file({"path":"errors.log"})'  # what it was doing: the call it made last
    assert item["last_user"] == TASK[0]["content"] and item["run_resumes_on_decision"] is True
    assert "asks ops" in item["rule"]
    assert not [i for i in await inbox(served.url, DEMO) if i["run_id"] == "grant-me"]  # the owner decides nothing

    listed = cli(served, "list")
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in listed.stdout.splitlines() if r.startswith("demo/grant-me "))
    assert row.split()[1:5] == ["files_ask", request_id, "limit", "max_turns"] and "used 2 of 2; grant max_turns+3" in row
    assert f"limit request {request_id}: its max_turns (2 of 2 used)" in cli(served, "show", "demo/grant-me").stdout

    status, body = await decide(session, served, "grant-me", {"call_id": request_id, "decision": "approve"}, key=DEMO)
    assert status == 403 and body["error"]["code"] == "not_an_approver", body
    assert "limit approvers: ops" in body["error"]["message"]

    done = cli(served, "approve", "demo/grant-me", request_id, "--grant", "max_turns=3", "--reason", "nearly done")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("granted more to run demo/grant-me: max_turns 2 -> 5")

    content, comments = await asyncio.wait_for(paused, timeout=30)
    assert content == PLAN_ANSWER, comments  # the paused streamed call went on and answered
    assert any(c.startswith("waiting") or c.startswith("run_resumed") for c in comments), comments
    run = await get_run(session, served.url, "grant-me")
    assert run["status"] == "completed" and run["turns"] <= 5 and run["limits"]["max_turns"] == 5
    [grant] = run["grants"]
    assert (grant["by"], grant["before"], grant["after"], grant["reason"]) == (
        "ops", {"max_turns": 2}, {"max_turns": 5}, "nearly done")
    trace = await events(session, served.url, "grant-me")
    kinds = [e["type"] for e in trace]
    assert kinds.index("limit_reached") < kinds.index("limit_granted") < kinds.index("run_resumed")
    granted = next(e for e in trace if e["type"] == "limit_granted")
    assert (granted["by"], granted["before"], granted["after"]) == ("ops", {"max_turns": 2}, {"max_turns": 5})
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["gateway-on-decision"]  # once

    async def notified() -> list[dict[str, Any]] | None:
        found = hooks.of("grant-me", "approval_required") + hooks.of("grant-me", "approval_decided")
        return found if len(found) == 2 else None

    required, decided = await poll(notified)
    assert required["kind"] == decided["kind"] == "limit"
    assert required["detail"]["limit"] == "max_turns" and required["detail"]["callId"] == request_id
    assert decided["detail"]["after"] == {"max_turns": 5}
    counts = await limit_counts(session, served, "files_ask")
    assert counts.get("asked", 0) >= 1 and counts.get("granted", 0) >= 1


async def test_on_decision_wait_a_granted_run_waits_for_its_owners_resume(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_wait", "wait-grant")
    request_id = run["interruption"]["call_id"]
    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/wait-grant/resume", key=DEMO,
                                    body={"max_turns": 9})
    assert status == 409 and body["error"]["code"] == "run_not_resumable", body  # not past a person asked
    status, body = await decide(session, served, "wait-grant", {"call_id": request_id, "decision": "approve",
                                                                  "grant": {"max_turns": 1}})
    assert status == 200, body
    assert body["decision"] == {**body["decision"], "kind": "limit", "grant": {"max_turns": 1},
                                "before": {"max_turns": 2}, "after": {"max_turns": 3}}
    stored = await get_run(session, served.url, "wait-grant")
    assert stored["status"] == "interrupted" and stored["limits"]["max_turns"] == 3  # raised, not driven
    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/wait-grant/resume", key=DEMO, body={})
    assert status == 200 and body["run"]["status"] == "completed" and body["run"]["turns"] == 3, body


async def test_a_granted_run_is_decided_like_an_approved_call_and_its_next_chat_call_is_its_resume(
        served: Served, session: aiohttp.ClientSession) -> None:
    """runs28's rule for a call's decision holds for a grant: the run stays `interrupted`,
    its interruption says `decision` and `waiting_for: resume`, it no longer counts as
    pending, and the client's next chat call with its X-Run-Id resumes it."""
    run = await start(session, served, "ask_wait", "grant-then-chat")
    assert run["interruption"]["waiting_for"] == "decision" and "decision" not in run["interruption"], run
    waiting = await pending_gauge(session, served)
    status, body = await decide(session, served, "grant-then-chat",
                                {"call_id": run["interruption"]["call_id"], "decision": "approve"})
    assert status == 200 and body["run_resumes_on_decision"] is False, body  # on_decision: wait
    decided = body["run"]
    assert (decided["status"], decided["reason"]) == ("interrupted", "limit"), decided
    assert (decided["interruption"]["decision"], decided["interruption"]["waiting_for"]) == ("approve", "resume")
    assert await pending_gauge(session, served) == waiting - 1
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions", key=DEMO,
                                    body=chat_body("scripted-plan"),
                                    headers={"X-Policy": "ask_wait", "X-Run-Id": "grant-then-chat"})
    assert status == 200 and body["run"]["status"] == "completed", body
    assert body["choices"][0]["message"]["content"] == PLAN_ANSWER
    trace = await events(session, served.url, "grant-then-chat")
    assert [e["by"] for e in trace if e["type"] == "run_resumed"] == ["client"]


async def test_a_budget_that_asks_pauses_before_the_call_that_would_pass_it(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_budget", "budget-ask", key=ASKER)
    assert run["status"] == "interrupted" and run["turns"] == 2, run
    waiting = run["interruption"]
    assert (waiting["limit"], waiting["cap"], waiting["grant"]) == ("max_budget_usd", BUDGET, {"max_budget_usd": 0.01})
    assert run["cost_usd"] <= BUDGET and waiting["used"] == run["cost_usd"]
    assert "the next call may cost up to" in waiting["reason"]
    full = await get_run(session, served.url, "budget-ask", ASKER)
    third = get_counter().count_request(full["transcript"])  # the prompt of the call it did not make
    assert run["cost_usd"] + PRICE.cost(Usage(third, ALLOWANCE)) > BUDGET  # it would have passed the budget

    status, body = await decide(session, served, "budget-ask", {"call_id": waiting["call_id"], "decision": "approve"},
                                team="asker")
    assert status == 200, body
    run = await settled(session, served.url, "budget-ask", ASKER)
    assert run["status"] == "completed" and run["limits"]["max_budget_usd"] == pytest.approx(BUDGET + 0.01)
    store = SqliteStore(str(served.folder / "gateway.db"))
    try:
        spent, reserved = await store.team_spend("asker", period_key("total", None))
    finally:
        await store.close()
    assert reserved == 0 and spent == pytest.approx(run["cost_usd"], abs=1e-6)  # the ledger is the run's cost


async def test_the_tool_call_cap_asks_before_the_tool_that_would_pass_it(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_tools", "tools-ask")  # scripted-plan: list_files, then read_file
    assert run["status"] == "interrupted", run
    waiting = run["interruption"]
    assert (waiting["limit"], waiting["cap"], waiting["grant"]) == ("max_tool_calls", 1, {"max_tool_calls": 2})
    trace = await events(session, served.url, "tools-ask")
    assert [e["toolName"] for e in trace if e["type"] == "tool_start"] == ["list_files"]  # read_file waits
    status, body = await decide(session, served, "tools-ask", {"call_id": waiting["call_id"], "decision": "approve"})
    assert status == 200, body
    run = await settled(session, served.url, "tools-ask")
    assert (run["status"], run["limits"]["max_tool_calls"]) == ("completed", 3), run
    trace = await events(session, served.url, "tools-ask")
    assert [e["toolName"] for e in trace if e["type"] == "tool_start"] == ["list_files", "read_file"]
    assert [e["toolCalls"] for e in trace if e["type"] == "run_stopped"][-1] == 2


async def test_the_wall_clock_cap_asks_when_it_runs_out_and_a_grant_lets_the_run_finish(
        served: Served, session: aiohttp.ClientSession) -> None:
    # scripted-slow's scan_archive takes 3 s: the 1 s cap runs out during it.
    run = await start(session, served, "ask_time", "time-ask", model="scripted-slow")
    assert run["status"] == "interrupted", run
    waiting = run["interruption"]
    assert (waiting["limit"], waiting["cap"], waiting["grant"]) == ("max_duration_s", 1, {"max_duration_s": 30})
    status, body = await decide(session, served, "time-ask", {"call_id": waiting["call_id"], "decision": "approve"})
    assert status == 200, body
    run = await settled(session, served.url, "time-ask")
    assert (run["status"], run["limits"]["max_duration_s"]) == ("completed", 31), run
    trace = await events(session, served.url, "time-ask")
    assert [e["limit"] for e in trace if e["type"] == "limit_granted"] == ["max_duration_s"], trace


async def test_a_rejection_ends_the_run_at_its_limit_with_the_reason_in_its_answer(
        served: Served, session: aiohttp.ClientSession, hooks: Hooks) -> None:
    paused = asyncio.ensure_future(streamed(session, served.url, "files_ask", "say-no"))
    await poll(lambda: _interrupted(session, served, "say-no"), timeout=30)
    run = await get_run(session, served.url, "say-no")
    rejected = cli(served, "reject", "demo/say-no", run["interruption"]["call_id"], "--reason", "not worth more")
    assert rejected.returncode == 0, rejected.stderr
    assert rejected.stdout.startswith("rejected more max_turns for run demo/say-no")
    content, _ = await asyncio.wait_for(paused, timeout=30)
    assert content.startswith("The run stopped: it reached its cap of 2 turns.")
    assert "declined to raise its max_turns (2): not worth more" in content
    run = await get_run(session, served.url, "say-no")
    assert (run["status"], run["reason"], run["turns"], run["grants"]) == ("max_turns_exceeded", "max_turns", 2, [])
    trace = await events(session, served.url, "say-no")
    assert [e["type"] for e in trace][-2:] == ["limit_rejected", "run_stopped"]
    assert await poll(lambda: _hook(hooks, "say-no", "approval_decided"))
    assert (await limit_counts(session, served, "files_ask")).get("rejected", 0) >= 1


async def _interrupted(session: aiohttp.ClientSession, served: Served, run_id: str) -> bool:
    status, _, run = await request(session, "GET", f"{served.url}/v1/runs/{run_id}")
    return status == 200 and run["reason"] == "limit"


async def _hook(hooks: Hooks, run_id: str, event: str) -> bool:
    found = hooks.of(run_id, event)
    return bool(found) and all(b["kind"] == "limit" for b in found)


async def test_after_max_grants_the_limit_stops_the_run_without_asking(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_once", "once")
    assert run["reason"] == "limit" and run["turns"] == 1
    status, body = await decide(session, served, "once", {"call_id": run["interruption"]["call_id"],
                                                          "decision": "approve"})
    assert status == 200, body
    run = await settled(session, served.url, "once")
    assert (run["status"], run["turns"], len(run["grants"])) == ("max_turns_exceeded", 2, 1)
    last = [e for e in await events(session, served.url, "once") if e["type"] == "limit_reached"]
    assert [e["asked"] for e in last] == [True, False]
    assert "limits.ask.max_grants" in last[-1]["detail"]
    assert (await limit_counts(session, served, "ask_once")).get("exhausted") == 1


async def test_max_total_bounds_every_grant_and_then_stops_the_run(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_total", "total")
    request_id = run["interruption"]["call_id"]
    status, body = await decide(session, served, "total", {"call_id": request_id, "decision": "approve",
                                                           "grant": {"max_turns": 5}})
    assert status == 400 and body["error"]["param"] == "grant.max_turns", body
    assert "past limits.ask.max_total.max_turns (2): grant at most 1" in body["error"]["message"]
    status, body = await decide(session, served, "total", {"call_id": request_id, "decision": "approve",
                                                           "grant": {"max_budget_usd": 0.1}})
    assert status == 400 and body["error"]["param"] == "grant.max_turns", body  # it must raise the cap it reached
    assert (await get_run(session, served.url, "total"))["limits"]["max_turns"] == 1  # nothing changed
    status, body = await decide(session, served, "total", {"call_id": request_id, "decision": "approve"})
    assert status == 200, body
    run = await settled(session, served.url, "total")
    assert (run["status"], run["turns"], run["limits"]["max_turns"]) == ("max_turns_exceeded", 2, 2)
    assert "limits.ask.max_total" in [e for e in await events(session, served.url, "total")
                                      if e["type"] == "run_stopped"][-1]["detail"]


async def test_the_owner_grants_its_own_run_only_when_the_policy_names_it(
        served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_self", "self")
    status, body = await decide(session, served, "self", {"call_id": run["interruption"]["call_id"],
                                                          "decision": "approve"}, key=OPS)
    assert status == 403 and body["error"]["code"] == "not_an_approver", body  # ops approves calls, not these
    status, body = await decide(session, served, "self", {"call_id": run["interruption"]["call_id"],
                                                          "decision": "approve"}, key=DEMO)
    assert status == 200 and body["decision"]["by"] == "demo", body
    assert (await settled(session, served.url, "self"))["status"] == "completed"


async def test_an_expired_limit_request_ends_the_run_as_the_limit_does(
        served: Served, session: aiohttp.ClientSession) -> None:
    late = await start(session, served, "ask_expiring", "late")
    await asyncio.sleep(EXPIRES_S)  # the request's age is what is tested: it must be past its expiry
    status, body = await decide(session, served, "late", {"call_id": late["interruption"]["call_id"],
                                                          "decision": "approve"})
    if status == 409:  # the sweep expired it first
        assert body["error"]["code"] == "not_waiting_for_call", body
    else:
        assert status == 200 and body["decision"]["expired"] is True and body["decision"]["by"] == "approval-expiry"
    assert (await get_run(session, served.url, "late"))["status"] == "max_turns_exceeded"

    await start(session, served, "ask_expiring", "nobody")  # nobody decides: the sweep does

    async def swept() -> dict[str, Any] | None:
        run = await get_run(session, served.url, "nobody")
        return run if run["status"] == "max_turns_exceeded" else None

    run = await poll(swept, timeout=10 * LEASE_TTL_S)
    assert "Nobody decided on this limit request within" in run["interruption"]["reason"]
    rejected = [e for e in await events(session, served.url, "nobody") if e["type"] == "limit_rejected"]
    assert [(e["by"], e["expired"]) for e in rejected] == [("approval-expiry", True)]


async def passthrough_call(session: aiohttp.ClientSession, served: Served, policy: str, run_id: str,
                           **extra: Any) -> tuple[int, dict[str, str], Any]:
    return await request(session, "POST", f"{served.url}/v1/chat/completions", body=chat_body("scripted-plan",
                         **extra), headers={"X-Policy": policy, "X-Run-Id": run_id, "X-Scripted-Latency-Ms": "20"})


async def test_a_passthrough_run_is_refused_until_a_grant_and_16_concurrent_calls_pass_no_limit(
        served: Served, session: aiohttp.ClientSession) -> None:
    async def burst() -> list[tuple[int, dict[str, str], Any]]:
        return list(await asyncio.gather(*(passthrough_call(session, served, "pt_ask", "pt-burst")
                                           for _ in range(16))))

    first = await burst()
    assert sorted(s for s, _, _ in first) == [200] * 2 + [429] * 14
    refused = [b for s, _, b in first if s == 429]
    assert {b["error"]["code"] for b in refused} == {"limit_approval_pending"}
    refusal = refused[0]
    assert "a key of team ops decides limit request" in refusal["error"]["message"]
    assert "/console/#/inbox" in refusal["error"]["message"]
    assert all(h["x-should-retry"] == "false" for s, h, _ in first if s == 429)
    run = await get_run(session, served.url, "pt-burst")
    assert (run["turns"], run["status"], run["reason"]) == (2, "interrupted", "limit")
    requests = [e for e in await events(session, served.url, "pt-burst") if e["type"] == "limit_reached"]
    assert len(requests) == 1  # one request, however many calls were refused at once
    status, _, body = await passthrough_call(session, served, "pt_ask", "pt-burst")
    assert status == 429 and body["error"]["code"] == "limit_approval_pending" and body["run"]["turns"] == 2

    waiting = await pending_gauge(session, served)
    assert waiting >= 1  # the request counts among the team's approvals pending
    status, body = await decide(session, served, "pt-burst", {"call_id": run["interruption"]["call_id"],
                                                              "decision": "approve"})
    # as after a call's decision: still interrupted, decided; the client's next call is its resume
    assert status == 200 and body["run"]["status"] == "interrupted", body
    assert (body["run"]["interruption"]["decision"], body["run"]["interruption"]["waiting_for"]) == (
        "approve", "resume"), body
    assert body["run_resumes_on_decision"] is False  # a pass-through run: its client drives it
    assert await pending_gauge(session, served) == waiting - 1
    second = await burst()
    assert sorted(s for s, _, _ in second) == [200] * ASK_GRANT_TURNS + [429] * (16 - ASK_GRANT_TURNS)
    run = await get_run(session, served.url, "pt-burst")
    assert run["turns"] == 2 + ASK_GRANT_TURNS == run["limits"]["max_turns"]  # the new cap, not one more
    assert run["reason"] == "limit"  # a second request, for the next grant

    status, body = await decide(session, served, "pt-burst", {"call_id": run["interruption"]["call_id"],
                                                              "decision": "reject", "reason": "done for today"})
    assert status == 200 and body["run"]["status"] == "max_turns_exceeded", body
    status, _, body = await passthrough_call(session, served, "pt_ask", "pt-burst")
    assert status == 429 and body["error"]["code"] == "max_turns_exceeded", body  # the usual refusal now
    assert (await get_run(session, served.url, "pt-burst"))["turns"] == 5


async def test_a_passthrough_budget_that_asks_holds_under_concurrent_calls(
        served: Served, session: aiohttp.ClientSession) -> None:
    results = await asyncio.gather(*(passthrough_call(session, served, "pt_budget", "pt-money") for _ in range(16)))
    assert {b["error"]["code"] for s, _, b in results if s == 429} == {"limit_approval_pending"}
    run = await get_run(session, served.url, "pt-money")
    ok = sum(1 for s, _, _ in results if s == 200)
    assert ok >= 1 and run["turns"] == ok and run["cost_usd"] <= PT_BUDGET  # no dollar past the budget
    assert run["interruption"]["limit"] == "max_budget_usd"
    status, body = await decide(session, served, "pt-money", {"call_id": run["interruption"]["call_id"],
                                                              "decision": "approve"})
    assert status == 200, body
    more = await asyncio.gather(*(passthrough_call(session, served, "pt_budget", "pt-money") for _ in range(16)))
    run = await get_run(session, served.url, "pt-money")
    assert sum(1 for s, _, _ in more if s == 200) >= 1
    assert run["cost_usd"] <= 2 * PT_BUDGET and run["limits"]["max_budget_usd"] == pytest.approx(2 * PT_BUDGET)


async def test_bad_grants_are_refused_by_name(served: Served, session: aiohttp.ClientSession) -> None:
    run = await start(session, served, "ask_wait", "bad-grants")
    call_id = run["interruption"]["call_id"]
    for grant, param in [({"max_turns": 0}, "grant.max_turns"), ({"max_turns": 1.5}, "grant.max_turns"),
                         ({"max_tokens": 3}, "grant.max_tokens"), ([], "grant"), ({}, "grant"),
                         ({"max_budget_usd": -1}, "grant.max_budget_usd")]:
        status, body = await decide(session, served, "bad-grants", {"call_id": call_id, "decision": "approve",
                                                                    "grant": grant})
        assert status == 400 and body["error"]["param"] == param, (grant, body)
    status, body = await decide(session, served, "bad-grants", {"call_id": call_id, "decision": "reject",
                                                                "grant": {"max_turns": 1}})
    assert status == 400 and body["error"]["param"] == "grant", body
    status, body = await decide(session, served, "bad-grants", {"call_id": "lim_other", "decision": "approve"})
    assert status == 409 and body["error"]["code"] == "not_waiting_for_call", body
    assert (await get_run(session, served.url, "bad-grants"))["limits"]["max_turns"] == 2  # nothing changed
