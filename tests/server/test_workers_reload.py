"""Policy reloads of a `gateway serve --workers 2`: real supervisor and worker processes.

- a SIGHUP that reaches the supervisor while a worker is starting (a restart after a crash)
  neither kills that worker nor stops the gateway: the worker reloads once it serves;
- POST /v1/admin/reload answers once every worker serves the reloaded set, so the calls
  that follow get the new versions whichever worker they reach.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.policy.test_reload_http import start_served
from tests.server.served import OPS, chat_body, get_run, request
from tests.server.test_workers import wait_until, workers_of
from tests.support.procs import START_TIMEOUT_S, Proc


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Proc]:
    """The served.py gateway (its policies, the scripted upstream, SQLite) with 2 workers, ops an admin."""
    proc = start_served(tmp_path, "--workers", "2", timeout=120).proc
    try:
        wait_until(lambda: len(workers_of(proc)) == 2 and "2 workers serving" in proc.output(), START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def fresh() -> AsyncIterator[aiohttp.ClientSession]:
    """A connection per request: the kernel spreads them over both workers."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


def version_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


async def new_run(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status, headers, body = await request(session, "POST", f"{url}/v1/chat/completions",
                                          body=chat_body("scripted-plan"), headers={"X-Policy": "files"})
    assert status == 200, body
    return await get_run(session, url, headers["X-Run-Id"])


def cap_files_at_two_turns(folder: Path) -> str:
    path = folder / "policies" / "files.yaml"
    path.write_text(path.read_text().replace("max_turns: 20,", "max_turns: 2,"))
    return version_of(path)


async def test_a_sighup_while_a_worker_starts_neither_kills_it_nor_stops_the_gateway(
        two: Proc, fresh: aiohttp.ClientSession) -> None:
    victim = workers_of(two)[0]
    os.kill(victim, signal.SIGKILL)
    # The supervisor starts it again (after a short backoff): the SIGHUP lands while the new
    # worker is still importing, before it could have a handler of its own.
    wait_until(lambda: victim not in workers_of(two) and len(workers_of(two)) == 2, START_TIMEOUT_S)
    restarted = next(pid for pid in workers_of(two) if pid != victim)
    v2 = cap_files_at_two_turns(two.log.parent)
    two.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: two.output().count("2 workers serving") >= 2 or two.popen.poll() is not None,
               START_TIMEOUT_S)
    assert two.popen.poll() is None, two.output()
    assert restarted in workers_of(two)
    # the restarted worker reloaded too, once it served (it may have read the files before the edit)
    wait_until(lambda: two.output().count("policies reloaded by SIGHUP") >= 2, START_TIMEOUT_S)
    for _ in range(8):
        assert (await new_run(fresh, two.url))["policy_version"] == v2


async def test_an_admin_reload_answers_once_every_worker_serves_the_new_set(
        two: Proc, fresh: aiohttp.ClientSession) -> None:
    before = (await new_run(fresh, two.url))["policy_version"]
    v2 = cap_files_at_two_turns(two.log.parent)
    assert v2 != before
    status, _, body = await request(fresh, "POST", f"{two.url}/v1/admin/reload", key=OPS)
    assert status == 200, body
    assert body["changed"] == [{"name": "files", "version": v2}]
    assert body["workers"] == {"count": 2, "reloaded": 2}
    runs = [await new_run(fresh, two.url) for _ in range(12)]
    assert [r["policy_version"] for r in runs] == [v2] * 12
    assert {r["status"] for r in runs} == {"max_turns_exceeded"}  # the plan needs 3 turns
