"""`discover_models: true`: `GET /v1/models` lists what a glob route's upstream serves (its
`GET {base_url}/models`), asked once a minute at most, bounded in count and size; an
upstream that cannot answer leaves the listing whole but for its names, and
`GET /v1/models/{model}` says the same as the listing. The cache itself (one refresh at a
time, the last good list kept through failures) is checked on a fake clock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.providers.discovery import ModelDiscovery
from gateway.providers.errors import UpstreamError
from gateway.providers.scenarios import model_names
from tests.server.conftest import KEY, Gateway, MakeGateway


@dataclass
class Lister:
    """An upstream's /v1/models: what it answers, and the requests it got."""

    body: bytes = b""
    status: int = 200
    requests: list[dict[str, str]] = field(default_factory=list)

    def serve(self, names: list[str]) -> None:
        self.body = orjson.dumps({"object": "list", "data": [{"id": n, "object": "model", "created": 1,
                                                               "owned_by": "vllm"} for n in names]})
        self.status = 200


@pytest.fixture
async def lister(aiohttp_server: Any) -> tuple[Lister, str]:
    state = Lister()
    state.serve(["qwen2.5-7b", "llama-3.1-8b", "bge-small", "scripted-plan"])

    async def models(request: web.Request) -> web.Response:
        state.requests.append(dict(request.headers))
        return web.Response(body=state.body, status=state.status, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    return state, str(server.make_url("/v1"))


async def gateway(make_gateway: MakeGateway, base_url: str, monkeypatch: pytest.MonkeyPatch,
                  **upstream: Any) -> Gateway:
    monkeypatch.setenv("GW_TEST_VLLM_KEY", "vllm-key-1")
    return await make_gateway(
        upstreams=[{"name": "scripted", "kind": "scripted"},
                   {"name": "vllm", "base_url": base_url, "api_key_env": "GW_TEST_VLLM_KEY", "discover_models": True,
                    **upstream},
                   {"name": "other", "base_url": "http://127.0.0.1:9/v1"}],
        models=[{"match": "scripted-*", "upstream": "scripted"},
                {"match": "llama-*", "upstream": "other"},  # llama-3.1-8b is routed elsewhere: not vllm's to list
                {"match": "*", "upstream": "vllm", "price_in": 0, "price_out": 0}])


async def get(gw: Gateway, path: str) -> tuple[int, Any]:
    async with gw.client.get(path, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return resp.status, await resp.json()


async def listed(gw: Gateway) -> dict[str, str]:
    status, body = await get(gw, "/v1/models")
    assert status == 200, body
    return {m["id"]: m["owned_by"] for m in body["data"]}


async def test_a_glob_route_s_upstream_models_are_listed_and_retrievable(
        make_gateway: MakeGateway, lister: tuple[Lister, str], monkeypatch: pytest.MonkeyPatch) -> None:
    state, base = lister
    gw = await gateway(make_gateway, base, monkeypatch)
    models = await listed(gw)
    assert {m: u for m, u in models.items() if u == "vllm"} == {"qwen2.5-7b": "vllm", "bge-small": "vllm"}
    assert {m for m, u in models.items() if u == "scripted"} == set(model_names())
    assert state.requests[0]["Authorization"] == "Bearer vllm-key-1"  # asked with the upstream's own auth
    assert await get(gw, "/v1/models/qwen2.5-7b") == (200, {"id": "qwen2.5-7b", "object": "model", "created": 0,
                                                            "owned_by": "vllm"})
    status, body = await get(gw, "/v1/models/qwen2.5-7b-typo")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["message"] == ("model 'qwen2.5-7b-typo' is routed by '*' to upstream 'vllm', which does "
                                        "not list it (see GET /v1/models)")
    await asyncio.gather(*(listed(gw) for _ in range(5)))
    assert len(state.requests) == 1  # kept: asked once for all of these


@pytest.mark.parametrize("answer", ["down", "500", "not json", "no data", "too large"])
async def test_an_upstream_that_cannot_list_leaves_the_listing_whole(
        make_gateway: MakeGateway, lister: tuple[Lister, str], monkeypatch: pytest.MonkeyPatch,
        answer: str, caplog: pytest.LogCaptureFixture) -> None:
    state, base = lister
    if answer == "down":
        base = "http://127.0.0.1:9/v1"
    elif answer == "500":
        state.status, state.body = 500, b'{"error": {"message": "boom"}}'
    elif answer == "not json":
        state.body = b"<html>"
    elif answer == "no data":
        state.body = b'{"models": []}'
    else:
        state.serve([f"model-{i:06d}-" + "x" * 200 for i in range(6000)])  # over 1 MiB
    gw = await gateway(make_gateway, base, monkeypatch)
    models = await listed(gw)
    assert set(models) == set(model_names())  # the routed names, without vllm's
    assert "cannot list the models of upstream 'vllm'" in caplog.text
    status, body = await get(gw, "/v1/models/qwen2.5-7b")  # it cannot say: routed by the glob, as before
    assert status == 200 and body["owned_by"] == "vllm"


async def test_a_long_list_is_cut_to_the_bound(make_gateway: MakeGateway, lister: tuple[Lister, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    state, base = lister
    state.serve([f"m-{i}" for i in range(1500)] + ["bad\nname", "x" * 300])
    gw = await gateway(make_gateway, base, monkeypatch)
    models = await listed(gw)
    assert sum(1 for u in models.values() if u == "vllm") == 1000 and "m-999" in models and "m-1000" not in models


async def test_an_upstream_without_discovery_is_never_asked(make_gateway: MakeGateway, lister: tuple[Lister, str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    state, base = lister
    gw = await gateway(make_gateway, base, monkeypatch, discover_models=False)
    assert set(await listed(gw)) == set(model_names())
    assert (await get(gw, "/v1/models/anything"))[0] == 200  # a glob routes it; nobody says otherwise
    assert state.requests == []


async def test_the_cache_asks_once_at_a_time_and_keeps_the_last_good_list() -> None:
    now = [0.0]
    answers: list[list[str] | Exception] = [["a", "b"], UpstreamError("upstream_unreachable", "down", "u"), ["c"]]
    asked: list[str] = []
    gate = asyncio.Event()

    async def fetch(upstream: str) -> list[str]:
        asked.append(upstream)
        await gate.wait()
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = ModelDiscovery(fetch, clock=lambda: now[0], ttl_s=60, retry_s=10)
    waiting = [asyncio.ensure_future(cache.names("u")) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiting) == [("a", "b")] * 3 and asked == ["u"]  # one refresh for three callers
    now[0] = 30.0
    assert await cache.names("u") == ("a", "b") and asked == ["u"]  # within the TTL
    now[0] = 61.0
    assert await cache.names("u") == ("a", "b") and len(asked) == 2  # it failed: the last good list
    now[0] = 65.0
    assert await cache.names("u") == ("a", "b") and len(asked) == 2  # not asked again before retry_s
    now[0] = 72.0
    assert await cache.names("u") == ("c",) and len(asked) == 3
    await cache.close()
