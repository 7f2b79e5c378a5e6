"""Fixtures for the gateway server: a config written to a temp folder, the app on a real
aiohttp test server, and a counting upstream (the scripted provider behind a request
counter) on another real server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler

from gateway.config.settings import Config, load_config
from gateway.providers.scripted import scripted_app
from gateway.server import context as ctx
from gateway.server.app import build_app
from gateway.store.base import Store

KEY = "sk-test"
OTHER_KEY = "sk-other"

POLICIES: dict[str, dict[str, Any]] = {
    "passthrough": {"limits": {"max_turns": 20, "max_budget_usd": 0.5}},
    "capped": {"limits": {"max_turns": 3, "max_budget_usd": 1.0}},
    "budgeted": {"limits": {"max_turns": None, "max_budget_usd": 0.002}},
    "strict": {"limits": {"max_turns": None, "max_budget_usd": 0.002, "budget_mode": "strict"}},
    "unlimited": {"limits": {"max_turns": None, "max_budget_usd": None}},
}


def write_policies(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in POLICIES.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "description": name, **body}))
    return folder


def config_data(*, team: dict[str, Any] | None = None, other: dict[str, Any] | None = None,
                upstreams: list[dict[str, Any]] | None = None, models: list[dict[str, Any]] | None = None,
                defaults: dict[str, Any] | None = None, store: dict[str, Any] | None = None,
                server: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config document: team `t` (key sk-test) and team `o` (key sk-other), scripted upstream."""
    return {
        "server": {"host": "127.0.0.1", "port": 0, **(server or {})},
        "store": store or {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "trace_file": "./trace.jsonl",
        "upstreams": upstreams or [{"name": "scripted", "kind": "scripted"}],
        "models": models or [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "t", "keys": [KEY], "budget_usd": None, "policies": list(POLICIES), **(team or {})},
            {"name": "o", "keys": [OTHER_KEY], "budget_usd": None, "policies": ["passthrough"], **(other or {})},
        ],
        "defaults": defaults or {"output_allowance_tokens": 4096},
    }


def write_config(folder: Path, data: dict[str, Any]) -> Path:
    write_policies(folder / "policies")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Gateway:
    """A gateway app on a real test server, with its config and store at hand."""

    client: TestClient
    config: Config

    @property
    def app(self) -> web.Application:
        return self.client.server.app

    @property
    def store(self) -> Store:
        return self.app[ctx.STORE]

    async def chat(self, body: dict[str, Any], *, key: str | None = KEY, run_id: str | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        """POST /v1/chat/completions; returns (status, headers, parsed JSON body)."""
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        if run_id is not None:
            h["X-Run-Id"] = run_id
        async with self.client.post("/v1/chat/completions", data=orjson.dumps(body), headers=h) as resp:
            raw = await resp.read()
            return resp.status, dict(resp.headers), orjson.loads(raw) if raw else None

    async def metrics(self) -> str:
        async with self.client.get("/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
def make_gateway(aiohttp_client: Any, tmp_path: Path) -> MakeGateway:
    """`await make_gateway(**config_data kwargs)` -> a running Gateway."""
    count = 0

    async def make(**kw: Any) -> Gateway:
        nonlocal count
        count += 1
        folder = tmp_path / f"gw{count}"
        folder.mkdir()
        config = load_config(write_config(folder, config_data(**kw)))
        client = await aiohttp_client(build_app(config))
        return Gateway(client, config)

    return make


@pytest.fixture
async def gw(make_gateway: MakeGateway) -> Gateway:
    return await make_gateway()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for tests that speak to a real gateway process."""
    async with aiohttp.ClientSession() as s:
        yield s


@dataclass
class CountingUpstream:
    """The scripted provider at /v1 of its own server, counting the chat calls it gets."""

    server: TestServer
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("/v1"))

    def chat_calls(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"].endswith("/chat/completions")]


@pytest.fixture
async def counting_upstream(aiohttp_server: Any) -> CountingUpstream:
    box: list[CountingUpstream] = []

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.read()
        box[0].calls.append({"path": request.path, "body": orjson.loads(body) if body else None,
                             "headers": dict(request.headers)})
        return await handler(request)

    app = web.Application(middlewares=[count])
    app.add_subapp("/v1", scripted_app())
    upstream = CountingUpstream(await aiohttp_server(app))
    box.append(upstream)
    return upstream


def counted_config(upstream: CountingUpstream, **kw: Any) -> dict[str, Any]:
    """config_data kwargs routing every model to the counting upstream."""
    return {
        "upstreams": [{"name": "counted", "base_url": upstream.base_url, "timeout_s": 5}],
        "models": [{"match": "*", "upstream": "counted", "price_in": 2.0, "price_out": 12.0}],
        **kw,
    }


@dataclass
class FixedUpstream:
    """An upstream that answers every chat call with the bytes a test set (stream or JSON)."""

    server: TestServer
    stream_events: list[bytes] = field(default_factory=list)
    json_body: bytes = b""
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("/v1"))


@pytest.fixture
async def fixed_upstream(aiohttp_server: Any) -> FixedUpstream:
    box: list[FixedUpstream] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        up = box[0]
        body = orjson.loads(await request.read())
        up.requests.append(body)
        if not body.get("stream"):
            return web.Response(body=up.json_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in up.stream_events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    up = FixedUpstream(await aiohttp_server(app))
    box.append(up)
    return up


def fixed_config(upstream: FixedUpstream, **kw: Any) -> dict[str, Any]:
    return {
        "upstreams": [{"name": "fixed", "base_url": upstream.base_url, "timeout_s": 5}],
        "models": [{"match": "*", "upstream": "fixed", "price_in": 2.0, "price_out": 12.0}],
        **kw,
    }


PLAN_USER = {"role": "user", "content": "Which file mentions a timeout?"}


def plan_start() -> list[dict[str, Any]]:
    from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]


async def run_tools_locally(sandbox: Any, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Execute the assistant message's tool calls with gateway.tools.files (the client's side)."""
    import asyncio as _asyncio

    from gateway.harness.tools import ToolContext
    from gateway.tools.files import file_tools

    tools = file_tools(sandbox)
    out = []
    for call in message.get("tool_calls") or []:
        name = call["function"]["name"]
        tool_ctx = ToolContext("client", call["id"], name, _asyncio.Event())
        try:
            result = str(await tools[name].run(orjson.loads(call["function"]["arguments"] or "{}"), tool_ctx))
        except Exception as exc:  # the client's loop reports tool errors as text
            result = f"Error: {exc}"
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return out
