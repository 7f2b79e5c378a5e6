"""Upstreams behind an HTTP proxy (a small one of the test's, tests/support/proxy.py, that
notes every request it carries): `proxy` sends every call through it, HTTP_PROXY/HTTPS_PROXY
do the same when `proxy` is not set, NO_PROXY keeps a matching upstream direct (the proxy
sees none of its calls), and `proxy` wins over the environment. Proxy credentials go to the
proxy only; an https:// upstream is reached through a CONNECT tunnel, its TLS intact."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from gateway.providers.scripted import scripted_app
from tests.server.conftest import KEY, CountingUpstream, Gateway, MakeGateway
from tests.support.certs import make_pki
from tests.support.proxy import forward_proxy
from tests.support.upstreams import serving_app

CHAT = {"model": "scripted-plan", "messages": [{"role": "user", "content": "Which file mentions a timeout?"}]}


@pytest.fixture
def proxy() -> Iterator[tuple[str, list[str]]]:
    with forward_proxy() as running:
        yield running


def routed(upstream: CountingUpstream, **fields: Any) -> dict[str, Any]:
    return {"upstreams": [{"name": "counted", "base_url": upstream.base_url, "timeout_s": 10, **fields}],
            "models": [{"match": "*", "upstream": "counted"}]}


async def three_calls(gw: Gateway, run_id: str) -> None:
    """A chat call, a streamed one and an embeddings call, each answered."""
    for stream in (False, True):
        async with gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                  headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id}) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    async with gw.client.post("/v1/embeddings", json={"model": "scripted-embed", "input": "x"},
                              headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200, await resp.text()


def through_proxy(seen: list[str], upstream: CountingUpstream) -> list[str]:
    return [s for s in seen if upstream.base_url.removesuffix("/v1") in s]


async def test_every_call_goes_through_the_configured_proxy(make_gateway: MakeGateway,
                                                            counting_upstream: CountingUpstream,
                                                            proxy: tuple[str, list[str]]) -> None:
    url, seen = proxy
    gw = await make_gateway(**routed(counting_upstream, proxy=url))
    await three_calls(gw, "proxied")
    base = counting_upstream.base_url
    assert seen == [f"POST {base}/chat/completions", f"POST {base}/chat/completions", f"POST {base}/embeddings"]
    assert len(counting_upstream.calls) == 3


async def test_the_environment_s_proxy_unless_no_proxy_names_the_host_and_the_config_wins(
        make_gateway: MakeGateway, counting_upstream: CountingUpstream, proxy: tuple[str, list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, seen = proxy
    monkeypatch.setenv("HTTP_PROXY", url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    await three_calls(await make_gateway(**routed(counting_upstream)), "env")
    assert len(through_proxy(seen, counting_upstream)) == 3  # HTTP_PROXY, as set
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    seen.clear()
    await three_calls(await make_gateway(**routed(counting_upstream)), "no-proxy")
    assert seen == [] and len(counting_upstream.calls) == 6  # NO_PROXY matches: straight to the upstream
    await three_calls(await make_gateway(**routed(counting_upstream, proxy=url)), "config-wins")
    assert len(through_proxy(seen, counting_upstream)) == 3  # `proxy` wins over NO_PROXY (and HTTP_PROXY)
    seen.clear()
    monkeypatch.delenv("NO_PROXY")
    await three_calls(await make_gateway(**routed(counting_upstream, proxy=False)), "never")
    assert seen == []  # proxy: false ignores the environment


async def test_proxy_credentials_reach_the_proxy_and_a_refusal_is_a_502(
        make_gateway: MakeGateway, counting_upstream: CountingUpstream) -> None:
    with forward_proxy(credentials=("gw", "p@ss word")) as (url, seen):
        host = url.removeprefix("http://")
        good = await make_gateway(**routed(counting_upstream, proxy=f"http://gw:p%40ss%20word@{host}"))
        await three_calls(good, "authorised")
        assert len(seen) == 3 and not any(s.startswith("407") for s in seen)
        assert counting_upstream.calls and not any("proxy-authorization" in {k.lower() for k in c["headers"]}
                                                   for c in counting_upstream.calls)  # the proxy's only
        bad = await make_gateway(**routed(counting_upstream, proxy=f"http://gw:wrong@{host}"))
        status, _, body = await bad.chat(CHAT, run_id="refused")
        assert status == 502 and body["error"]["code"] == "upstream_status"
        assert "answered 407" in body["error"]["message"] and "wrong" not in body["error"]["message"]


@pytest.fixture
async def https_upstream(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, str]]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    app = web.Application()
    app.add_subapp("/v1", scripted_app())
    async with serving_app(app, pki.server_context()) as root:
        yield root + "/v1", str(pki.ca)


async def test_an_https_upstream_is_tunnelled_with_its_private_ca_and_the_proxy_s_credentials(
        make_gateway: MakeGateway, https_upstream: tuple[str, str]) -> None:
    base, ca = https_upstream
    with forward_proxy(credentials=("gw", "s3cret")) as (url, seen):
        proxy = url.replace("http://", "http://gw:s3cret@")
        gw = await make_gateway(upstreams=[{"name": "secure", "base_url": base, "proxy": proxy,
                                            "tls": {"ca_file": ca}}],
                                models=[{"match": "*", "upstream": "secure"}])
        for run_id in ("tunnel-1", "tunnel-2"):
            status, _, body = await gw.chat(CHAT, run_id=run_id)
            assert status == 200, body
        assert seen and all(s == f"CONNECT {base.removeprefix('https://').removesuffix('/v1')}" for s in seen)
