"""Sync python tools run on threads of their own; a policy reload never waits behind them.

A real gateway process (SQLite store, the scripted upstream) whose `blocking` policy has one
sync python tool that holds its thread until the test drops a file
(`tests/server/blocking_tools.py`). 32 server-side runs call it at once: all 32 run at once
(the default `server.tool_threads` is 32), `POST /v1/admin/reload` answers while they all
still block, and a run created after that answer is under the reloaded policy's version.
Before the tool pool, sync tools shared asyncio's default executor (min(32, cores + 4)
threads: 6 on two cores) with the reload, which queued behind them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.server.served import auth, get_run, request
from tests.support.procs import Proc, free_port, start_gateway

KEY = "sk-tools"
TOOLS = 32
"""Sync tool calls at once: the issue's figure, and the default pool size."""
RELOAD_WAIT_S = 15.0
"""How long the test lets the reload take while the tools block (it takes milliseconds)."""


def blocking_policy(max_turns: int) -> dict[str, Any]:
    return {"name": "blocking", "description": "One sync tool that blocks until the test releases it.",
            "limits": {"max_turns": max_turns, "max_budget_usd": 1.0},
            "tools": [{"name": "scan_archive", "description": "Blocks its thread until released.",
                       "parameters": {"type": "object", "properties": {}},
                       "executor": {"python": "tests.server.blocking_tools:wait_for_release"}}]}


def version_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    folder = tmp_path_factory.mktemp("tool-threads")
    (folder / "policies").mkdir()
    (folder / "policies" / "blocking.yaml").write_text(yaml.safe_dump(blocking_policy(5), sort_keys=False))
    (folder / "tools").mkdir()
    port = free_port()
    config = {"server": {"host": "127.0.0.1", "port": port},
              "store": {"kind": "sqlite", "path": "./gateway.db"},
              "policies_dir": "./policies",
              "upstreams": [{"name": "scripted", "kind": "scripted"}],
              "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
              "teams": [{"name": "tools", "keys": [KEY], "admin": True, "policies": ["blocking"]}]}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # One process whatever GATEWAY_TEST_WORKERS says: the pool under test is one process's, and
    # a second worker would run the 33rd call on a pool of its own.
    proc = start_gateway(["serve", "--config", str(folder / "config.yaml"), "--workers", "1"], "/healthz", port,
                         folder / "gateway.log", env={"GATEWAY_TEST_TOOL_DIR": str(folder / "tools")})
    yield proc, folder
    (folder / "tools" / "release").touch()
    proc.stop()


async def _run(session: aiohttp.ClientSession, url: str, run_id: str) -> dict[str, Any]:
    status, _, body = await request(session, "POST", f"{url}/v1/chat/completions", key=KEY,
                                    body={"model": "scripted-slow", "messages": [{"role": "user", "content": "Scan."}]},
                                    headers={"X-Run-Id": run_id})
    assert status == 200, body
    return await get_run(session, url, run_id, key=KEY)


async def _running(tools: Path, want: int, timeout: float) -> int:
    """How many tool calls have started, once `want` have or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        count = len(list(tools.glob("running-*")))
        if count >= want or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.05)  # polling the tools' marks


async def test_32_sync_tools_run_at_once_and_a_reload_answers_while_they_block(
        gateway: tuple[Proc, Path]) -> None:
    proc, folder = gateway
    tools, policy = folder / "tools", folder / "policies" / "blocking.yaml"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        runs = [asyncio.ensure_future(_run(session, proc.url, f"blocked-{i}")) for i in range(TOOLS)]
        try:
            running = await _running(tools, TOOLS, timeout=60)

            policy.write_text(yaml.safe_dump(blocking_policy(7), sort_keys=False))
            v2 = version_of(policy)
            try:
                status, _, body = await asyncio.wait_for(
                    request(session, "POST", f"{proc.url}/v1/admin/reload", key=KEY), RELOAD_WAIT_S)
            except TimeoutError:
                status, body = 0, f"no answer within {RELOAD_WAIT_S:g} s"
            blocked_at_answer = len(list(tools.glob("running-*")))
            released = (tools / "release").exists()
            after = asyncio.ensure_future(_run(session, proc.url, "after-reload"))  # created after the answer
        finally:
            (tools / "release").touch()
        done = await asyncio.gather(*runs)
        created_after = await after
    answered = status == 200 and not released
    assert (running, answered) == (TOOLS, True), (f"{running} of {TOOLS} sync tools ran at once; the reload "
                                                  f"answered while they blocked: {answered} ({body})")
    assert blocked_at_answer >= TOOLS
    assert body["changed"] == [{"name": "blocking", "version": v2}], body
    assert {r["status"] for r in done} == {"completed"}, [r["status"] for r in done]
    assert created_after["policy_version"] == v2 and created_after["limits"]["max_turns"] == 7, created_after
    assert {r["policy_version"] for r in done} != {v2}


async def test_tool_thread_saturation_is_a_metric(gateway: tuple[Proc, Path]) -> None:
    """One call more than the pool has threads waits for one, and the metrics say so."""
    proc, folder = gateway
    tools = folder / "tools"
    for mark in tools.iterdir():
        mark.unlink()  # the first test's marks and release
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        runs = [asyncio.ensure_future(_run(session, proc.url, f"saturated-{i}")) for i in range(TOOLS + 1)]
        try:
            running = await _running(tools, TOOLS, timeout=60)
            deadline = time.monotonic() + 30
            while True:
                async with session.get(f"{proc.url}/metrics", headers=auth(KEY)) as resp:
                    text = await resp.text()
                saturated = "gateway_tool_threads_busy 32.0" in text and "gateway_tool_calls_waiting 1.0" in text
                if saturated or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)  # polling until the 33rd call is waiting
        finally:
            (tools / "release").touch()
        await asyncio.gather(*runs)
        async with session.get(f"{proc.url}/metrics", headers=auth(KEY)) as resp:
            idle = await resp.text()
    assert running == TOOLS and saturated, "\n".join(line for line in text.splitlines() if line.startswith("gateway_tool"))
    assert "gateway_tool_threads 32.0" in text
    assert "gateway_tool_threads_busy 0.0" in idle and "gateway_tool_calls_waiting 0.0" in idle
