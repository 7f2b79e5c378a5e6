"""Rate limits of teams and keys against real gateway processes, a real redis-server and a
real HTTP upstream that counts what reaches it:

- 60 requests/min and 10k tokens/min per team hold to within one request across two
  replicas on one redis-server under 64-way concurrency (requests bind with a short
  prompt, tokens with a long one); refusals are 429 `rate_limit_exceeded` with OpenAI's
  headers, answers carry x-ratelimit-* too;
- the openai SDK backs off on those headers by itself and completes every call;
- `max_in_flight` caps concurrent calls and frees a slot when a call ends;
- a key's own limits apply on top of its team's;
- every mode is admitted against them (chat streamed or not, Responses, embeddings);
- a slot held by a replica that was SIGKILLed is free again within the lease;
- a server-side turn waits for its rate limit (up to `defaults.rate_limit_wait_s`), then
  the run stops, interrupted with reason `rate_limited`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from gateway.tokens import get_counter
from tests.server.test_admission import (  # noqa: F401  (session, upstream: the fixtures of the admission tests)
    TASK,
    Hanging,
    Upstream,
    chat,
    serving,
    session,
    two_replicas,
    upstream,
    write_policies,
)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.shared_store import SHARED_KINDS, shared_store
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway

LIMITED, QUICK, NARROW, KEYED, WAITS, STOPS = "sk-lim", "sk-quick", "sk-narrow", "sk-keyed", "sk-waits", "sk-stops"
ONCE, PLAIN, TOKENS, SMALL = "sk-once", "sk-plain", "sk-tokens", "sk-small"
COMPLETION = 10
"""Completion tokens the counting upstream bills per call."""


def write_config(folder: Path, port: int, upstream_url: str, store: dict[str, Any], lease_ttl_s: float = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    team = {"budget_usd": None, "policies": ["passthrough", "files"]}
    config = {
        "server": {"host": "127.0.0.1", "port": port, "lease_ttl_s": lease_ttl_s},
        "store": store,
        "policies_dir": str(write_policies(folder.parent)),
        "upstreams": [{"name": "counting", "base_url": upstream_url}, {"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "scripted-*", "upstream": "scripted"},
                   {"match": "*", "upstream": "counting", "price_in": 2.0, "price_out": 12.0}],
        "defaults": {"rate_limit_wait_s": 10},
        "teams": [
            {"name": "limited", "keys": [LIMITED], **team,
             "rate_limits": {"requests_per_minute": 60, "tokens_per_minute": 10_000}},
            {"name": "tokens", "keys": [TOKENS], **team,  # the same limits, for the tokens test
             "rate_limits": {"requests_per_minute": 60, "tokens_per_minute": 10_000}},
            {"name": "quick", "keys": [QUICK], **team, "rate_limits": {"requests_per_second": 3}},
            {"name": "keyed", "keys": [PLAIN, {"key": KEYED, "rate_limits": {"requests_per_minute": 2}}], **team,
             "rate_limits": {"requests_per_minute": 3}},
            {"name": "narrow", "keys": [NARROW], **team, "rate_limits": {"max_in_flight": 2}},
            {"name": "waits", "keys": [WAITS], **team, "rate_limits": {"requests_per_second": 1}},
            {"name": "stops", "keys": [STOPS], **team, "rate_limits": {"requests_per_minute": 1}},
            {"name": "once", "keys": [ONCE], **team, "rate_limits": {"requests_per_minute": 1}},
            {"name": "small", "keys": [SMALL], **team, "rate_limits": {"tokens_per_minute": 50}},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(folder: Path, upstream_url: str, store: dict[str, Any], lease_ttl_s: float = 5) -> Proc:
    port = free_port()
    config = write_config(folder, port, upstream_url, store, lease_ttl_s)
    return start_gateway(["serve", "--config", str(config)], "/healthz", port, folder / "gateway.log",
                         timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module", params=SHARED_KINDS)
def replicas(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
             upstream: Upstream) -> Iterator[tuple[Proc, Proc]]:
    """Two replicas on one redis-server (or one PostgreSQL), shared by the module's tests (each its own team)."""
    store = shared_store(request.param, request, "rl")
    with two_replicas(start, tmp_path_factory.mktemp("pair"), upstream.url, store) as procs:
        yield procs


@pytest.fixture
def pair(replicas: tuple[Proc, Proc], upstream: Upstream) -> tuple[Proc, Proc]:
    """The module's two replicas, with the upstream's counts started over: a test runs once per
    store kind, and reads the counts of its own model."""
    upstream.calls.clear()
    return replicas


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[Proc]:
    """One gateway on SQLite, shared by the module's tests (each its own team and model)."""
    proc = start(tmp_path_factory.mktemp("single") / "one", upstream.url, {"kind": "sqlite", "path": "./gateway.db"})
    yield proc
    proc.stop()


