"""Upstreams that survive failures, against a real gateway process.

One gateway (shared by the module's tests) routes each test's model to two deployments of
the scripted provider: `good` always answers, `bad` fails in one way (500, 429 with
retry-after, a connection reset, a first byte that does not come within its
`first_byte_timeout_s`) for its first calls and then heals. Every call succeeds through
`good`; `bad` is cooled down after its failure and probed back (a probe fails and cools it
again; the probe after it healed answers). A stream that failed after its first chunk is not
retried and ends with an error event. Pass-through chat, Responses and server-side model
turns all go through the same routed call; every attempt is an `upstream_attempt` trace line
and a metric observation.

Each test has upstreams of its own names (`good-500`, `bad-500`, ...), so its breakers,
metrics and call counts are its own. The failing providers are served over HTTP by a thread
of the test process (each a `scripted_app` with its own failure mode and call count); the
429 one is a `gateway scripted --fail 429 --fail-calls 2 --retry-after 1` process, so the
command's failure flags are exercised too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.harness.usage import Price, Usage
from gateway.providers.scripted import FailCalls, FailMode, scripted_app
from tests.server.test_admission import write_policies
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import in_thread

KEY = "sk-failover"
GOOD_PRICE = Price(1.0, 2.0)
BAD_PRICE = Price(4.0, 8.0)
COOLDOWN_S = 0.5
BAD_FAILURES = 2
"""Calls `bad` fails before it heals: the first trips its breaker, the second is a failed probe."""
TASK = [{"role": "user", "content": "Say ok."}]
DEADLINE_S = 2.5
"""The `timed` route's deadline: 11 attempts of a 1 s first-byte timeout would take 11 s."""

FAILURES: dict[str, tuple[FailMode, str]] = {
    "500": ("500", "server_error"),
    "429": ("429", "rate_limited"),
    "reset": ("reset", "unreachable"),
    "slow_first_byte": ("hang", "timeout"),
}
"""The probed-back test's cases: the bad deployment's failure mode, and its attempts' outcome."""
IN_THREAD: dict[str, tuple[FailMode, FailCalls | None]] = {
    **{case: (mode, FailCalls(BAD_FAILURES)) for case, (mode, _) in FAILURES.items() if case != "429"},
    "cut": ("cut-first", None),  # every call: a stream drops right after its first chunk
    "down": ("500", None),  # every call fails: only the fallback answers
    "hang": ("hang", None),  # every call: no first byte, until the route's deadline
}
"""The failing providers served by the test's thread: name -> (mode, the calls that fail)."""


def failing_apps() -> web.Application:
    """One scripted provider per failure, each at /<name>/v1 with its own call count."""
    root = web.Application()
    for name, (mode, calls) in IN_THREAD.items():
        root.add_subapp(f"/{name}/v1", scripted_app(fail=mode, fail_calls=calls))
    return root


