"""Rate allowances (gateway/server/runs/allowances.py) against two real gateway processes on
one store (a SQLite file, a real redis-server) and a real HTTP upstream:

- what a replica takes ahead of its calls is spent on the shared clocks at once (the clock
  runs ahead of the calls admitted), and given back exactly once the replica is idle: the
  clock then reads what the admitted calls spent, no more;
- the tokens a call uses beyond those it counted are paid from the allowance, and the token
  clock, once given back, reads exactly the tokens the upstream billed;
- a replica's answers show the clocks as if it held nothing ahead: remaining requests fall
  by one per call, never by what it took;
- under a 64-way storm over both replicas, a limit far from reached at first still admits
  no more than it allows.

The clocks are read in the store itself (the SQLite file, the redis hash), so the tests see
what every replica sees. Limits are chosen so that a call takes far less time than the
clock moves per call (200 ms or more): the clock runs ahead of now, and sums are exact.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from gateway.config.rates import key_scope
from gateway.server.runs.allowances import FRESH_S, MAX_SPARE
from tests.server.test_admission import (  # noqa: F401  (session, upstream: the fixtures of the admission tests)
    TASK,
    Upstream,
    chat,
    session,
    two_replicas,
    upstream,
    write_policies,
)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway

AHEAD, TOKENS, STORM, WARM, NEAR = "sk-ahead", "sk-ahead-tokens", "sk-ahead-storm", "sk-warm", "sk-near"
KEYED = "sk-ahead-keyed"
"""A key with limits of its own (256 a minute) in a team with its own (300 a minute: 200 ms of
the clock per request, so that twenty calls on a loaded machine still keep it ahead of now)."""
KEYED_TEAM_PER_MINUTE = 300
REQUESTS_PER_MINUTE = 256
"""A request costs 234 ms of the clock: a replica takes 3 ahead (1/64 of the room)."""
TOKENS_PER_MINUTE = 6_000
"""A token costs 10 ms of the clock: a call of ~20 tokens, 200 ms."""
STORM_PER_MINUTE = 640
NEAR_PER_MINUTE = 128
"""The largest limit never taken ahead (docs/limits.md): room for two requests per 1/64 at most."""


def write_config(folder: Path, port: int, upstream_url: str, store: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    team = {"budget_usd": None, "policies": ["passthrough"]}
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store,
        "policies_dir": str(write_policies(folder.parent)),
        "upstreams": [{"name": "counting", "base_url": upstream_url}],
        "models": [{"match": "*", "upstream": "counting", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "ahead", "keys": [AHEAD], **team,
             "rate_limits": {"requests_per_minute": REQUESTS_PER_MINUTE}},
            {"name": "ahead-tokens", "keys": [TOKENS], **team,
             "rate_limits": {"tokens_per_minute": TOKENS_PER_MINUTE}},
            {"name": "ahead-storm", "keys": [STORM], **team,
             "rate_limits": {"requests_per_minute": STORM_PER_MINUTE}},
            {"name": "warm", "keys": [WARM], **team},
            {"name": "near", "keys": [NEAR], **team, "rate_limits": {"requests_per_minute": NEAR_PER_MINUTE}},
            {"name": "keyed", "keys": [{"key": KEYED, "rate_limits": {"requests_per_minute": 256}}], **team,
             "rate_limits": {"requests_per_minute": KEYED_TEAM_PER_MINUTE}},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(folder: Path, upstream_url: str, store: dict[str, Any]) -> Proc:
    port = free_port()
    config = write_config(folder, port, upstream_url, store)
    # One process per replica, whatever GATEWAY_TEST_WORKERS says: each process holds its own
    # allowance, and the headers test reads one process's view of the clocks.
    return start_gateway(["serve", "--config", str(config), "--workers", "1"], "/healthz", port,
                         folder / "gateway.log", timeout=START_TIMEOUT_S)


class Clocks:
    """A team's rate clocks (epoch seconds) as the store holds them."""

    def __init__(self, store: dict[str, Any], folder: Path) -> None:
        self.store, self.folder = store, folder

    def read(self, team: str, scope: str | None = None) -> tuple[float, float]:
        """The clocks of `team`'s own scope, or of `scope` (a key's)."""
        if self.store["kind"] == "sqlite":
            with sqlite3.connect(self.folder / "a" / "gateway.db") as db:
                row = db.execute("SELECT requests_tat, tokens_tat FROM reservations WHERE id = ?",
                                 (scope or "team:" + team,)).fetchone()
            return (float(row[0] or 0.0), float(row[1] or 0.0)) if row else (0.0, 0.0)
        client = redis.Redis.from_url(self.store["url"])
        try:
            if scope is None:
                r, t = client.hmget(self.store["prefix"] + "ledger:" + team, "rate:r", "rate:t")
            else:
                r, t = client.hmget(self.store["prefix"] + "rate:" + scope, "r", "t")
        finally:
            client.close()
        return float(r or 0.0), float(t or 0.0)

    async def after_call(self, session: aiohttp.ClientSession, proc: Proc, key: str, body: dict[str, Any],
                         kind: int) -> float:
        """One call of `body` (its model is the team's name), then that team's clock `kind`
        (0: requests, 1: tokens)."""
        status, _, reply = await chat(session, proc, key, body)
        assert status == 200, reply
        return self.read(body["model"])[kind]

    async def settled(self, team: str, kind: int, expected: float, deadline_s: float = 10 * FRESH_S) -> float:
        """The clock once it reads `expected` (what the replicas give back when idle), or its
        last reading when it has not by the deadline."""
        until = time.monotonic() + deadline_s
        while True:
            value = self.read(team)[kind]
            if abs(value - expected) < 1e-5 or time.monotonic() > until:
                return value
            await asyncio.sleep(0.05)  # polling the store: the replicas give back on their own clock


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def replicas(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             upstream: Upstream) -> Iterator[tuple[Proc, Proc, Clocks]]:
    """Two replicas on one store (a shared SQLite file, or one redis-server)."""
    folder = tmp_path_factory.mktemp(f"ahead-{request.param}")
    if request.param == "sqlite":
        store: dict[str, Any] = {"kind": "sqlite", "path": str(folder / "a" / "gateway.db")}
    else:
        url = request.getfixturevalue("redis_url")
        store = {"kind": "redis", "url": url, "prefix": f"ah-{uuid.uuid4().hex[:8]}:"}
    for model in ("ahead", "ahead-tokens", "ahead-storm", "near", "keyed"):
        upstream.delay_s[model] = 0.0  # calls far quicker than the clock moves per call
    with two_replicas(start, folder, upstream.url, store) as (a, b):
        # A first call costs a new process more than the clock moves: made on another team.
        asyncio.run(_warm(a, b))
        yield a, b, Clocks(store, folder)


