"""A reload re-reads config.yaml, not only the policies: real `gateway serve --workers 2`
processes on SQLite, a real counting upstream, a real webhook receiver.

- a team added to config.yaml authenticates on both workers after `POST /v1/admin/reload`,
  and after a SIGHUP to the supervisor;
- a file with errors is refused whole (the answer lists every error): its new team gets
  401, the old config keeps serving;
- budgets, rate limits, routes and upstreams change live, on both workers;
- settings that cannot change live are named (`restart_required`) and keep their value;
  a built-in scripted mount the process never had is refused with the reason;
- a call in flight during a reload that removes its route finishes under the config it
  started with (answered, and booked at its old price);
- a webhook added by a reload gets the notices from then on;
- a team's model allow-list, user budget and console settings change live; the keys the
  store holds are seen through the new teams (refused while their team is gone); a config
  key's console session ends when a reload removes the key;
- a server-side run's drive takes a reload from its next turn (the turn in flight keeps the
  config it started with);
- an upstream with a session of its own (TLS) that a reload replaced keeps its session for
  the call in flight on it, and closes it once that call ended (its connection too).

Calls go on fresh connections, so the kernel spreads them over both workers.
"""

from __future__ import annotations

import asyncio
import copy
import json
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.server.served import TASK as PLAN_TASK
from tests.server.served import poll, request
from tests.server.test_admission import TASK, Upstream
from tests.server.test_admission import upstream  # noqa: F401  (a real counting upstream)
from tests.server.test_webhooks import SECRET, Receiver
from tests.server.test_webhooks import receiver  # noqa: F401  (a real webhook receiver)
from tests.server.test_workers import wait_serving, wait_until
from tests.support.certs import make_pki
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import chat_app, serving_app
from gateway.providers.scripted import scripted_app

ROOT_KEY, DEMO_KEY, NEW_KEY = "sk-reload-root", "sk-reload-demo", "sk-reload-new"
CALLS = 12
"""Calls on fresh connections per check: all on one worker of two has odds of 1 in 2**11."""


def base_config(port: int, upstream_url: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "budget_scan_s": 0.1, "webhook_poll_s": 0.05},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "upstreams": [{"name": "counting", "base_url": upstream_url}],
        "models": [{"match": "m-*", "upstream": "counting", "price_in": 1.0, "price_out": 1.0}],
        "teams": [
            {"name": "root", "keys": [ROOT_KEY], "admin": True, "policies": ["passthrough"]},
            {"name": "demo", "keys": [DEMO_KEY], "budget_usd": 10.0, "budget_period": "total",
             "policies": ["passthrough"]},
        ],
    }


