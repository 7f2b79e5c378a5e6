"""`gateway serve --workers N`: real supervisor and worker processes on one port.

- the memory store is refused with a clear error before anything listens;
- a turn cap is exact when the calls of one run land on two workers of one SQLite gateway;
- /metrics answers for every worker, whichever one a scrape lands on (multiprocess mode),
  and keeps a worker's counts after that worker was SIGKILLed and restarted;
- SIGTERM to the supervisor stops every worker; SIGKILL of the supervisor kills them too.

(The whole server suite also runs against 2-worker gateways: GATEWAY_TEST_WORKERS=2.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from gateway.harness.state import scoped_run_id
from gateway.store.sqlite import SqliteStore
from tests.server.test_admission import KEY, TASK, Upstream, chat, write_config
from tests.server.test_admission import upstream  # noqa: F401  (a real counting upstream)
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway


def workers_of(proc: Proc) -> list[int]:
    path = Path(f"/proc/{proc.popen.pid}/task/{proc.popen.pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(0.05)  # polling a process table, not a synchronisation stand-in


def wait_serving(proc: Proc, workers: int = 2) -> None:
    """Until the supervisor `proc` has `workers` workers and said they all serve."""
    wait_until(lambda: len(workers_of(proc)) == workers and f"{workers} workers serving" in proc.output(),
               START_TIMEOUT_S)


def start_two(folder: Path, upstream_url: str) -> Proc:
    """A 2-worker gateway on SQLite in front of the counting upstream, and of the built-in
    scripted one for models scripted-*, once both workers serve."""
    port = free_port()
    config = write_config(folder, port, upstream_url, {"kind": "sqlite", "path": "./gateway.db"})
    data = yaml.safe_load(config.read_text())
    data["upstreams"].append({"name": "scripted", "kind": "scripted"})
    data["models"].insert(0, {"match": "scripted-*", "upstream": "scripted"})
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(config), "--workers", "2"], "/healthz", port,
                         folder / "gateway.log", timeout=120)
    wait_serving(proc)
    return proc


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[Proc]:
    """One 2-worker gateway for the module's tests that leave it running."""
    proc = start_two(tmp_path_factory.mktemp("two") / "gw", upstream.url)
    yield proc
    proc.stop()


@pytest.fixture
def own_two(tmp_path: Path, upstream: Upstream) -> Iterator[Proc]:
    """A 2-worker gateway of the test's own (for the tests that end it)."""
    proc = start_two(tmp_path / "gw", upstream.url)
    yield proc
    proc.stop()