async def _warm(*procs: Proc) -> None:
    async with aiohttp.ClientSession() as s:
        for proc in procs:
            status, _, reply = await chat(s, proc, WARM, {"model": "warm", "messages": TASK})
            assert status == 200, reply


async def test_what_a_replica_takes_ahead_is_spent_at_once_and_given_back_exactly(
        replicas: tuple[Proc, Proc, Clocks], session: aiohttp.ClientSession) -> None:
    a, b, clocks = replicas
    body = {"model": "ahead", "messages": TASK}
    per = 60 / REQUESTS_PER_MINUTE
    first = await clocks.after_call(session, a, AHEAD, body, 0)  # one request from a fresh bucket: now + per
    for i in range(19):
        status, _, reply = await chat(session, (b, a)[i % 2], AHEAD, body)
        assert status == 200, reply
    ahead = clocks.read("ahead")[0]
    # The replicas took requests of calls still to come, on the shared clock.
    assert ahead >= first + 20 * per - 1e-5, (ahead - first) / per
    given_back = await clocks.settled("ahead", 0, first + 19 * per)
    assert abs(given_back - (first + 19 * per)) < 1e-5, ((given_back - first) / per, (ahead - first) / per)


async def test_a_keys_and_its_teams_clocks_are_taken_ahead_together_and_given_back_exactly(
        replicas: tuple[Proc, Proc, Clocks], session: aiohttp.ClientSession) -> None:
    a, b, clocks = replicas
    body = {"model": "keyed", "messages": TASK}
    scope = key_scope(KEYED)
    status, _, reply = await chat(session, a, KEYED, body)
    assert status == 200, reply
    team_first, key_first = clocks.read("keyed")[0], clocks.read("keyed", scope)[0]
    for i in range(19):
        status, _, reply = await chat(session, (b, a)[i % 2], KEYED, body)
        assert status == 200, reply
    team_per, key_per = 60 / KEYED_TEAM_PER_MINUTE, 60 / 256
    # Both scopes' clocks took the same requests ahead (the key's room decides how many).
    team_ahead = (clocks.read("keyed")[0] - team_first) / team_per
    key_ahead = (clocks.read("keyed", scope)[0] - key_first) / key_per
    assert team_ahead > 19.5 and abs(team_ahead - key_ahead) < 1e-3, (team_ahead, key_ahead)
    team = await clocks.settled("keyed", 0, team_first + 19 * team_per)
    key = clocks.read("keyed", scope)[0]
    assert abs(team - (team_first + 19 * team_per)) < 1e-5, (team - team_first) / team_per
    assert abs(key - (key_first + 19 * key_per)) < 1e-5, (key - key_first) / key_per


