"""Who may do what with a run, against a real gateway process: the README's table, row by row.

The run belongs to team demo under the `files` policy, whose approvers are `ops`; `root`
is an admin team (added to served.py's config here); `other` is a team with no claim on
the run. Every cell starts from a fresh run that waits for a decision on call c2.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from tests.server.served import DEMO, OPS, OTHER, Served, chat_body, events, get_run, request, write_config
from tests.support.procs import free_port, start_gateway

ADMIN = "sk-root"
ROLES = {"owner": DEMO, "approver": OPS, "admin": ADMIN, "other": OTHER}

# The table of README.md's "Who may do what", as statuses (a 403 is permission_error
# not_run_owner / not_an_approver; a 404 is the same run_not_found as for no such run).
MATRIX: dict[str, dict[str, int]] = {
    #               owner approver admin other
    "read":        dict(owner=200, approver=200, admin=200, other=404),
    "events":      dict(owner=200, approver=200, admin=200, other=404),
    "decide":      dict(owner=403, approver=200, admin=403, other=404),
    "resume":      dict(owner=200, approver=403, admin=200, other=404),
    "raise_limits": dict(owner=200, approver=403, admin=200, other=404),
    "cancel":      dict(owner=200, approver=403, admin=200, other=404),
}
CELLS = [(action, role, status) for action, row in MATRIX.items() for role, status in row.items()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("permissions") / "gw"
    folder.mkdir(parents=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    config["teams"].append({"name": "root", "keys": [ADMIN], "admin": True, "budget_usd": None,
                            "policies": ["passthrough"]})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway-1.log")
    yield Served(folder, port, proc)
    proc.stop()


def url(served: Served, run_id: str, tail: str = "") -> str:
    return f"{served.url}/v1/runs/{run_id}{tail}"


async def waiting_run(session: aiohttp.ClientSession, served: Served) -> str:
    """A demo run under `files` that waits for a decision on delete_file (call c2)."""
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    run_id: str = headers["X-Run-Id"]
    return run_id


async def decided_run(session: aiohttp.ClientSession, served: Served) -> str:
    """A waiting run whose call ops has rejected: resumable."""
    run_id = await waiting_run(session, served)
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c2", "decision": "reject", "reason": "not now"})
    assert status == 200, body
    return run_id


async def attempt(session: aiohttp.ClientSession, served: Served, action: str,
                  key: str) -> tuple[str, int, Any]:
    """Set up a fresh run for `action`, then try it with `key`: (run id, status, body)."""
    if action in ("resume", "raise_limits"):
        run_id = await decided_run(session, served)
    else:
        run_id = await waiting_run(session, served)
    if action == "read":
        status, _, body = await request(session, "GET", url(served, run_id), key=key)
        _, _, listing = await request(session, "GET", f"{served.url}/v1/runs?team=demo", key=key)
        listed = run_id in [r["id"] for r in listing["data"]]
        assert listed == (status == 200), (status, listed)  # the listing agrees with the read
    elif action == "events":
        status, _, body = await request(session, "GET", url(served, run_id, "/events"), key=key)
    elif action == "decide":
        status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=key,
                                        body={"call_id": "c2", "decision": "reject"})
    elif action == "resume":
        status, _, body = await request(session, "POST", url(served, run_id, "/resume"), key=key, body={})
    elif action == "raise_limits":
        status, _, body = await request(session, "POST", url(served, run_id, "/resume"), key=key,
                                        body={"max_budget_usd": 5000, "max_turns": 10000})
    else:
        status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), key=key, body={})
    return run_id, status, body


@pytest.mark.parametrize(("action", "role", "expected"), CELLS, ids=[f"{a}-{r}" for a, r, _ in CELLS])
async def test_permission_matrix(served: Served, session: aiohttp.ClientSession, action: str, role: str,
                                 expected: int) -> None:
    run_id, status, body = await attempt(session, served, action, ROLES[role])
    assert status == expected, body
    if expected == 404:
        assert body["error"] == {"message": f"run {run_id} not found", "type": "not_found_error",
                                 "code": "run_not_found", "param": None}
    if expected == 403:
        error = body["error"]
        assert error["type"] == "permission_error" and set(error) == {"message", "type", "code", "param"}
        if action == "decide":
            assert error["code"] == "not_an_approver" and "approvers: ops" in error["message"]
        else:
            assert error["code"] == "not_run_owner"
            assert error["message"] == (
                f"team 'ops' may not {'cancel' if action == 'cancel' else 'resume'} run {run_id}: it may see the "
                "run and decide its approvals, but resuming and cancelling belong to the run's team 'demo' and to "
                "admin teams")
    run = await get_run(session, served.url, run_id)
    if action == "raise_limits":
        raised = (run["limits"]["max_turns"], run["limits"]["max_budget_usd"]) == (10000, 5000)
        assert raised == (expected == 200), run["limits"]  # a refused resume changed nothing
    if action in ("resume", "raise_limits"):
        assert run["status"] == ("completed" if expected == 200 else "interrupted"), run  # decided, not driven
        if expected != 200:
            assert run["interruption"]["waiting_for"] == "resume", run
    if action == "cancel":
        cancelled = run["status"] == "interrupted" and run["interruption"]["type"] == "cancelled"
        assert cancelled == (expected == 200), run
    if action == "decide":
        assert ("c2" in run["decisions"]) == (expected == 200), run["decisions"]


async def pending_gauge(session: aiohttp.ClientSession, served: Served) -> float:
    async with session.get(f"{served.url}/metrics") as resp:
        text = await resp.text()
    line = next((ln for ln in text.splitlines() if ln.startswith('gateway_approvals_pending{team="demo"}')), None)
    return float(line.split()[-1]) if line else 0.0


async def test_the_owner_cancels_a_run_waiting_for_a_decision(served: Served,
                                                             session: aiohttp.ClientSession) -> None:
    run_id = await waiting_run(session, served)
    waiting = await pending_gauge(session, served)
    status, headers, body = await request(session, "POST", url(served, run_id, "/cancel"),
                                          body={"reason": "not needed any more"})
    assert status == 200 and body["cancel"] == "done", body
    assert body["run"]["status"] == "interrupted" and headers["X-Run-Status"] == "interrupted"
    assert body["run"]["interruption"] == {"type": "cancelled", "reason": "not needed any more",
                                           "waiting_for": "resume"}
    assert await pending_gauge(session, served) == waiting - 1
    trace = await events(session, served.url, run_id)
    assert [e["type"] for e in trace][-3:] == ["cancel_requested", "approval_dropped", "run_stopped"]
    dropped = trace[-2]
    assert (dropped["callId"], dropped["toolName"], dropped["by"]) == ("c2", "delete_file", "demo")
    assert dropped["reason"] == "not needed any more" and trace[-1]["reason"] == "cancelled"
    # the dropped approval can no longer be decided, and nothing was deleted
    status, _, body = await request(session, "POST", url(served, run_id, "/approvals"), key=OPS,
                                    body={"call_id": "c2", "decision": "approve"})
    assert status == 409 and body["error"]["code"] == "not_waiting_for_call", body
    assert served.deleted(run_id) == []
    status, _, body = await request(session, "POST", url(served, run_id, "/cancel"), body={})
    assert status == 409 and body["error"]["code"] == "run_not_running"
    # resumed later, the run asks again: the call is still only pending
    status, _, body = await request(session, "POST", url(served, run_id, "/resume"), body={})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    assert body["run"]["interruption"]["type"] == "approval" and body["run"]["interruption"]["call_id"] == "c2"
    assert served.deleted(run_id) == []

