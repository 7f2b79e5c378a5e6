"""Upstreams that survive failures, against real processes.

Two `gateway scripted` processes serve one model as two deployments of one gateway route:
`good` always answers, `bad` fails in one way (500, 429 with retry-after, a connection
reset, a first byte that does not come within its `first_byte_timeout_s`) for its first
calls and then heals. Every call succeeds through `good`; `bad` is cooled down after its
failure and probed back (a probe fails and cools it again; the probe after it healed
answers). A stream that failed after its first chunk is not retried and ends with an error
event. Pass-through chat, Responses and server-side model turns all go through the same
routed call; every attempt is an `upstream_attempt` trace line and a metric observation.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.harness.usage import Price, Usage
from tests.server.test_admission import write_policies
from tests.support.procs import Proc, free_port, start_gateway

KEY = "sk-failover"
GOOD_PRICE = Price(1.0, 2.0)
BAD_PRICE = Price(4.0, 8.0)
COOLDOWN_S = 0.5
BAD_FAILURES = 2
"""Calls `bad` fails before it heals: the first trips its breaker, the second is a failed probe."""
TASK = [{"role": "user", "content": "Say ok."}]
DEADLINE_S = 2.5
"""The `timed` route's deadline: 11 attempts of a 1 s first-byte timeout would take 11 s."""


def scripted(folder: Path, name: str, *flags: str) -> Proc:
    port = free_port()
    return start_gateway(["scripted", "--port", str(port), *flags], "/healthz", port, folder / f"{name}.log")


def write_config(folder: Path, port: int, good: str, bad: str, *, bad_weight: int = 1) -> Path:
    policies = write_policies(folder)
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": str(policies),
        "upstreams": [
            {"name": "good", "base_url": good + "/v1"},
            # A first byte later than a second is a failure; the scripted `hang` never sends one.
            {"name": "bad", "base_url": bad + "/v1", "first_byte_timeout_s": 1},
        ],
        "models": [
            {"match": "scripted-*", "retries": 2, "cooldown_after": 1, "cooldown_s": COOLDOWN_S,
             "deployments": [
                 {"upstream": "good", "weight": 1, "price_in": GOOD_PRICE.input_per_million,
                  "price_out": GOOD_PRICE.output_per_million},
                 {"upstream": "bad", "weight": bad_weight, "price_in": BAD_PRICE.input_per_million,
                  "price_out": BAD_PRICE.output_per_million},
             ]},
            # Only the failing deployment, then a fallback model routed above.
            {"match": "lonely", "retries": 2, "deployments": [{"upstream": "bad", "model": "scripted-plan"}],
             "fallbacks": ["scripted-plan"], "price_in": 9.0, "price_out": 9.0},
            # Only the failing deployment, many retries, and a total deadline that ends them first.
            {"match": "timed", "retries": 10, "deadline_s": DEADLINE_S,
             "deployments": [{"upstream": "bad", "model": "scripted-plan"}]},
        ],
        "teams": [{"name": "fo", "keys": [KEY], "budget_usd": 10.0, "budget_period": "total",
                   "policies": ["passthrough", "files"]}],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Route:
    """A gateway in front of the two deployments."""

    gateway: Proc
    good: Proc
    bad: Proc

    def stop(self) -> None:
        for proc in (self.gateway, self.good, self.bad):
            proc.stop()


def start_route(folder: Path, *bad_flags: str, bad_weight: int = 1) -> Route:
    folder.mkdir(parents=True, exist_ok=True)
    good = scripted(folder, "good")
    bad = scripted(folder, "bad", *bad_flags)
    port = free_port()
    config = write_config(folder, port, good.url, bad.url, bad_weight=bad_weight)
    gateway = start_gateway(["serve", "--config", str(config)], "/healthz", port, folder / "gateway.log")
    return Route(gateway, good, bad)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def auth(**headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **headers}


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with session.post(url, data=orjson.dumps(body), headers=auth(**headers)) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if resp.content_type == "application/json" else raw