async def test_a_small_limit_is_never_taken_ahead(replicas: tuple[Proc, Proc, Clocks],
                                                  session: aiohttp.ClientSession) -> None:
    a, b, clocks = replicas
    body = {"model": "near", "messages": TASK}
    per = 60 / NEAR_PER_MINUTE
    first = await clocks.after_call(session, a, NEAR, body, 0)
    for i in range(9):
        status, _, reply = await chat(session, (b, a)[i % 2], NEAR, body)
        assert status == 200, reply
        # Each call spent its own request and nothing more, at once.
        assert abs(clocks.read("near")[0] - (first + (i + 1) * per)) < 1e-5, i


async def test_tokens_beyond_those_counted_are_paid_from_the_allowance_and_book_exactly(
        replicas: tuple[Proc, Proc, Clocks], session: aiohttp.ClientSession) -> None:
    a, b, clocks = replicas
    body = {"model": "ahead-tokens", "messages": TASK}
    per = 60 / TOKENS_PER_MINUTE
    first = await clocks.after_call(session, a, TOKENS, body, 1)  # its tokens, reconciled at its booking
    billed = 0
    for i in range(11):
        status, _, reply = await chat(session, (a, b)[i % 2], TOKENS, body)
        assert status == 200, reply
        billed += reply["usage"]["total_tokens"]
    assert billed > 11 * 10  # prompt and completion: more than each call counted before it ran
    ahead = clocks.read("ahead-tokens")[1]
    assert ahead > first + billed * per + per / 2, ((ahead - first) / per, billed)
    given_back = await clocks.settled("ahead-tokens", 1, first + billed * per)
    assert abs(given_back - (first + billed * per)) < 1e-5, ((given_back - first) / per, billed)


async def test_a_replicas_answers_show_the_clocks_without_what_it_took_ahead(
        replicas: tuple[Proc, Proc, Clocks], session: aiohttp.ClientSession) -> None:
    a, _, clocks = replicas
    body = {"model": "ahead", "messages": TASK}
    remaining = []
    for _ in range(15):
        status, headers, reply = await chat(session, a, AHEAD, body)
        assert status == 200, reply
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
    steps = [after - before for before, after in zip(remaining, remaining[1:])]
    # One request per call; the bucket refills one per 234 ms, more than a call takes.
    assert set(steps) <= {-1, 0}, remaining
    assert steps.count(-1) >= 10, remaining


async def test_a_storm_over_both_replicas_admits_no_more_than_the_limit(
        replicas: tuple[Proc, Proc, Clocks], session: aiohttp.ClientSession, upstream: Upstream) -> None:
    a, b, _ = replicas
    body = {"model": "ahead-storm", "messages": TASK}
    before = upstream.calls["ahead-storm"]
    started = time.monotonic()
    results = []
    for _ in range(12):  # waves of 64: far from the limit at first (allowances), then at it
        results += await asyncio.gather(*(chat(session, (a, b)[i % 2], STORM, body) for i in range(64)))
    elapsed = time.monotonic() - started
    admitted = upstream.calls["ahead-storm"] - before
    assert sum(status == 200 for status, _, _ in results) == admitted
    assert {status for status, _, _ in results} <= {200, 429}
    # A bucket of 640 refilled at 10.7 a second: all of it at once, then the refill since
    # (less what the replicas may still hold ahead when the storm ends).
    most = STORM_PER_MINUTE + int(elapsed * STORM_PER_MINUTE / 60) + 1
    assert STORM_PER_MINUTE - 2 * MAX_SPARE <= admitted <= most, (admitted, most, elapsed)
