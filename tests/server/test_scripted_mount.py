"""The scripted provider inside the gateway, against real processes: mounted only when the
config names a `kind: scripted` upstream, only for gateway keys, with capped waits, and its
X-Scripted-* headers never reaching any other upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.server.served import DEMO, PLAN_ANSWER, TASK, Served, chat_body, poll, request, write_config
from tests.support.procs import Proc, free_port, start_gateway, start_scripted

MOUNT = "/scripted/v1"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("mount") / "gw")
    yield gateway
    gateway.proc.stop()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """`gateway scripted`: the provider alone, open by design (a test upstream started on purpose)."""
    proc = start_scripted(tmp_path_factory.mktemp("standalone"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory, standalone: Proc) -> Iterator[Proc]:
    """A gateway whose only upstream is an ordinary (`openai` kind) one: the standalone provider."""
    folder = tmp_path_factory.mktemp("hosted")
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    config["upstreams"] = [{"name": "hosted", "base_url": f"{standalone.url}/v1", "timeout_s": 10}]
    config["models"] = [{"match": "scripted-*", "upstream": "hosted", "price_in": 2.0, "price_out": 12.0}]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, Path(folder) / "gateway.log")
    yield proc
    proc.stop()


async def test_the_mount_needs_a_gateway_key(served: Served, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{served.url}{MOUNT}/models") as resp:
        body = await resp.json()
        assert resp.status == 401 and set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["code"] == "invalid_api_key" and "Authorization" in body["error"]["message"]
    status, _, body = await request(session, "GET", f"{served.url}{MOUNT}/models", key="sk-guess")
    assert status == 401 and body["error"]["message"] == "invalid API key: no team has this key"
    status, _, body = await request(session, "POST", f"{served.url}{MOUNT}/chat/completions", key="sk-guess",
                                    body=chat_body("scripted-plan"))
    assert status == 401, body
    status, _, body = await request(session, "GET", f"{served.url}{MOUNT}/models", key=DEMO)
    assert status == 200 and "scripted-plan" in [m["id"] for m in body["data"]]
    # the gateway's own upstream calls to its mount carry its own key
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan"), headers={"X-Policy": "files"})
    assert status == 200 and body["choices"][0]["message"]["content"] == PLAN_ANSWER, body


@pytest.mark.parametrize("header", ["X-Scripted-Latency-Ms", "X-Scripted-Chunk-Delay-Ms"])
@pytest.mark.parametrize("value", ["1e12", "60001", "inf", "nan", "-1"])
async def test_waits_are_capped_and_the_error_names_the_header(served: Served, session: aiohttp.ClientSession,
                                                               header: str, value: str) -> None:
    status, _, body = await request(session, "POST", f"{served.url}{MOUNT}/chat/completions",
                                    body=chat_body("scripted-plan"), headers={header: value})
    assert status == 400 and body["error"]["param"] == header, body
    assert body["error"]["message"] == (f"header {header} must be a number of milliseconds from 0 to 60000, "
                                        f"got {value!r}")
    # through the gateway, the client reads the same sentence (the upstream refused the request)
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan"), headers={header: value})
    assert status == 400 and header in body["error"]["message"], body


async def test_no_mount_without_a_scripted_upstream_and_no_scripted_headers_upstream(
        hosted: Proc, standalone: Proc, session: aiohttp.ClientSession) -> None:
    status, _, body = await request(session, "GET", f"{hosted.url}{MOUNT}/models", key=DEMO)
    assert status == 404 and body["error"]["code"] == "route_not_found", body
    # the failure knobs are for the scripted kind only: an ordinary upstream never sees them
    for knobs in ({"X-Scripted-Fail": "500"}, {"X-Scripted-Latency-Ms": "1e12"}):
        status, _, body = await request(session, "POST", f"{hosted.url}/v1/chat/completions",
                                        body=chat_body("scripted-plan"), headers=knobs)
        assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls", (knobs, body)
    # the standalone provider is open on purpose and still obeys the knobs sent to it directly
    async with session.post(f"{standalone.url}/v1/chat/completions", json={"model": "scripted-plan", "messages": TASK},
                            headers={"X-Scripted-Fail": "500"}) as resp:
        assert resp.status == 500
    async with session.get(f"{standalone.url}/v1/models") as resp:
        assert resp.status == 200


async def test_shutdown_cuts_a_scripted_wait_short(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """A call asleep in the mount for the longest allowed latency does not hold SIGTERM up."""
    gateway = Served.start(tmp_path / "gw")
    try:
        call = asyncio.ensure_future(request(
            session, "POST", f"{gateway.url}/v1/chat/completions", body=chat_body("scripted-plan"),
            headers={"X-Run-Id": "asleep", "X-Scripted-Latency-Ms": "60000"}))

        async def in_flight() -> bool:
            status, _, body = await request(session, "GET", f"{gateway.url}/v1/runs/asleep")
            return status == 200
        await poll(in_flight)
        gateway.proc.popen.terminate()
        # aiohttp waits for handlers up to its shutdown timeout (60 s) before killing them
        assert gateway.proc.popen.wait(timeout=30) == 0
        await asyncio.gather(call, return_exceptions=True)  # answered or cut: either way not left waiting
    finally:
        gateway.proc.stop()