async def storm(session: aiohttp.ClientSession, pair: tuple[Proc, Proc], body: dict[str, Any],
                rounds: int = 2, key: str = LIMITED) -> tuple[list[tuple[int, dict[str, str], Any]], float]:
    """`rounds` waves of 64 concurrent calls, split over both replicas; the results and the
    seconds the whole storm took (an upper bound on how long the window refilled)."""
    started = time.monotonic()
    results: list[tuple[int, dict[str, str], Any]] = []
    for _ in range(rounds):
        results += await asyncio.gather(*(chat(session, pair[i % 2], key, body) for i in range(64)))
    return results, time.monotonic() - started


def lower(headers: dict[str, str]) -> dict[str, str]:
    """Header names as HTTP means them: without case (aiohttp writes Retry-After its own way)."""
    return {name.lower(): value for name, value in headers.items()}


async def test_requests_per_minute_hold_within_one_across_two_replicas(
        pair: tuple[Proc, Proc], upstream: Upstream, session: aiohttp.ClientSession) -> None:
    results, elapsed = await storm(session, pair, {"model": "rpm", "messages": TASK})
    admitted = upstream.calls["rpm"]
    assert sum(status == 200 for status, _, _ in results) == admitted
    # A bucket of 60 refilled at one a second: 60 at once, then at most one per second since.
    assert 60 <= admitted <= 60 + int(elapsed) + 1, (admitted, elapsed)
    refused = [(headers, reply) for status, headers, reply in results if status == 429]
    assert len(refused) == len(results) - admitted
    headers, reply = lower(refused[-1][0]), refused[-1][1]
    assert reply["error"]["code"] == "rate_limit_exceeded" and reply["error"]["type"] == "requests"
    assert headers["x-should-retry"] == "true", headers
    assert 1 <= int(headers["retry-after"]) <= 2 and 0 < int(headers["retry-after-ms"]) <= 1001
    assert headers["x-ratelimit-limit-requests"] == "60" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "10000"
    assert headers["x-ratelimit-reset-requests"].endswith("s")  # e.g. "59.021s"
    ok = next(headers for status, headers, _ in results if status == 200)
    assert ok["x-ratelimit-limit-requests"] == "60" and int(ok["x-ratelimit-remaining-requests"]) < 60


async def test_tokens_per_minute_hold_within_one_across_two_replicas(
        pair: tuple[Proc, Proc], upstream: Upstream, session: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "Summarise this: " + "lorem ipsum dolor sit amet " * 80}]
    prompt = get_counter().count_request(messages)
    assert 300 < prompt < 1000
    results, elapsed = await storm(session, pair, {"model": "tpm", "messages": messages}, key=TOKENS)
    admitted = upstream.calls["tpm"]
    # Each call counts its prompt before it runs, and its completion when it is booked.
    most = (10_000 + 10_000 / 60 * elapsed) // prompt + 1
    assert 10_000 // (prompt + COMPLETION) <= admitted <= most, (admitted, prompt, elapsed)
    refused = [reply for status, _, reply in results if status == 429]
    assert refused and {r["error"]["type"] for r in refused} == {"tokens"}


async def test_the_openai_sdk_backs_off_and_completes_every_call(single: Proc, upstream: Upstream) -> None:
    statuses: list[int] = []

    async def seen(response: Any) -> None:
        statuses.append(response.status_code)

    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]})
    client = openai.AsyncOpenAI(base_url=single.url + "/v1", api_key=QUICK, max_retries=30, http_client=http)
    try:
        replies = await asyncio.gather(*(client.chat.completions.create(model="sdk", messages=TASK)  # type: ignore[arg-type]
                                         for _ in range(9)))
    finally:
        await client.close()
    assert [r.choices[0].message.content for r in replies] == ["ok"] * 9
    assert upstream.calls["sdk"] == 9
    assert statuses.count(200) == 9 and statuses.count(429) > 0  # it was refused, waited as told, and got through