async def trace(session: aiohttp.ClientSession, url: str, run_id: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/v1/runs/{run_id}/events", headers=auth()) as resp:
        assert resp.status == 200, await resp.text()
        return [orjson.loads(line) for line in (await resp.text()).splitlines()]


def attempts_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "upstream_attempt"]


async def metric(session: aiohttp.ClientSession, url: str, upstream: str, outcome: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    prefix = f'gateway_upstream_attempts_total{{outcome="{outcome}",upstream="{upstream}"}} '
    found = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(found[0].split()[-1]) if found else 0.0


FAILURES = {
    "500": (("--fail", "500"), "server_error"),
    "429": (("--fail", "429", "--retry-after", "1"), "rate_limited"),
    "reset": (("--fail", "reset"), "unreachable"),
    "slow_first_byte": (("--fail", "hang"), "timeout"),
}


@pytest.fixture(params=sorted(FAILURES))
def failing(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Route, str]]:
    flags, outcome = FAILURES[request.param]
    route = start_route(tmp_path, *flags, "--fail-calls", str(BAD_FAILURES))
    yield route, outcome
    route.stop()


async def test_every_call_succeeds_through_the_other_deployment_and_the_failing_one_is_probed_back(
        failing: tuple[Route, str], session: aiohttp.ClientSession) -> None:
    route, outcome = failing
    url = route.gateway.url
    seen: list[dict[str, Any]] = []
    cost_of: dict[str, float] = {}

    async def one_call(stream: bool) -> None:
        run_id = f"fo-{uuid.uuid4().hex[:10]}"
        body: dict[str, Any] = {"model": "scripted-plan", "messages": TASK}
        if stream:
            body.update(stream=True)
        status, answer = await post(session, f"{url}/v1/chat/completions", body, **{"X-Run-Id": run_id})
        assert status == 200, answer
        if stream:
            assert answer.rstrip().endswith(b"data: [DONE]"), answer
        attempts = attempts_of(await trace(session, url, run_id))
        assert attempts and attempts[-1]["outcome"] == "ok", attempts
        assert all(a["outcome"] == outcome for a in attempts[:-1]), attempts
        seen.extend(attempts)
        async with session.get(f"{url}/v1/runs/{run_id}", headers=auth()) as resp:
            cost_of[attempts[-1]["upstream"]] = (await resp.json())["cost_usd"]

    deadline = asyncio.get_running_loop().time() + 60
    stream = False
    while not any(a["upstream"] == "bad" and a["outcome"] == "ok" for a in seen):
        assert asyncio.get_running_loop().time() < deadline, seen
        await one_call(stream)
        stream = not stream  # streamed and plain calls alike are retried before their first byte
    bad = [a for a in seen if a["upstream"] == "bad"]
    assert [a["outcome"] for a in bad] == [outcome] * BAD_FAILURES + ["ok"], bad
    # Cooled after its first failure: every later call to it was a probe, until one answered.
    assert [a["probe"] for a in bad] == [False] + [True] * BAD_FAILURES, bad
    assert any(a["upstream"] == "good" for a in seen)
    assert await metric(session, url, "bad", outcome) == BAD_FAILURES
    assert await metric(session, url, "bad", "ok") == 1
    assert await metric(session, url, "good", "ok") == sum(1 for a in seen if a["upstream"] == "good")
    # Each run was charged once, at the price of the deployment that answered it.
    assert cost_of["bad"] == pytest.approx(4 * cost_of["good"]), cost_of  # the same tokens at 4x the prices


