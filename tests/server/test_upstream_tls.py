"""Upstreams over TLS: a private CA (`tls.ca_file`), mutual TLS (`tls.cert_file`/`key_file`),
`verify: false`; real HTTPS upstreams with certificates made in the test. A certificate
the gateway does not trust, or a client certificate the upstream wants and does not get,
is a 502 naming the TLS problem. Upstreams without TLS settings share the app's session;
the sessions of the others are closed with them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.config.settings import load_config
from gateway.providers.scripted import scripted_app
from gateway.server import context as ctx
from tests.server.conftest import KEY, CountingUpstream, Gateway, MakeGateway, config_data, write_config
from tests.support.certs import Pki, make_pki
from tests.support.upstreams import serving_app

CHAT = {"model": "scripted-plan", "messages": [{"role": "user", "content": "Which file mentions a timeout?"}]}


async def answered(gw: Gateway, run_id: str, stream: bool) -> None:
    """A chat call through `gw` answered whole (a stream to its [DONE])."""
    async with gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                              headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id}) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        assert raw.rstrip().endswith(b"data: [DONE]") if stream else b'"finish_reason"' in raw


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def provider() -> web.Application:
    app = web.Application()
    app.add_subapp("/v1", scripted_app())
    return app


@pytest.fixture
async def https(pki: Pki) -> AsyncIterator[str]:
    """The scripted provider over HTTPS with a certificate of the private CA."""
    async with serving_app(provider(), pki.server_context()) as root:
        yield root + "/v1"


@pytest.fixture
async def mutual(pki: Pki) -> AsyncIterator[str]:
    """The same, requiring a client certificate signed by the client CA."""
    async with serving_app(provider(), pki.server_context(client_ca=True)) as root:
        yield root + "/v1"


def routed(url: str, **upstream: Any) -> dict[str, Any]:
    return {"upstreams": [{"name": "secure", "base_url": url, "timeout_s": 10, **upstream}],
            "models": [{"match": "*", "upstream": "secure"}]}


async def test_a_private_ca_is_trusted_only_when_configured(make_gateway: MakeGateway, https: str,
                                                            pki: Pki) -> None:
    untrusting = await make_gateway(**routed(https))
    status, _, body = await untrusting.chat(CHAT, run_id="tls-1")
    assert status == 502 and body["error"]["code"] == "upstream_unreachable"
    assert "TLS certificate of 127.0.0.1:" in body["error"]["message"]
    assert "is not trusted (unable to get local issuer certificate); tls.ca_file names the CA" in \
        body["error"]["message"]
    trusting = await make_gateway(**routed(https, tls={"ca_file": str(pki.ca)}))
    for stream in (False, True):
        await answered(trusting, f"tls-2-{stream}", stream)
    unchecked = await make_gateway(**routed(https, tls={"verify": False}))
    status, _, _ = await unchecked.chat(CHAT, run_id="tls-3")
    assert status == 200


async def test_tls_to_a_plain_http_server_names_the_failed_handshake(make_gateway: MakeGateway,
                                                                     counting_upstream: CountingUpstream) -> None:
    gw = await make_gateway(**routed(counting_upstream.base_url.replace("http://", "https://")))
    status, _, body = await gw.chat(CHAT, run_id="tls-plain")
    assert status == 502 and body["error"]["code"] == "upstream_unreachable"
    assert "the TLS handshake with 127.0.0.1:" in body["error"]["message"]
    assert "failed (wrong version number); is it an https:// server?" in body["error"]["message"]


async def test_mutual_tls_is_refused_without_the_client_certificate_and_served_with_it(
        make_gateway: MakeGateway, mutual: str, pki: Pki) -> None:
    for tls in ({"ca_file": str(pki.ca)},
                {"ca_file": str(pki.ca), "cert_file": str(pki.stranger_cert), "key_file": str(pki.stranger_key)}):
        gw = await make_gateway(**routed(mutual, tls=tls))
        status, _, body = await gw.chat(CHAT, run_id="mtls-refused")
        assert status == 502 and body["error"]["code"] == "upstream_unreachable", body
        assert "wants a client certificate refuses a missing or untrusted one so (tls.cert_file, tls.key_file)" \
            in body["error"]["message"], body
    gw = await make_gateway(**routed(mutual, tls={"ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
                                                  "key_file": str(pki.client_key)}))
    for stream in (False, True):
        await answered(gw, f"mtls-{stream}", stream)
    async with gw.client.post("/v1/embeddings", json={"model": "scripted-embed", "input": "x"},
                              headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200, await resp.text()


async def test_only_upstreams_with_tls_or_a_proxy_get_sessions_of_their_own_closed_with_them(
        tmp_path: Path, pki: Pki) -> None:
    config = load_config(write_config(tmp_path, config_data(upstreams=[
        {"name": "scripted", "kind": "scripted"},
        {"name": "plain", "base_url": "https://api.example/v1", "tls": {"verify": True}},  # the defaults: shared
        {"name": "private", "base_url": "https://llm.example/v1", "tls": {"ca_file": str(pki.ca)}},
        {"name": "proxied", "base_url": "http://llm.example/v1", "proxy": "http://u:p@127.0.0.1:9"}])))
    async with aiohttp.ClientSession() as shared:
        upstreams = ctx.Upstreams(config, shared)
        assert upstreams["scripted"].session is shared and upstreams["plain"].session is shared
        own = [upstreams["private"].session, upstreams["proxied"].session]
        assert shared not in own and own[0] is not own[1]
        await upstreams.close()
        assert all(s.closed for s in own) and not shared.closed