class Gateway:
    """The module's 2-worker gateway, and its config file as the tests edit it."""

    def __init__(self, folder: Path, port: int, upstream_url: str, proc: Proc) -> None:
        self.folder, self.port, self.upstream_url, self.proc = folder, port, upstream_url, proc
        self.base = base_config(port, upstream_url)

    @property
    def url(self) -> str:
        return self.proc.url

    def write(self, change: Callable[[dict[str, Any]], object] = lambda data: None) -> None:
        """config.yaml as the base config changed by `change`."""
        data = copy.deepcopy(self.base)
        change(data)
        (self.folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("reload-config") / "gw"
    (folder / "policies").mkdir(parents=True)
    for name in ("passthrough.yaml", "files.yaml"):
        (folder / "policies" / name).write_text((ROOT / "policies" / name).read_text())
    port = free_port()
    gw = Gateway(folder, port, upstream.url, None)  # type: ignore[arg-type]
    gw.write()
    gw.proc = start_gateway(["serve", "--config", str(folder / "config.yaml"), "--workers", "2"], "/healthz", port,
                            folder / "gateway.log", env={"GW_TEST_HOOK_SECRET": SECRET}, timeout=START_TIMEOUT_S)
    try:
        wait_serving(gw.proc)
        yield gw
    finally:
        gw.proc.stop()


@pytest.fixture
async def gateway(shared: Gateway) -> AsyncIterator[Gateway]:
    """The module's gateway; afterwards its config.yaml is the base one again, reloaded."""
    yield shared
    shared.write()
    async with aiohttp.ClientSession() as s:
        status, _, body = await request(s, "POST", f"{shared.url}/v1/admin/reload", key=ROOT_KEY)
    assert status == 200, body


async def reload(gw: Gateway) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        status, _, body = await request(s, "POST", f"{gw.url}/v1/admin/reload", key=ROOT_KEY)
    return status, body


async def calls(gw: Gateway, key: str, model: str, n: int = CALLS,
                **extra: Any) -> list[tuple[int, dict[str, str], Any]]:
    """`n` chat calls one after the other, each on a connection of its own."""
    out = []
    for _ in range(n):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            out.append(await request(s, "POST", f"{gw.url}/v1/chat/completions", key=key,
                                     body={"model": model, "messages": TASK, **extra}))
    return out


def statuses(answers: list[tuple[int, dict[str, str], Any]]) -> list[int]:
    return [status for status, _, _ in answers]


def add_team(name: str, key: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["teams"].append({"name": name, "keys": [key], "policies": ["passthrough"], **fields})


async def reloads_recorded(gw: Gateway, after: int = 0) -> list[dict[str, Any]]:
    """The audit log's `config.reloaded` records after seq `after`."""
    async with aiohttp.ClientSession() as s:
        status, _, body = await request(s, "GET", f"{gw.url}/v1/admin/audit?action=config.reloaded&limit=1000"
                                        f"&after={after}", key=ROOT_KEY)
    assert status == 200, body
    return list(body["data"])


async def test_a_team_added_to_config_yaml_authenticates_on_both_workers_after_a_reload(gateway: Gateway) -> None:
    before = max([r["seq"] for r in await reloads_recorded(gateway)], default=0)
    assert statuses(await calls(gateway, NEW_KEY, "m-new", 2)) == [401, 401]
    gateway.write(add_team("beta", NEW_KEY))
    status, body = await reload(gateway)
    assert status == 200, body
    assert statuses(await calls(gateway, NEW_KEY, "m-new")) == [200] * CALLS
    assert body["config"] == {"changed": ["teams"], "restart_required": []}
    assert body["workers"] == {"count": 2, "reloaded": 2}

    # SIGHUP to the supervisor does the same on every worker
    gateway.write(lambda data: (add_team("beta", NEW_KEY)(data), add_team("gamma", "sk-reload-gamma")(data)))
    logged = gateway.proc.output().count("reloaded by SIGHUP")
    gateway.proc.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: gateway.proc.output().count("reloaded by SIGHUP") >= logged + 2, START_TIMEOUT_S)
    assert statuses(await calls(gateway, "sk-reload-gamma", "m-new")) == [200] * CALLS

    # each reload is in the audit log once, however many workers reloaded: the call's as its
    # caller's act, the signal's as the gateway's own
    await poll(lambda: reloads_recorded(gateway, before), timeout=30)
    status, body = await reload(gateway)  # every worker has reloaded again once this answers
    assert status == 200 and body["workers"] == {"count": 2, "reloaded": 2}, body
    recorded = await reloads_recorded(gateway, before)
    assert [(r["actor"]["team"], r["details"].get("by"), r["details"]["config"]) for r in recorded] == [
        ("root", None, ["teams"]), ("", "SIGHUP", ["teams"]), ("root", None, [])], recorded


async def test_a_bad_config_file_is_refused_whole_and_the_old_config_keeps_serving(gateway: Gateway) -> None:
    def broken(data: dict[str, Any]) -> None:
        add_team("delta", "sk-reload-delta")(data)
        data["teams"][1]["budget_usd"] = "ten"
        data["models"].append({"match": "x-*", "upstream": "nowhere"})

    gateway.write(broken)
    status, body = await reload(gateway)
    assert status == 400, body
    assert body["error"]["code"] == "invalid_config"
    fields = [e["field"] for e in body["errors"]]
    assert sorted(fields) == ["models[1].upstream", "teams[1].budget_usd"], body["errors"]  # every error of the file
    assert statuses(await calls(gateway, "sk-reload-delta", "m-x", 4)) == [401] * 4
    assert statuses(await calls(gateway, DEMO_KEY, "m-x", 4)) == [200] * 4
    assert "reload by team root refused, the previous config and policies kept" in gateway.proc.output()


async def test_budgets_rate_limits_routes_and_upstreams_change_live_on_both_workers(
        gateway: Gateway, upstream: Upstream) -> None:
    def changed(data: dict[str, Any]) -> None:
        data["teams"][1]["budget_usd"] = 0.0  # demo: nothing left to spend
        add_team("limited", "sk-reload-limited", rate_limits={"requests_per_minute": 3})(data)
        data["upstreams"].append({"name": "renamed", "base_url": gateway.upstream_url})
        data["models"].insert(0, {"match": "r-*", "deployments": [{"upstream": "renamed", "model": "r-upstream"}]})
        data["models"].insert(0, {"match": "named-new", "upstream": "renamed"})

    gateway.write(changed)
    status, body = await reload(gateway)
    assert status == 200, body
    refused = await calls(gateway, DEMO_KEY, "m-budget", 4)
    assert statuses(refused) == [429] * 4 and refused[0][2]["error"]["type"] == "team_budget_exceeded"
    limited = statuses(await calls(gateway, "sk-reload-limited", "m-limited", 6))
    assert limited == [200, 200, 200, 429, 429, 429]  # exact across both workers
    before = upstream.calls["r-upstream"]
    assert statuses(await calls(gateway, "sk-reload-limited", "r-any", 1)) == [429]  # still limited
    gateway.write(lambda data: (changed(data), data["teams"][2].pop("rate_limits")))
    assert (await reload(gateway))[0] == 200
    assert statuses(await calls(gateway, "sk-reload-limited", "r-any")) == [200] * CALLS
    assert upstream.calls["r-upstream"] == before + CALLS  # the new route, to the model its deployment names
    assert statuses(await calls(gateway, "sk-reload-limited", "named-new")) == [200] * CALLS
    async with aiohttp.ClientSession() as s:  # a model routed by name since the reload is a label on both workers
        async with s.get(f"{gateway.url}/metrics") as resp:
            metrics = await resp.text()
    turns = [line for line in metrics.splitlines() if line.startswith("gateway_turns_total{") and 'team="limited"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in turns if 'model="named-new"' in line) == CALLS, turns
    assert body["config"]["changed"] == ["upstreams", "models", "teams"]


async def test_settings_that_cannot_change_live_are_named_and_keep_their_value(gateway: Gateway) -> None:
    other = free_port()
    gateway.write(lambda data: (data["server"].update(port=other, max_body_bytes=1000),
                                data.update(access_log={"format": "logfmt"},
                                            telemetry={"otlp_endpoint": f"http://127.0.0.1:{free_port()}"}),
                                add_team("beta", NEW_KEY)(data)))
    status, body = await reload(gateway)
    assert status == 200, body
    long = [{"role": "user", "content": "x" * 5000}]
    assert statuses(await calls(gateway, NEW_KEY, "m-x", 2, messages=long)) == [200, 200]  # old port, old cap
    restart = ["server.port", "server.max_body_bytes", "telemetry.otlp_endpoint", "access_log.format"]
    assert body["config"] == {"changed": ["teams"], "restart_required": restart}
    assert f"take effect at the next start: {', '.join(restart)}" in gateway.proc.output()
    # the access log keeps its running format (JSON lines) for the calls after the reload
    logged = [line for line in gateway.proc.output().splitlines() if '"route":"/v1/chat/completions"' in line]
    assert logged and all(json.loads(line)["team"] for line in logged[-2:]), logged[-2:]

    gateway.write(lambda data: (data["upstreams"].append({"name": "own", "kind": "scripted"}),
                                add_team("beta", NEW_KEY)(data)))
    status, body = await reload(gateway)
    assert status == 400 and body["error"]["code"] == "invalid_config", body
    assert body["errors"][0]["field"] == "upstreams[1].kind" and "restart the gateway" in body["errors"][0]["problem"]


async def test_a_call_in_flight_finishes_under_the_config_it_started_with(gateway: Gateway,
                                                                          upstream: Upstream) -> None:
    gateway.write(lambda data: data["models"].insert(0, {"match": "held", "upstream": "counting",
                                                         "price_in": 1000.0, "price_out": 1000.0}))
    assert (await reload(gateway))[0] == 200
    upstream.held.add("held")
    try:
        async with aiohttp.ClientSession() as s:
            call = asyncio.ensure_future(request(s, "POST", f"{gateway.url}/v1/chat/completions", key=DEMO_KEY,
                                                 body={"model": "held", "messages": TASK},
                                                 headers={"X-Run-Id": "in-flight"}))
            await poll(lambda: _async(upstream.calls["held"] >= 1), timeout=30)
            gateway.write(lambda data: (data.update(upstreams=[{"name": "other", "base_url": gateway.upstream_url}]),
                                        data.update(models=[{"match": "m-*", "upstream": "other"}])))
            status, body = await reload(gateway)
            assert status == 200, body
            upstream.held.discard("held")
            status, headers, answer = await call
    finally:
        upstream.held.discard("held")
    assert status == 200, answer
    usage = answer["usage"]
    assert float(headers["X-Run-Cost-Usd"]) == pytest.approx(
        (usage["prompt_tokens"] + usage["completion_tokens"]) * 1000.0 / 1e6)  # its route's old price
    after = await calls(gateway, DEMO_KEY, "held", 2)
    assert statuses(after) == [404, 404] and after[0][2]["error"]["code"] == "model_not_found"


async def test_a_webhook_added_by_a_reload_gets_the_notices_from_then_on(gateway: Gateway,
                                                                         receiver: Receiver) -> None:
    hook = {"url": receiver.url, "secret_env": "GW_TEST_HOOK_SECRET", "events": ["budget_threshold"],
            "teams": ["spender"], "name": "added"}
    gateway.write(lambda data: (add_team("spender", "sk-reload-spender", budget_usd=1.0, budget_period="total")(data),
                                data["models"].insert(0, {"match": "pricey", "upstream": "counting",
                                                          "price_in": 40_000.0, "price_out": 40_000.0}),
                                data.update(webhooks=[hook])))
    status, body = await reload(gateway)
    assert status == 200, body
    # some 20 tokens at $0.04 each: past 80% of the team's $1
    assert statuses(await calls(gateway, "sk-reload-spender", "pricey", 1, max_tokens=10)) == [200]
    delivered = await poll(lambda: _async(receiver.delivered("budget_threshold")), timeout=30)
    assert delivered[0]["team"] == "spender" and all(a["signed"] for a in receiver.attempts)
    assert body["config"]["changed"] == ["models", "teams", "webhooks"]


async def sign_in(gw: Gateway, key: str) -> str:
    """The cookie of a new console session of `key`."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.post(f"{gw.url}/console/session", json={"key": key}) as resp:
            assert resp.status == 200, await resp.text()
            return resp.cookies["gateway_console"].value


async def console_status(gw: Gateway, cookie: str) -> int:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(),
                                     connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(f"{gw.url}/console/session", headers={"Cookie": f"gateway_console={cookie}"}) as resp:
            return resp.status


async def test_allow_lists_user_budgets_store_keys_and_console_settings_change_live(gateway: Gateway) -> None:
    def beta(**fields: Any) -> Callable[[dict[str, Any]], None]:
        return add_team("beta", NEW_KEY, **fields)

    gateway.write(beta(models=["m-a*"], user_budget_usd=0.0, user_budget_period="total"))
    assert (await reload(gateway))[0] == 200
    refused = await calls(gateway, NEW_KEY, "m-b", 4)
    assert statuses(refused) == [403] * 4 and refused[0][2]["error"]["code"] == "model_not_allowed"
    assert statuses(await calls(gateway, NEW_KEY, "m-a1", 4)) == [200] * 4
    broke = await calls(gateway, NEW_KEY, "m-a1", 4, user="ana")
    assert statuses(broke) == [429] * 4 and broke[0][2]["error"]["type"] == "user_budget_exceeded"
    async with aiohttp.ClientSession() as s:
        status, _, issued = await request(s, "POST", f"{gateway.url}/v1/admin/keys", key=ROOT_KEY,
                                          body={"team": "beta", "name": "reload-test"})
    assert status == 201, issued
    store_key = issued["key"]
    cookie = await sign_in(gateway, NEW_KEY)

    gateway.write(beta(models=["m-b*"], user_budget_usd=1.0, user_budget_period="total"))
    assert (await reload(gateway))[0] == 200
    assert statuses(await calls(gateway, NEW_KEY, "m-b1", 4, user="ana")) == [200] * 4
    assert statuses(await calls(gateway, store_key, "m-b1", 4)) == [200] * 4  # the store's key, the new team
    assert statuses(await calls(gateway, store_key, "m-a1", 4)) == [403] * 4

    gateway.write()  # beta gone: its config key, its store key and its console session with it
    assert (await reload(gateway))[0] == 200
    gone = await calls(gateway, store_key, "m-b1", 4)
    assert statuses(gone) == [401] * 4 and "no longer in the gateway's config" in gone[0][2]["error"]["message"]
    assert [await console_status(gateway, cookie) for _ in range(4)] == [401] * 4
    gateway.write(beta())
    assert (await reload(gateway))[0] == 200
    assert statuses(await calls(gateway, store_key, "m-b1", 4)) == [200] * 4  # back with its team

    gateway.write(lambda data: data.update(console={"session_idle_s": 1, "session_max_s": 1}))
    status, body = await reload(gateway)
    assert status == 200 and body["config"] == {"changed": ["teams", "console"], "restart_required": []}, body
    cookie = await sign_in(gateway, DEMO_KEY)
    await poll(lambda: _async_status(gateway, cookie, 401), timeout=15)  # past its 1 s, however used


async def _async_status(gw: Gateway, cookie: str, wanted: int) -> bool:
    return await console_status(gw, cookie) == wanted


async def test_a_server_side_drive_takes_a_reload_from_its_next_turn(gateway: Gateway) -> None:
    turns: list[int] = []  # the provider's chat calls; the second waits for `release`
    release = asyncio.Event()

    @web.middleware
    async def hold_second(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.endswith("/chat/completions"):
            turns.append(len(turns) + 1)
            if len(turns) == 2:
                await release.wait()
        return await handler(request)

    provider = web.Application(middlewares=[hold_second])
    provider.add_subapp("/v1", scripted_app())

    def driving(budget_usd: float) -> Callable[[dict[str, Any]], None]:
        return lambda data: (
            data["upstreams"].append({"name": "plans", "kind": "scripted", "base_url": url}),
            data["models"].insert(0, {"match": "scripted-*", "upstream": "plans", "price_in": 1.0, "price_out": 1.0}),
            add_team("driver", "sk-reload-driver", budget_usd=budget_usd, budget_period="total",
                     policies=["files"])(data))

    async with serving_app(provider) as root, aiohttp.ClientSession() as s:
        url = root + "/v1"
        gateway.write(driving(10.0))
        assert (await reload(gateway))[0] == 200
        run = asyncio.ensure_future(request(s, "POST", f"{gateway.url}/v1/chat/completions", key="sk-reload-driver",
                                            body={"model": "scripted-plan", "messages": PLAN_TASK},
                                            headers={"X-Run-Id": "driven-across-a-reload"}))
        await poll(lambda: _async(len(turns) == 2), timeout=30)  # turn 1 booked, turn 2 at the upstream
        gateway.write(driving(0.0))  # nothing left for the team from now on
        assert (await reload(gateway))[0] == 200
        release.set()
        status, headers, body = await run
    assert status == 200, body
    assert (body["run"]["status"], body["run"]["reason"]) == ("budget_exceeded", "team_budget"), body  # turn 3
    assert turns == [1, 2] and body["run"]["turns"] == 2, body  # the second, admitted before the reload, answered


async def test_a_replaced_upstreams_own_session_closes_once_its_last_call_ended(gateway: Gateway,
                                                                            tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    connections: list[asyncio.BaseTransport] = []  # each call's connection, as the upstream saw it
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        connections.append(request.transport)
        if len(connections) == 1:
            await release.wait()
        return web.json_response({"id": "chatcmpl-tls", "object": "chat.completion", "created": 0, "model": "s-1",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    def secure(timeout_s: float) -> Callable[[dict[str, Any]], None]:
        return lambda data: (data["upstreams"].append({"name": "secure", "base_url": url, "timeout_s": timeout_s,
                                                       "tls": {"ca_file": str(pki.ca)}}),
                             data["models"].insert(0, {"match": "s-*", "upstream": "secure"}))

    async with serving_app(chat_app(answer), pki.server_context()) as root, aiohttp.ClientSession() as s:
        url = root + "/v1"
        gateway.write(secure(30))
        assert (await reload(gateway))[0] == 200
        held = asyncio.ensure_future(request(s, "POST", f"{gateway.url}/v1/chat/completions", key=DEMO_KEY,
                                             body={"model": "s-1", "messages": TASK}))
        await poll(lambda: _async(connections), timeout=30)
        gateway.write(secure(40))  # the upstream changed: a new session for the next calls
        status, body = await reload(gateway)
        assert status == 200 and "upstreams" in body["config"]["changed"], body
        assert not connections[0].is_closing()  # its call is still on it
        release.set()
        status, _, answered = await held
        assert status == 200, answered
        # its session closes now (not when the process stops, nor after the pool's 60 s keep-alive)
        await poll(lambda: _async(connections[0].is_closing()), timeout=15)
        assert statuses(await calls(gateway, DEMO_KEY, "s-2", 2)) == [200, 200]
        assert connections[0] not in connections[1:]


async def _async(value: Any) -> Any:
    return value

