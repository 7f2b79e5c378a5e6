"""A store outage is a retryable 503, never a 500, and nothing goes upstream meanwhile;
server-side runs the outage cut are not left `running` (the recovery sweeper stops them).

Real processes: a gateway on a real redis-server, or on a real PostgreSQL
(`store.timeout_s: 0.5`), that the test stops, restarts on the same port (append-only
file, the cluster's data folder: the data survives) or freezes with SIGSTOP. Calls made meanwhile get 503 `store_unavailable` with `retry-after` and
`x-should-retry: true`; the upstream sees none of them (its call count, read from the
gateway's metrics, does not move); service returns with the store.

One gateway and one redis-server serve the module's tests (each outage ends with the store
back, which is part of what is tested: the same process serves again); after each test the
store is running and thawed whatever happened.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.faults.support import FILES_HEADERS, PLAN_BODY, RedisProc, chat, serve
from tests.server.served import poll, request, wait_event
from tests.support.postgres import Cluster
from tests.support.procs import Proc
from tests.support.shared_store import SHARED_KINDS

PASS_BODY: dict[str, Any] = {"model": "scripted-plan", "messages": [{"role": "user", "content": "hi"}]}
PASS_HEADERS = {"X-Policy": "passthrough"}
STORE_TIMEOUT_S = 0.5
CALL_TIMEOUT_S = 10.0
"""A call still unanswered after this long is a hang (a store call has a 0.5 s deadline)."""


StoreProc = RedisProc | Cluster


LEASE_TTL_S = 3
"""Short, so that recovery comes soon, but longer than a loaded machine stalls a process: a
worker that stalled past it would rightly lose its run to another worker (409 `run_conflict`,
not the outage under test)."""


def redis_gateway(folder: Path, redis: StoreProc) -> Proc:
    if isinstance(redis, Cluster):
        return serve(folder, redis.store(timeout_s=STORE_TIMEOUT_S), server={"lease_ttl_s": LEASE_TTL_S})
    return serve(folder, {"kind": "redis", "url": redis.url, "timeout_s": STORE_TIMEOUT_S},
                 server={"lease_ttl_s": LEASE_TTL_S})


@pytest.fixture(scope="module", params=SHARED_KINDS)
def redis_proc(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[StoreProc]:
    """The module's store server: a redis-server (append-only: a restart keeps the data), or a
    PostgreSQL cluster of its own."""
    folder = tmp_path_factory.mktemp("outage")
    proc: StoreProc = RedisProc(folder / "redis") if request.param == "redis" else Cluster()
    proc.start()
    try:
        yield proc
    finally:
        proc.remove() if isinstance(proc, Cluster) else proc.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: StoreProc) -> Iterator[Proc]:
    gw = redis_gateway(tmp_path_factory.mktemp("outage") / "gw", redis_proc)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def gw(gateway: Proc, redis_proc: StoreProc) -> Iterator[Proc]:
    """The module's gateway; after the test its store is up (started, thawed) again."""
    yield gateway
    if isinstance(redis_proc, Cluster):
        redis_proc.thaw()
        if not redis_proc.running():
            redis_proc.start()
    elif redis_proc.popen is None or redis_proc.popen.poll() is not None:
        redis_proc.start()
    else:
        redis_proc.thaw()