def route(name: str, good: str, bad: str, *, bad_weight: int = 1,
          match: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The upstreams `good-<name>` and `bad-<name>` and a route for model `match` (default:
    `name`) over both, asking each for scripted-plan."""
    # A first byte later than a second is a failure; the scripted `hang` never sends one.
    upstreams: list[dict[str, Any]] = [{"name": f"good-{name}", "base_url": good + "/v1"},
                                       {"name": f"bad-{name}", "base_url": bad, "first_byte_timeout_s": 1}]
    deployments = [
        {"upstream": f"good-{name}", "model": "scripted-plan", "weight": 1,
         "price_in": GOOD_PRICE.input_per_million, "price_out": GOOD_PRICE.output_per_million},
        {"upstream": f"bad-{name}", "model": "scripted-plan", "weight": bad_weight,
         "price_in": BAD_PRICE.input_per_million, "price_out": BAD_PRICE.output_per_million},
    ]
    return upstreams, {"match": match or name, "retries": 2, "cooldown_after": 1, "cooldown_s": COOLDOWN_S,
                       "deployments": deployments}


def write_config(folder: Path, port: int, good: str, failing: str, cli_429: str) -> Path:
    policies = write_policies(folder)
    upstreams: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    for case in FAILURES:
        bad = cli_429 + "/v1" if case == "429" else f"{failing}/{case}/v1"
        ups, model = route(case, good, bad)
        upstreams += ups
        models.append(model)
    for ups, model in (route("cut", good, f"{failing}/cut/v1", bad_weight=1000),  # every call goes to bad first
                       route("fallback", good, f"{failing}/down/v1", match="scripted-*")):
        upstreams += ups
        models.append(model)
    upstreams.append({"name": "bad-timed", "base_url": f"{failing}/hang/v1", "first_byte_timeout_s": 1})
    models += [
        # Only the failing deployment, then a fallback model routed above.
        {"match": "lonely", "retries": 2, "deployments": [{"upstream": "bad-fallback", "model": "scripted-plan"}],
         "fallbacks": ["scripted-plan"], "price_in": 9.0, "price_out": 9.0},
        # Only the failing deployment, many retries, and a total deadline that ends them first.
        {"match": "timed", "retries": 10, "deadline_s": DEADLINE_S,
         "deployments": [{"upstream": "bad-timed", "model": "scripted-plan"}]},
    ]
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": str(policies),
        "upstreams": upstreams,
        "models": models,
        "teams": [{"name": "fo", "keys": [KEY], "budget_usd": 10.0, "budget_period": "total",
                   "policies": ["passthrough", "files"]}],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Routes:
    """The gateway in front of the deployments."""

    gateway: Proc

    @property
    def url(self) -> str:
        return self.gateway.url


def good_app() -> web.Application:
    """The good provider: the scripted app at /v1."""
    root = web.Application()
    root.add_subapp("/v1", scripted_app())
    return root


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routes]:
    folder = tmp_path_factory.mktemp("failover")
    cli_port, port = free_port(), free_port()
    with in_thread(good_app) as good, in_thread(failing_apps) as failing:
        config = write_config(folder, port, good, failing, f"http://127.0.0.1:{cli_port}")
        with ThreadPoolExecutor(2) as pool:  # the two processes start at once
            futures = [pool.submit(start_gateway, ["scripted", "--port", str(cli_port), "--fail", "429",
                                                   "--fail-calls", str(BAD_FAILURES), "--retry-after", "1"],
                                   "/healthz", cli_port, folder / "bad-429.log", timeout=START_TIMEOUT_S),
                       pool.submit(start_gateway, ["serve", "--config", str(config)], "/healthz", port,
                                   folder / "gateway.log", timeout=START_TIMEOUT_S)]
        started = [f.result() for f in futures if f.exception() is None]
        try:
            for f in futures:
                f.result()  # one failed to start: the reason
            yield Routes(started[1])
        finally:
            for proc in started:
                proc.stop()


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


@pytest.mark.parametrize("case", sorted(FAILURES))
async def test_every_call_succeeds_through_the_other_deployment_and_the_failing_one_is_probed_back(
        routes: Routes, case: str, session: aiohttp.ClientSession) -> None:
    outcome = FAILURES[case][1]
    url = routes.url
    good, bad_name = f"good-{case}", f"bad-{case}"
    seen: list[dict[str, Any]] = []
    cost_of: dict[str, float] = {}

    async def one_call(stream: bool) -> None:
        run_id = f"fo-{uuid.uuid4().hex[:10]}"
        body: dict[str, Any] = {"model": case, "messages": TASK}
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
    while not any(a["upstream"] == bad_name and a["outcome"] == "ok" for a in seen):
        assert asyncio.get_running_loop().time() < deadline, seen
        await one_call(stream)
        stream = not stream  # streamed and plain calls alike are retried before their first byte
    assert {a["upstream"] for a in seen} <= {good, bad_name}, seen
    bad = [a for a in seen if a["upstream"] == bad_name]
    assert [a["outcome"] for a in bad] == [outcome] * BAD_FAILURES + ["ok"], bad
    # Cooled after its first failure: every later call to it was a probe, until one answered.
    assert [a["probe"] for a in bad] == [False] + [True] * BAD_FAILURES, bad
    assert any(a["upstream"] == good for a in seen)
    assert await metric(session, url, bad_name, outcome) == BAD_FAILURES
    assert await metric(session, url, bad_name, "ok") == 1
    assert await metric(session, url, good, "ok") == sum(1 for a in seen if a["upstream"] == good)
    # Each run was charged once, at the price of the deployment that answered it.
    assert cost_of[bad_name] == pytest.approx(4 * cost_of[good]), cost_of  # the same tokens at 4x the prices


async def test_a_stream_cut_after_its_first_chunk_is_not_retried_and_ends_with_an_error_event(
        routes: Routes, session: aiohttp.ClientSession) -> None:
    url = routes.url
    status, raw = await post(session, f"{url}/v1/chat/completions",
                             {"model": "cut", "messages": TASK, "stream": True}, **{"X-Run-Id": "cut-once"})
    assert status == 200
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert b"[DONE]" not in raw
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_cut", last
    assert len([e for e in events if b'"choices"' in e]) == 1  # the one chunk, never a retry's
    attempts = attempts_of(await trace(session, url, "cut-once"))
    assert [(a["upstream"], a["outcome"]) for a in attempts] == [("bad-cut", "cut")]
    async with session.get(f"{url}/v1/runs/cut-once", headers=auth()) as resp:
        run = await resp.json()
    assert run["turns"] == 1 and run["cost_usd"] > 0  # what the cut attempt produced is charged, once
    assert await metric(session, url, "good-cut", "ok") == 0


async def test_fallback_model_answers_when_every_deployment_failed_in_both_modes(
        routes: Routes, session: aiohttp.ClientSession) -> None:
    url = routes.url  # bad-fallback always fails
    # Pass-through chat: `lonely` has only the failing deployment, then falls back to scripted-plan.
    status, answer = await post(session, f"{url}/v1/chat/completions", {"model": "lonely", "messages": TASK},
                                **{"X-Run-Id": "fb-chat"})
    assert status == 200, answer
    attempts = attempts_of(await trace(session, url, "fb-chat"))
    assert attempts[0]["upstream"] == "bad-fallback" and attempts[0]["outcome"] == "server_error"
    assert attempts[-1]["outcome"] == "ok" and attempts[-1]["fallback"] is True
    assert attempts[-1]["model"] == "scripted-plan"
    async with session.get(f"{url}/v1/runs/fb-chat", headers=auth()) as resp:
        run = await resp.json()
    usage = Usage(run["usage"]["prompt_tokens"], run["usage"]["completion_tokens"])
    if attempts[-1]["upstream"] == "good-fallback":
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
    assert attempts[0]["upstream"] == "bad-fallback" and attempts[0]["outcome"] == "server_error"
    assert all(a["fallback"] for a in attempts if a["outcome"] == "ok")
    # Each upstream_attempt line comes before the turn it produced.
    kinds = [e["type"] for e in events if e["type"] in ("upstream_attempt", "turn")]
    assert kinds[-1] == "turn" and kinds[0] == "upstream_attempt"


async def test_the_routes_deadline_ends_its_retries(routes: Routes, session: aiohttp.ClientSession) -> None:
    url = routes.url
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
