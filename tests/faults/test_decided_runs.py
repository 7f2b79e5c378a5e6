"""A decided run nobody drives yet is not a crashed run.

The README's walk-through on a real gateway (SQLite, `server.lease_ttl_s: 1`, so the
recovery sweep passes every 0.5 s): run `r2` under `files` (`on_decision: wait`) pauses
on `c2`, ops approves it, and the run then waits for its owner's resume for longer than a
lease TTL and several sweeps. It must still be resumable as a waiting run (not
`interrupted`/`crashed`), say what it waits for, and complete on the resume with no
`crashed` line anywhere (trace, `gateway trace`, metrics).

The sweeps are not waited for by the clock: a second run, under a policy whose approvals
expire at once, is started only once `r2` has been undriven for longer than a lease TTL;
the sweep that rejects its approval listed `r2` too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.faults.support import chat, files_variant, serve
from tests.server.served import OPS, TASK, events, get_run, poll, request, wait_event
from tests.support.procs import Proc

LEASE_TTL_S = 1.0
SQLITE = {"kind": "sqlite", "path": "./gateway.db"}
DESTRUCTIVE: dict[str, Any] = {"model": "scripted-destructive", "messages": [{"role": "user", "content": "Free some space"}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    folder = tmp_path_factory.mktemp("decided") / "gw"
    expiring = files_variant("files_expiring")
    expiring["approval"]["expires_after_s"] = 0.05
    proc = serve(folder, SQLITE, server={"lease_ttl_s": LEASE_TTL_S}, variants=[expiring])
    try:
        yield proc, folder
    finally:
        proc.stop()


async def a_sweep_after(session: aiohttp.ClientSession, url: str, moment: float) -> None:
    """Return once a recovery sweep that started after `moment` (epoch seconds) has run."""
    await poll(lambda: _past(moment), timeout=30)
    status, headers, body = await chat(session, url, {"model": "scripted-destructive", "messages": TASK},
                                       headers={"X-Policy": "files_expiring"})
    assert status == 200 and body["run"]["interruption"]["type"] == "approval", body
    await wait_event(session, url, headers["X-Run-Id"], "approval_expired")


async def _past(moment: float) -> bool:
    return time.time() > moment


async def test_an_approved_run_waits_for_its_owners_resume_and_is_never_marked_crashed(
        gw: tuple[Proc, Path], session: aiohttp.ClientSession) -> None:
    proc, folder = gw
    status, _, body = await chat(session, proc.url, DESTRUCTIVE, headers={"X-Run-Id": "r2", "X-Policy": "files"})
    assert status == 200 and body["run"]["interruption"]["call_id"] == "c2", body
    status, _, body = await request(session, "POST", f"{proc.url}/v1/runs/r2/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve"})
    assert status == 200, body
    decided = await get_run(session, proc.url, "r2")

    await a_sweep_after(session, proc.url, decided["updated_at"] + 2 * LEASE_TTL_S)
    run = await get_run(session, proc.url, "r2")
    assert run["reason"] != "crashed", run
    assert (run["status"], run["reason"]) == ("interrupted", "approval"), run
    assert run["interruption"]["waiting_for"] == "resume" and run["interruption"]["decision"] == "approve", run
    assert run["turns"] == 2

    status, _, body = await request(session, "POST", f"{proc.url}/v1/runs/r2/resume", body={})
    assert status == 200 and body["run"]["status"] == "completed", body
    trace = await events(session, proc.url, "r2")
    assert [(e["status"], e["reason"]) for e in trace if e["type"] == "run_stopped"] == [
        ("interrupted", "approval"), ("completed", "completed")]
    timeline = subprocess.run([sys.executable, "-m", "gateway", "trace", "r2", "--config", "config.yaml"],
                              cwd=folder, capture_output=True, text=True, timeout=60)
    assert timeline.returncode == 0, timeline.stderr
    assert "completed" in timeline.stdout and "crashed" not in timeline.stdout, timeline.stdout
    async with session.get(f"{proc.url}/metrics") as resp:
        metrics = await resp.text()
    crashed = [line for line in metrics.splitlines()
               if line.startswith("gateway_runs_stopped_total{") and 'reason="crashed"' in line]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in crashed), crashed


async def test_the_next_chat_call_of_a_decided_run_is_its_resume(
        gw: tuple[Proc, Path], session: aiohttp.ClientSession) -> None:
    proc, _ = gw
    headers = {"X-Run-Id": "r3", "X-Policy": "files"}
    status, _, body = await chat(session, proc.url, DESTRUCTIVE, headers=headers)
    assert status == 200 and body["run"]["interruption"]["waiting_for"] == "decision", body
    status, _, body = await request(session, "POST", f"{proc.url}/v1/runs/r3/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "reject", "reason": "keep the logs"})
    assert status == 200 and body["run"]["interruption"]["waiting_for"] == "resume", body
    assert body["run"]["interruption"]["decision"] == "reject"
    status, _, body = await chat(session, proc.url, DESTRUCTIVE, headers=headers)
    assert status == 200 and body["run"]["status"] == "completed", body
    run = await get_run(session, proc.url, "r3")
    reply = next(m for m in run["transcript"] if m.get("tool_call_id") == "c2")
    assert "keep the logs" in reply["content"]
