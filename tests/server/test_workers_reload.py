"""Policy reloads of a `gateway serve --workers 2`: real supervisor and worker processes.

- a SIGHUP that reaches the supervisor while a worker is starting (a restart after a crash)
  neither kills that worker nor stops the gateway: the worker reloads once it serves;
- POST /v1/admin/reload answers once every worker serves the reloaded set, so the calls
  that follow get the new versions whichever worker they reach.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.policy.test_reload_http import files_policy, start_run, start_served, version_of
from tests.server.served import OPS, Served, request
from tests.server.test_workers import wait_serving, wait_until, workers_of
from tests.support.procs import START_TIMEOUT_S


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """The served.py gateway (its policies, the scripted upstream, SQLite) with 2 workers, ops an admin."""
    served = start_served(tmp_path, "--workers", "2", timeout=120)
    try:
        wait_serving(served.proc)
        yield served
    finally:
        served.proc.stop()


@pytest.fixture
async def fresh() -> AsyncIterator[aiohttp.ClientSession]:
    """A connection per request: the kernel spreads them over both workers."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


def cap_files_at_two_turns(served: Served) -> str:
    path = files_policy(served)
    path.write_text(path.read_text().replace("max_turns: 20,", "max_turns: 2,"))
    return version_of(path)


async def test_a_sighup_while_a_worker_starts_neither_kills_it_nor_stops_the_gateway(
        served: Served, fresh: aiohttp.ClientSession) -> None:
    victim = workers_of(served.proc)[0]
    os.kill(victim, signal.SIGKILL)
    # The supervisor starts it again (after a short backoff): the SIGHUP lands while the new
    # worker is still importing, before it could have a handler of its own.
    wait_until(lambda: victim not in workers_of(served.proc) and len(workers_of(served.proc)) == 2, START_TIMEOUT_S)
    restarted = next(pid for pid in workers_of(served.proc) if pid != victim)
    v2 = cap_files_at_two_turns(served)
    served.proc.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: served.proc.output().count("2 workers serving") >= 2 or served.proc.popen.poll() is not None,
               START_TIMEOUT_S)
    assert served.proc.popen.poll() is None, served.proc.output()
    assert restarted in workers_of(served.proc)
    # the restarted worker reloaded too, once it served (it may have read the files before the edit)
    wait_until(lambda: served.proc.output().count("policies reloaded by SIGHUP") >= 2, START_TIMEOUT_S)
    for _ in range(8):
        assert (await start_run(fresh, served, "scripted-plan"))["policy_version"] == v2


async def test_an_admin_reload_answers_once_every_worker_serves_the_new_set(
        served: Served, fresh: aiohttp.ClientSession) -> None:
    before = (await start_run(fresh, served, "scripted-plan"))["policy_version"]
    v2 = cap_files_at_two_turns(served)
    assert v2 != before
    status, _, body = await request(fresh, "POST", f"{served.url}/v1/admin/reload", key=OPS)
    assert status == 200, body
    assert body["changed"] == [{"name": "files", "version": v2}]
    assert body["workers"] == {"count": 2, "reloaded": 2}
    runs = [await start_run(fresh, served, "scripted-plan") for _ in range(12)]
    assert [r["policy_version"] for r in runs] == [v2] * 12
    assert {r["status"] for r in runs} == {"max_turns_exceeded"}  # the plan needs 3 turns