async def test_a_stream_cut_after_its_first_chunk_is_not_retried_and_ends_with_an_error_event(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    route = start_route(tmp_path, "--fail", "cut-first", bad_weight=1000)  # every call goes to bad first
    try:
        url = route.gateway.url
        status, raw = await post(session, f"{url}/v1/chat/completions",
                                 {"model": "scripted-plan", "messages": TASK, "stream": True},
                                 **{"X-Run-Id": "cut-once"})
        assert status == 200
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert b"[DONE]" not in raw
        last = orjson.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "upstream_cut", last
        assert len([e for e in events if b'"choices"' in e]) == 1  # the one chunk, never a retry's
        attempts = attempts_of(await trace(session, url, "cut-once"))
        assert [(a["upstream"], a["outcome"]) for a in attempts] == [("bad", "cut")]
        async with session.get(f"{url}/v1/runs/cut-once", headers=auth()) as resp:
            run = await resp.json()
        assert run["turns"] == 1 and run["cost_usd"] > 0  # what the cut attempt produced is charged, once
        assert await metric(session, url, "good", "ok") == 0
    finally:
        route.stop()


async def test_fallback_model_answers_when_every_deployment_failed_in_both_modes(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    route = start_route(tmp_path, "--fail", "500")  # bad always fails
    try:
        url = route.gateway.url
        # Pass-through chat: `lonely` has only the failing deployment, then falls back to scripted-plan.
        status, answer = await post(session, f"{url}/v1/chat/completions", {"model": "lonely", "messages": TASK},
                                    **{"X-Run-Id": "fb-chat"})
        assert status == 200, answer
        attempts = attempts_of(await trace(session, url, "fb-chat"))
        assert attempts[0]["upstream"] == "bad" and attempts[0]["outcome"] == "server_error"
        assert attempts[-1]["outcome"] == "ok" and attempts[-1]["fallback"] is True
        assert attempts[-1]["model"] == "scripted-plan"
        async with session.get(f"{url}/v1/runs/fb-chat", headers=auth()) as resp:
            run = await resp.json()
        usage = Usage(run["usage"]["prompt_tokens"], run["usage"]["completion_tokens"])
        if attempts[-1]["upstream"] == "good":
            assert run["cost_usd"] == pytest.approx(GOOD_PRICE.cost(usage))
        # Responses pass-through goes through the same routed call.
        status, answer = await post(session, f"{url}/v1/responses", {"model": "lonely", "input": "Say ok."},
                                    **{"X-Run-Id": "fb-responses"})
        assert status == 200, answer
        assert attempts_of(await trace(session, url, "fb-responses"))[-1]["outcome"] == "ok"
        # A server-side run (tools run by the gateway): every model turn is routed the same way,
        # `lonely`'s failing deployment first, then the fallback.
        status, answer = await post(session, f"{url}/v1/chat/completions",
                                    {"model": "lonely", "messages": [
                                        {"role": "user", "content": "Which file mentions a timeout?"}]},
                                    **{"X-Run-Id": "fb-server", "X-Policy": "files"})
        assert status == 200, answer
        assert "timeout" in answer["choices"][0]["message"]["content"]
        events = await trace(session, url, "fb-server")
        turns = [e for e in events if e["type"] == "turn"]
        attempts = attempts_of(events)
        assert len(turns) >= 2 and len([a for a in attempts if a["outcome"] == "ok"]) == len(turns)
        assert attempts[0]["upstream"] == "bad" and attempts[0]["outcome"] == "server_error"
        assert all(a["fallback"] for a in attempts if a["outcome"] == "ok")
        # Each upstream_attempt line comes before the turn it produced.
        kinds = [e["type"] for e in events if e["type"] in ("upstream_attempt", "turn")]
        assert kinds[-1] == "turn" and kinds[0] == "upstream_attempt"
    finally:
        route.stop()


async def test_the_routes_deadline_ends_its_retries(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    route = start_route(tmp_path, "--fail", "hang")
    try:
        url = route.gateway.url
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, answer = await post(session, f"{url}/v1/chat/completions", {"model": "timed", "messages": TASK},
                                    **{"X-Run-Id": "deadline"})
        elapsed = loop.time() - started
        assert status == 504 and answer["error"]["code"] == "upstream_timeout", answer
        attempts = attempts_of(await trace(session, url, "deadline"))
        assert 2 <= len(attempts) < 11 and {a["outcome"] for a in attempts} == {"timeout"}, attempts
        assert elapsed < 11 * 1.0  # well under what the retries alone would take (seconds of margin)
        async with session.get(f"{url}/v1/runs/deadline", headers=auth()) as resp:
            run = await resp.json()
        assert run["turns"] == 0 and run["cost_usd"] == 0  # nothing answered: nothing charged
    finally:
        route.stop()
