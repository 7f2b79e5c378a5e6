"""Junk input must not grow the metrics: 1,000 requests with random model names, random
paths, random policies and run ids add no series to a real gateway's /metrics.

A warm-up sends each kind of junk once, in order, through every route the junk can
reach (each of the five runs routes among them), so the bounded labels appear (code 404
on route "unmatched", model "other", ...); after it, the set of series must not change,
however many more random names arrive. Loopback only, bounded loop.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.store.timed import OPERATIONS as STORE_OPERATIONS

from tests.metrics.exposition import scrape
from tests.metrics.traffic import GATEWAY_ENV, write_gateway_config
from tests.support.procs import Proc, free_port, start_gateway

pytestmark = pytest.mark.timeout(180)

JUNK = 1000
CONCURRENCY = 16
KINDS = 10
RUN_ROUTES = ("", "/events", "/cancel", "/resume", "/approvals")  # after /v1/runs/{id}
RUNS_KIND = 7
SCRIPTED_KIND = 8


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("cardinality")
    config = write_gateway_config(tmp, trace_file=False)
    port = free_port()
    proc = start_gateway(["serve", "--config", str(config), "--port", str(port)], "/healthz", port,
                         tmp / "gateway.log", env=GATEWAY_ENV)
    yield proc
    proc.stop()


def token(rng: random.Random, n: int = 10) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(n))


JunkRequest = tuple[str, str, dict[str, str], dict[str, object] | None]


def junk_request(i: int, rng: random.Random, used: set[str]) -> JunkRequest:
    """The i-th junk request: (method, path, headers, json body); kind i % 10, and for the
    runs kind, runs route (i // 10) % 5. Every random value is recorded in `used` so the
    test can look for it in /metrics."""
    t = token(rng)
    used.add(t)
    auth = {"Authorization": "Bearer sk-demo"}
    chat = "/v1/chat/completions"
    body: dict[str, object] = {"model": f"m-{t}", "messages": [{"role": "user", "content": "hi"}]}
    kind = i % KINDS
    if kind == 0:  # unknown model, no route in the config
        return "POST", chat, auth, body
    if kind == 1:  # looks routed (matches scripted-*) but no such scenario
        return "POST", chat, auth, {**body, "model": f"scripted-{t}"}
    if kind == 2:  # unknown model on a run id of its own
        return "POST", chat, {**auth, "X-Run-Id": f"run-{t}"}, {**body, "model": f"gpt-{t}"}
    if kind == 3:  # unknown policy
        return "POST", chat, {**auth, "X-Policy": f"policy-{t}"}, {**body, "model": "scripted-plan"}
    if kind == 4:  # unknown key
        return "POST", chat, {"Authorization": f"Bearer sk-{t}"}, {**body, "model": "scripted-plan"}
    if kind == 5:  # random path at the root
        return "GET", f"/{t}/{token(rng, 6)}", auth, None
    if kind == 6:  # random path under /v1, POSTed
        return "POST", f"/v1/{t}", auth, body
    if kind == RUNS_KIND:  # a run that does not exist, through every runs route
        sub = RUN_ROUTES[(i // KINDS) % len(RUN_ROUTES)]
        return ("GET" if sub in ("", "/events") else "POST"), f"/v1/runs/{t}{sub}", auth, (None if sub in ("", "/events") else {})
    if kind == SCRIPTED_KIND:  # a random path on the scripted upstream's mount (an upstream: not counted)
        return "POST", f"/scripted/v1/{t}", auth, body
    # random path with a query string (/v1/models/{id} is a route: a catch-all glob serves any name)
    return "GET", f"/v1/models/{t}/{token(rng, 4)}?q={token(rng, 4)}", auth, None


def warmup_indexes() -> list[int]:
    """One junk request of each kind, the runs kind once per runs route: every route
    template and label value the junk can reach, deterministically."""
    indexes = [kind for kind in range(KINDS) if kind != RUNS_KIND]
    indexes += [RUNS_KIND + KINDS * n for n in range(len(RUN_ROUTES))]
    return indexes


async def warm_up(base_url: str, used: set[str]) -> dict[int, int]:
    """The warm-up, one request after the other (other random values than the junk's)."""
    rng = random.Random(1)
    statuses: dict[int, int] = {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in warmup_indexes():
            method, path, headers, body = junk_request(i, rng, used)
            async with session.request(method, base_url + path, headers=headers, json=body) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
    return statuses


async def send_junk(base_url: str, count: int, rng: random.Random, used: set[str]) -> dict[int, int]:
    """Send `count` junk requests, CONCURRENCY at a time; returns how many got each status."""
    statuses: dict[int, int] = {}
    queue = [junk_request(i, rng, used) for i in range(count)]
    timeout = aiohttp.ClientTimeout(total=30)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            method, path, headers, body = queue.pop()
            async with session.request(method, base_url + path, headers=headers, json=body) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return statuses


async def test_junk_adds_no_series(gateway: Proc) -> None:
    rng = random.Random(5)
    used: set[str] = set()
    warmed = await warm_up(gateway.url, used)
    assert sum(warmed.values()) == len(warmup_indexes()) == KINDS - 1 + len(RUN_ROUTES)
    scrape(gateway.url)  # the /metrics route's own series appear with the first scrape
    before = scrape(gateway.url)
    # the warm-up reached every route the junk can reach
    routes = before.label_values("gateway_requests_total", "route")
    assert {"/v1/chat/completions", "unmatched"} | {"/v1/runs/{id}" + sub for sub in RUN_ROUTES} <= routes, routes

    statuses = await send_junk(gateway.url, JUNK, rng, used)
    after = scrape(gateway.url)

    assert sum(statuses.values()) == JUNK
    assert all(400 <= status < 600 for status in statuses), statuses  # junk is refused, never served
    # every junk request was counted (plus the one scrape in between), but those sent to the
    # scripted upstream's mount, which is not the gateway's API ...
    scripted = sum(1 for i in range(JUNK) if i % KINDS == SCRIPTED_KIND)
    assert after.total("gateway_requests_total") - before.total("gateway_requests_total") == JUNK - scripted + 1
    # ... and not one series was added (but the store latency of an operation a background
    # task made for the first time meanwhile: its `op` is a method of the Store protocol)
    added = {(name, labels) for name, labels in after.series - before.series
             if not (name.startswith("gateway_store_seconds") and dict(labels).get("op") in STORE_OPERATIONS)}
    assert not added, f"{len(added)} new series after {JUNK} junk requests, e.g. {sorted(added)[:10]}"
    # no random value reached any label
    leaked = [t for t in used if t in after.text]
    assert not leaked, f"random input in /metrics: {leaked[:5]}"


async def test_series_stay_bounded_in_number(gateway: Proc) -> None:
    """Whatever came before, the whole exposition stays small: bounded label sets only."""
    rng = random.Random(55)
    await send_junk(gateway.url, 200, rng, set())
    exposition = scrape(gateway.url)
    routes = exposition.label_values("gateway_requests_total", "route")
    assert "unmatched" in routes
    assert all(r == "unmatched" or r.startswith("/") for r in routes), routes
    assert len(routes) <= 20, routes
    assert len(exposition.series) < 1500, len(exposition.series)


def test_series_snapshot_detects_a_new_series(tmp_path: Path) -> None:
    """The comparison above would see a leak: one new label value is one new series."""
    from tests.metrics.exposition import parse

    base = '# TYPE gateway_turns_total counter\ngateway_turns_total{team="demo",policy="files",model="other"} 1\n'
    leak = base + 'gateway_turns_total{team="demo",policy="files",model="m-abc"} 1\n'
    assert parse(leak).series - parse(base).series == {
        ("gateway_turns_total", (("model", "m-abc"), ("policy", "files"), ("team", "demo")))}