async def counted(url: str, name: str) -> float:
    """`name`'s value in a scrape on a fresh connection (so scrapes land on either worker)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(url + "/metrics") as resp:
            text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_the_memory_store_is_refused_with_more_than_one_worker(tmp_path: Path) -> None:
    config = write_config(tmp_path / "gw", free_port(), "http://127.0.0.1:9/v1", {"kind": "memory"})
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--workers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "store.kind" in done.stderr and "--workers 2" in done.stderr and "memory" in done.stderr


async def test_a_turn_cap_is_exact_across_workers(two: Proc, upstream: Upstream) -> None:
    run_id = f"cap-{uuid.uuid4().hex[:8]}"
    body = {"model": "cap", "messages": TASK}
    # a connection per call: the kernel spreads them over both workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        results = await asyncio.gather(*(chat(session, two, KEY, body, {"X-Run-Id": run_id}) for _ in range(48)))
    assert upstream.calls["cap"] == 20
    assert Counter(status for status, _, _ in results) == {200: 20, 429: 28}
    store = SqliteStore(two.log.parent / "gateway.db")
    try:
        run = await store.load_run(scoped_run_id("adm", run_id))
        assert run is not None and run.turns == 20
    finally:
        await store.close()


async def test_metrics_count_every_worker_and_survive_a_restarted_one(two: Proc, upstream: Upstream) -> None:
    before = await counted(two.url, "gateway_turns_total")  # the module's other tests' turns
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for i in range(30):
            status, _, _ = await chat(session, two, KEY, {"model": "m", "messages": TASK}, {"X-Run-Id": f"m{i}"})
            assert status == 200
    for _ in range(6):  # whichever worker answers the scrape, it counts both
        assert await counted(two.url, "gateway_turns_total") == before + 30
    victim = workers_of(two)[0]
    os.kill(victim, signal.SIGKILL)
    # a worker started again: a process start, which can take over 30 s on a loaded machine
    wait_until(lambda: victim not in workers_of(two) and len(workers_of(two)) == 2, START_TIMEOUT_S)
    wait_until(lambda: two.output().count("2 workers serving") >= 2, START_TIMEOUT_S)
    for _ in range(6):
        assert await counted(two.url, "gateway_turns_total") == before + 30  # the dead worker's counts kept
    async with aiohttp.ClientSession() as session, session.post(
            two.url + "/v1/chat/completions", data=orjson.dumps({"model": "m", "messages": TASK}),
            headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200


async def test_the_built_in_scripted_upstream_answers_whichever_worker_a_call_reaches(two: Proc) -> None:
    # Each worker calls the scripted mount at the shared port: the kernel may hand the call
    # to the other worker, which must take the same key.
    body = orjson.dumps({"model": "scripted-plan", "messages": TASK})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

        async def call() -> int:
            async with session.post(two.url + "/v1/chat/completions", data=body,
                                    headers={"Authorization": f"Bearer {KEY}", "X-Policy": "passthrough"}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(call() for _ in range(24)))
    assert Counter(statuses) == {200: 24}


def test_sigterm_stops_every_worker(own_two: Proc) -> None:
    kids = workers_of(own_two)
    banner = next(line for line in own_two.output().splitlines() if "2 workers serving" in line)
    assert f"2 workers serving on {own_two.url} (config " in banner and f"console at {own_two.url}/console/" in banner
    own_two.popen.send_signal(signal.SIGTERM)
    assert own_two.popen.wait(timeout=60) == 0
    wait_until(lambda: not any(alive(pid) for pid in kids))
    stopped = [line for line in own_two.output().splitlines() if line.startswith("gateway: stopped (pid ")]
    assert len(stopped) == 1, stopped  # the supervisor's one line, not one per worker
    assert stopped[0].startswith(f"gateway: stopped (pid {own_two.popen.pid}, 2 workers) in "), stopped
    assert stopped[0].endswith(", having drained 0 requests in flight"), stopped


def test_a_killed_supervisor_takes_its_workers_with_it(own_two: Proc) -> None:
    kids = workers_of(own_two)
    assert len(kids) == 2
    own_two.kill()
    wait_until(lambda: not any(alive(pid) for pid in kids))


def test_what_the_previous_workers_held_is_released_before_any_worker_serves(tmp_path: Path,
                                                                              upstream: Upstream) -> None:
    """A whole 2-worker server killed and started again: the leases its workers held are
    given back by the supervisor before it starts any worker, so the first worker to serve
    does not refuse a resume with run_busy for a lease its sibling held (each worker only
    releases its own, once it has started)."""
    port = free_port()
    config = write_config(tmp_path / "gw", port, upstream.url, {"kind": "sqlite", "path": "./gateway.db"})
    db = tmp_path / "gw" / "gateway.db"
    SqliteStore(db)  # the schema
    host = socket.gethostname()
    with sqlite3.connect(db) as conn:  # as a killed server's workers left them
        conn.executemany("INSERT INTO leases (run_id, owner, expires_at) VALUES (?, ?, ?)",
                         [(f"adm/run{i}", f"{host}/http://127.0.0.1:{port}/worker{i}", time.time() + 3600)
                          for i in range(2)])
    proc = start_gateway(["serve", "--config", str(config), "--workers", "2"], "/healthz", port,
                         tmp_path / "gateway.log", timeout=120)
    try:
        with sqlite3.connect(db) as conn:  # one worker answers; the other may still be starting
            # released leases keep their row (and epoch), expired
            assert conn.execute("SELECT run_id, owner FROM leases WHERE expires_at > ?", (time.time(),)).fetchall() == []
    finally:
        proc.stop()
