"""Streams pass through as they come: the first chunk does not wait for the last."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from gateway.harness.state import scoped_run_id
from gateway.server import context as ctx
from tests.server.conftest import KEY, PLAN_USER, Gateway, MakeGateway

DELAY_MS = 150
BODY: dict[str, Any] = {"model": "scripted-plan", "messages": [PLAN_USER], "stream": True}


async def test_first_chunk_arrives_before_the_upstream_has_finished(gw: Gateway) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": "ttfb", "X-Scripted-Chunk-Delay-Ms": str(DELAY_MS)}
    started = time.perf_counter()
    arrivals: list[tuple[float, bytes]] = []
    async with gw.client.post("/v1/chat/completions", data=orjson.dumps(BODY), headers=headers) as resp:
        assert resp.status == 200
        buffer = b""
        async for piece in resp.content.iter_any():
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                arrivals.append((time.perf_counter() - started, event))
    data_events = [(t, e) for t, e in arrivals if e.startswith(b"data: {")]
    assert len(data_events) >= 4
    first, last = data_events[0][0], data_events[-1][0]
    # the upstream waits DELAY_MS between chunks: the first one must be here long before the last
    assert last - first >= (len(data_events) - 1) * DELAY_MS / 1000 * 0.9
    assert first + 2 * DELAY_MS / 1000 < last
    gaps = [b[0] - a[0] for a, b in zip(data_events, data_events[1:])]
    # each chunk was forwarded on its own, not batched: a batch would arrive at once (gaps
    # near 0); a chunk a loaded machine held back shortens only the gap after it
    assert min(gaps) >= DELAY_MS / 1000 * 0.3, gaps
    assert arrivals[-1][1] == b"data: [DONE]"


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)  # polling interval


async def test_client_that_leaves_mid_stream_pays_what_it_received(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(team={"budget_usd": 1.0})
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": "gone", "X-Scripted-Chunk-Delay-Ms": str(DELAY_MS)}
    resp = await gw.client.post("/v1/chat/completions", data=orjson.dumps(BODY), headers=headers)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"data: {")
    resp.close()  # the client goes away after the first chunk

    async def booked() -> bool:
        run = await gw.store.load_run(scoped_run_id("t", "gone"))
        return run is not None and run.turns == 1

    await wait_for(booked)
    run = await gw.store.load_run(scoped_run_id("t", "gone"))
    assert run is not None and run.status == "running"
    spent, reserved = await gw.store.team_spend("t", gw.app[ctx.GOVERNOR].period(gw.config.teams[0]))
    assert reserved == 0 and abs(spent - run.cost_usd) < 1e-6
    turn = [e for _, e in await gw.store.events(scoped_run_id("t", "gone")) if e["type"] == "turn"][-1]
    assert turn["finish"] == "client_disconnected"
