"""A call's request is freed as soon as it is answered, by reference counting alone: an
idle gateway runs no cyclic collection, so a request kept alive by a cycle (its prompt of
megabytes with it) would stay until some later call's allocations trigger one."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import orjson
from aiohttp import web

from gateway.config.settings import load_config
from gateway.server.app import build_app
from tests.server.conftest import KEY, CountingUpstream, config_data, counted_config, write_config


async def test_a_pass_through_calls_request_is_freed_once_answered(aiohttp_client: Any, tmp_path: Any,
                                                                    counting_upstream: CountingUpstream) -> None:
    app = build_app(load_config(write_config(tmp_path, config_data(**counted_config(counting_upstream)))))
    seen: list[weakref.ref[web.Request]] = []

    async def note(request: web.Request, response: web.StreamResponse) -> None:
        if request.path == "/v1/chat/completions":
            seen.append(weakref.ref(request))

    app.on_response_prepare.append(note)
    client = await aiohttp_client(app)
    body = {"model": "scripted-once", "messages": [{"role": "user", "content": "x" * 100_000}]}
    gc.collect()
    gc.disable()  # what is freed here, reference counting freed
    try:
        for stream in (False, True):
            async with client.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": stream}), headers={
                    "Authorization": f"Bearer {KEY}", "X-Run-Id": f"r_{stream}"}) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        await client.close()  # the connections end: nothing of theirs holds a request
        assert len(seen) == 2
        alive = [ref() for ref in seen if ref() is not None]
        assert not alive, f"{len(alive)} answered requests still alive, held by " + "; ".join(
            type(r).__name__ for req in alive for r in gc.get_referrers(req))[:500]
    finally:
        gc.enable()