async def test_calls_in_flight_are_capped_and_a_slot_frees_when_a_call_ends(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    upstream.delay_s["slow"] = 1.5
    results = await asyncio.gather(*(chat(session, single, NARROW, {"model": "slow", "messages": TASK})
                                     for _ in range(6)))
    assert sorted(status for status, _, _ in results) == [200, 200, 429, 429, 429, 429]
    refused = next(reply for status, _, reply in results if status == 429)
    assert refused["error"]["type"] == "in_flight" and "max_in_flight" in refused["error"]["message"]
    status, _, _ = await chat(session, single, NARROW, {"model": "fast", "messages": TASK})
    assert status == 200  # both slots came back when their calls ended


async def test_a_prompt_larger_than_a_whole_window_is_refused_for_good(
        single: Proc, upstream: Upstream, session: aiohttp.ClientSession) -> None:
    long = [{"role": "user", "content": "lorem ipsum " * 40}]
    prompt = get_counter().count_request(long)
    assert prompt > 50
    status, headers, reply = await chat(session, single, SMALL, {"model": "small", "messages": long})
    assert status == 429 and reply["error"]["code"] == "rate_limit_exceeded" and reply["error"]["type"] == "tokens"
    assert lower(headers)["x-should-retry"] == "false" and "retry-after" not in lower(headers)
    assert f"it counts {prompt} tokens" in reply["error"]["message"], reply
    assert "whole limit of 50 tokens per minute" in reply["error"]["message"], reply
    assert upstream.calls["small"] == 0
    # A prompt that fits is admitted: the refusal spent nothing of the window.
    status, _, reply = await chat(session, single, SMALL, {"model": "small", "messages": TASK})
    assert status == 200, reply


async def test_a_key_is_held_to_its_own_limits_and_its_teams(single: Proc, upstream: Upstream,
                                                             session: aiohttp.ClientSession) -> None:
    body = {"model": "keyed", "messages": TASK}
    first = [await chat(session, single, KEYED, body) for _ in range(3)]
    assert [status for status, _, _ in first] == [200, 200, 429]
    assert first[2][2]["error"]["message"].startswith("rate limit reached: this API key")
    assert first[1][1]["x-ratelimit-limit-requests"] == "2"  # the tighter scope is shown
    # The team's other key still has the team's 3 a minute, less the two the key spent.
    team = [await chat(session, single, PLAIN, body) for _ in range(2)]
    assert [status for status, _, _ in team] == [200, 429]


async def test_a_server_side_turn_waits_for_its_rate_limit(single: Proc, upstream: Upstream,
                                                           session: aiohttp.ClientSession) -> None:
    body = {"model": "side", "messages": TASK}
    results = await asyncio.gather(*(chat(session, single, WAITS, body, {"X-Policy": "files"}) for _ in range(3)))
    assert [status for status, _, _ in results] == [200, 200, 200], results
    assert all(reply["run"]["status"] == "completed" for _, _, reply in results)
    assert upstream.calls["side"] == 3


async def test_a_server_side_run_stops_when_the_wait_would_pass_its_bound(single: Proc, upstream: Upstream,
                                                                         session: aiohttp.ClientSession) -> None:
    body = {"model": "stop", "messages": TASK}
    status, _, reply = await chat(session, single, STOPS, body, {"X-Policy": "files"})
    assert status == 200 and reply["run"]["status"] == "completed"
    status, _, reply = await chat(session, single, STOPS, body, {"X-Policy": "files"})  # next: in a minute > 10 s
    run = reply["run"]
    assert (run["status"], run["reason"]) == ("interrupted", "rate_limited"), reply
    assert upstream.calls["stop"] == 1


async def test_every_mode_counts_against_the_limits(single: Proc, upstream: Upstream,
                                                    session: aiohttp.ClientSession) -> None:
    auth = {"Authorization": f"Bearer {ONCE}"}
    async with session.post(f"{single.url}/v1/chat/completions", headers=auth,
                            json={"model": "scripted-plan", "messages": TASK, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"
        assert b"data: [DONE]" in await resp.read()
    for path, body in (("/v1/chat/completions", {"model": "modes", "messages": TASK, "stream": True}),
                       ("/v1/responses", {"model": "modes", "input": "Say ok."}),
                       ("/v1/embeddings", {"model": "modes", "input": "ok"})):
        async with session.post(single.url + path, headers=auth, json=body) as resp:
            reply = await resp.json()
            assert resp.status == 429 and reply["error"]["code"] == "rate_limit_exceeded", (path, reply)
    assert upstream.calls["modes"] == 0


KILLED_LEASE_S = 2
"""server.lease_ttl_s of the killed-replica test: how long a dead replica's slots may last."""


async def test_a_slot_held_by_a_killed_replica_is_free_within_its_lease(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    hanging = Hanging(wanted=2)
    async with serving(hanging.handle) as url:
        store = {"kind": "sqlite", "path": str(tmp_path / "gateway.db")}
        starter = functools.partial(start, lease_ttl_s=KILLED_LEASE_S)
        with two_replicas(starter, tmp_path, url, store) as (first, second):
            flying = [asyncio.ensure_future(chat(session, first, NARROW, {"model": "hang", "messages": TASK}))
                      for _ in range(2)]
            await asyncio.wait_for(hanging.arrived.wait(), 30)
            status, _, reply = await chat(session, second, NARROW, {"model": "ok", "messages": TASK})
            assert status == 429 and reply["error"]["type"] == "in_flight"  # both slots are held by `first`
            first.kill()
            for task in flying:
                task.cancel()
            await asyncio.gather(*flying, return_exceptions=True)
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            while (await chat(session, second, NARROW, {"model": "ok", "messages": TASK}))[0] != 200:
                assert loop.time() - killed_at < KILLED_LEASE_S + 5, "the dead replica's slots outlived its lease"
                await asyncio.sleep(0.2)  # polling, as a client retrying would