async def upstream_calls(session: aiohttp.ClientSession, url: str) -> float:
    """Calls the gateway made upstream (the count of gateway_upstream_duration_seconds)."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    return sum(float(m) for m in re.findall(r"^gateway_upstream_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M))


def assert_store_unavailable(status: int, headers: dict[str, str], body: Any) -> None:
    assert status == 503, body
    assert headers.get("Retry-After") == "1"
    assert headers.get("x-should-retry") == "true"
    assert set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["code"] == "store_unavailable"
    assert "store" in body["error"]["message"]
    assert "Error:" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]


async def every_kind_of_call(session: aiohttp.ClientSession, url: str) -> list[tuple[int, dict[str, str], Any]]:
    """A pass-through call, a streamed one and a server-side run."""
    return [
        await chat(session, url, PASS_BODY, headers=PASS_HEADERS, timeout_s=CALL_TIMEOUT_S),
        await chat(session, url, {**PASS_BODY, "stream": True}, headers=PASS_HEADERS, timeout_s=CALL_TIMEOUT_S),
        await chat(session, url, PLAN_BODY, headers=FILES_HEADERS, timeout_s=CALL_TIMEOUT_S),
    ]


async def test_a_stopped_store_is_a_503_and_nothing_is_forwarded(gw: Proc, redis_proc: StoreProc,
                                                                 session: aiohttp.ClientSession) -> None:
    logged = len(gw.output())
    assert [s for s, _, _ in await every_kind_of_call(session, gw.url)] == [200, 200, 200]
    before = await upstream_calls(session, gw.url)
    redis_proc.stop()
    for status, headers, body in await every_kind_of_call(session, gw.url):
        assert_store_unavailable(status, headers, body)
    status, headers, body = await chat(session, gw.url, PASS_BODY, headers={"X-Run-Id": "run_x", **PASS_HEADERS},
                                       timeout_s=CALL_TIMEOUT_S)
    assert_store_unavailable(status, headers, body)
    redis_proc.start()
    assert await upstream_calls(session, gw.url) == before  # none of the refused calls went upstream
    assert [s for s, _, _ in await every_kind_of_call(session, gw.url)] == [200, 200, 200]
    assert "Traceback" not in gw.output()[logged:]


async def test_a_frozen_store_is_a_503_within_its_deadline(gw: Proc, redis_proc: StoreProc,
                                                          session: aiohttp.ClientSession) -> None:
    assert [s for s, _, _ in await every_kind_of_call(session, gw.url)] == [200, 200, 200]
    redis_proc.freeze()
    try:
        for status, headers, body in await every_kind_of_call(session, gw.url):
            assert_store_unavailable(status, headers, body)
    finally:
        redis_proc.thaw()
    assert [s for s, _, _ in await every_kind_of_call(session, gw.url)] == [200, 200, 200]


async def test_a_store_restarted_under_load_gives_503s_not_500s(gw: Proc, redis_proc: StoreProc,
                                                               session: aiohttp.ClientSession) -> None:
    statuses: dict[int, int] = {}
    bodies: dict[int, Any] = {}
    done = asyncio.Event()

    async def worker(i: int) -> None:
        body, headers = (PLAN_BODY, FILES_HEADERS) if i % 2 else (PASS_BODY, PASS_HEADERS)
        while not done.is_set():
            status, _, answer = await chat(session, gw.url, body, headers=headers, timeout_s=CALL_TIMEOUT_S)
            statuses[status] = statuses.get(status, 0) + 1
            bodies.setdefault(status, answer)

    async def none_running() -> bool:  # runs cut by the outage are recovered, not left running
        status, _, listed = await request(session, "GET", f"{gw.url}/v1/runs?status=running&limit=1000")
        if status == 503:  # the restarted store answered a read too slowly (a loaded machine): ask again
            assert listed["error"]["code"] == "store_unavailable", listed
            return False
        assert status == 200, listed
        return not [r for r in listed["data"] if r["policy"] == "files"]

    workers = [asyncio.ensure_future(worker(i)) for i in range(8)]
    try:
        await poll(lambda: _at_least(statuses, 200, 40), timeout=60)
        redis_proc.stop()
        await poll(lambda: _at_least(statuses, 503, 40), timeout=60)
        redis_proc.start()
        ok = statuses.get(200, 0)
        await poll(lambda: _at_least(statuses, 200, ok + 40), timeout=60)
    finally:
        done.set()
        await asyncio.gather(*workers)
    assert set(statuses) == {200, 503}, "; ".join(f"{s}: {bodies[s]}" for s in statuses if s not in (200, 503))
    assert bodies[503]["error"]["code"] == "store_unavailable"
    await poll(none_running, timeout=30)


async def _at_least(counts: dict[int, int], status: int, n: int) -> bool:
    return counts.get(status, 0) >= n


async def test_a_stream_whose_turn_cannot_be_saved_is_answered_whole_and_its_turn_spooled(
        gw: Proc, redis_proc: StoreProc, session: aiohttp.ClientSession) -> None:
    """The upstream was paid while the store went away: the client gets the whole answer and
    the turn waits in the spool file (booked when the store is back: tests/server/test_spool.py)."""
    headers = {"Authorization": "Bearer sk-demo", "X-Scripted-Chunk-Delay-Ms": "100", "X-Run-Id": "run_spooled",
               **PASS_HEADERS}
    body = {"model": "scripted-plan", "stream": True,
            "messages": [{"role": "user", "content": "Which file mentions a timeout?"}]}
    async with session.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the stream is open: the upstream is answering
        redis_proc.stop()
        rest = await asyncio.wait_for(resp.content.read(), CALL_TIMEOUT_S)
    events = [e for e in rest.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"error"' in e for e in events)
    spool = gw.log.parent / "spool.jsonl"
    spooled = [orjson.loads(line) for line in spool.read_bytes().splitlines()]
    assert [s["run_id"] for s in spooled if s["run_id"] == "demo/run_spooled"] == ["demo/run_spooled"]


async def test_a_store_frozen_mid_run_ends_the_call_with_a_503_and_the_run_is_recovered(
        gw: Proc, redis_proc: StoreProc, session: aiohttp.ClientSession) -> None:
    """The lease keeper's renewals time out; after a whole TTL it stops the run, whose save
    fails too: 503, not a call that waits on a frozen store. Thawed, recovery stops the run."""
    headers = {"X-Policy": "files", "X-Run-Id": "run_frozen"}
    call = asyncio.ensure_future(chat(session, gw.url, {**PLAN_BODY, "model": "scripted-slow"}, headers=headers,
                                      timeout_s=CALL_TIMEOUT_S))
    await wait_event(session, gw.url, "run_frozen", "tool_start")
    redis_proc.freeze()
    try:
        status, headers, body = await call
    finally:
        redis_proc.thaw()
    assert_store_unavailable(status, headers, body)

    async def recovered() -> dict[str, Any] | None:
        status, _, run = await request(session, "GET", f"{gw.url}/v1/runs/run_frozen")
        return run if status == 200 and run["status"] != "running" else None

    run = await poll(recovered, timeout=30)
    assert (run["status"], run["reason"]) == ("interrupted", "crashed")
