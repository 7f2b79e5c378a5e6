"""Upstream failures: 502/504 naming the upstream's status, reservation released, run intact."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.harness.state import scoped_run_id
from gateway.server import context as ctx
from tests.support.procs import free_port
from tests.server.conftest import KEY, PLAN_USER, Gateway, MakeGateway

BODY: dict[str, Any] = {"model": "scripted-plan", "messages": [PLAN_USER]}
TEAM = {"budget_usd": 1.0}


async def ledger(gw: Gateway) -> tuple[float, float]:
    return await gw.store.team_spend("t", gw.app[ctx.GOVERNOR].period(gw.config.teams[0]))


async def assert_intact_and_resumable(gw: Gateway, run_id: str, turns: int = 0) -> None:
    run = await gw.store.load_run(scoped_run_id("t", run_id))
    assert run is not None and run.status == "running" and run.turns == turns
    status, headers, _ = await gw.chat(BODY, run_id=run_id)
    assert status == 200 and headers["X-Run-Turns"] == str(turns + 1)


@pytest.fixture
async def gw(make_gateway: MakeGateway) -> Gateway:
    return await make_gateway(team=TEAM, upstreams=[{"name": "scripted", "kind": "scripted", "timeout_s": 0.3}])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fail", "status", "code", "upstream_status"), [
    ("500", 502, "upstream_status", 500),
    ("429", 502, "upstream_status", 429),
    ("hang", 504, "upstream_timeout", None),
])
async def test_failures_before_any_answer(gw: Gateway, fail: str, status: int, code: str,
                                          upstream_status: int | None, stream: bool) -> None:
    got, headers, body = await gw.chat({**BODY, "stream": stream}, run_id=f"f-{fail}",
                                       headers={"X-Scripted-Fail": fail})
    assert got == status, body
    assert body["error"]["code"] == code and body["error"]["type"] in ("upstream_error", "upstream_timeout")
    assert "'scripted'" in body["error"]["message"]
    assert body["upstream"] == {"name": "scripted", "status": upstream_status}
    if upstream_status is not None:
        assert f"answered {upstream_status}" in body["error"]["message"]
    assert "x-should-retry" not in headers  # an upstream hiccup may well be retried
    assert headers["X-Run-Id"] == f"f-{fail}" and headers["X-Run-Turns"] == "0"
    assert await ledger(gw) == (0.0, 0.0)  # the reservation was released
    await assert_intact_and_resumable(gw, f"f-{fail}")


async def test_malformed_json_answer_is_502(gw: Gateway) -> None:
    got, _, body = await gw.chat(BODY, run_id="mal", headers={"X-Scripted-Fail": "malformed"})
    assert got == 502 and body["error"]["code"] == "upstream_malformed"
    assert await ledger(gw) == (0.0, 0.0)
    await assert_intact_and_resumable(gw, "mal")


async def test_answer_cut_halfway_is_502(gw: Gateway) -> None:
    got, _, body = await gw.chat(BODY, run_id="cut", headers={"X-Scripted-Fail": "cut"})
    assert got == 502 and body["error"]["code"] == "upstream_cut"
    assert await ledger(gw) == (0.0, 0.0)
    await assert_intact_and_resumable(gw, "cut")


async def test_unreachable_upstream_is_502(make_gateway: MakeGateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = await make_gateway(team=TEAM, upstreams=[{"name": "dead", "base_url": dead}],
                            models=[{"match": "*", "upstream": "dead"}])
    got, _, body = await gw.chat(BODY, run_id="dead-1")
    assert got == 502 and body["error"]["code"] == "upstream_unreachable" and "'dead'" in body["error"]["message"]
    assert await ledger(gw) == (0.0, 0.0)
    run = await gw.store.load_run(scoped_run_id("t", "dead-1"))
    assert run is not None and run.turns == 0 and run.status == "running"


async def _stream_events(gw: Gateway, run_id: str, fail: str) -> list[bytes]:
    async with gw.client.post("/v1/chat/completions", data=orjson.dumps({**BODY, "stream": True}),
                              headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id,
                                       "X-Scripted-Fail": fail}) as resp:
        assert resp.status == 200
        raw = await resp.read()
    return [e for e in raw.split(b"\n\n") if e]


async def test_stream_cut_charges_what_was_received_and_ends_with_an_error(gw: Gateway) -> None:
    events = await _stream_events(gw, "scut", "cut")
    assert b"[DONE]" not in b"".join(events)
    error = orjson.loads(events[-1][len(b"data: "):])["error"]
    assert error["code"] == "upstream_cut" and "'scripted'" in error["message"]
    run = await gw.store.load_run(scoped_run_id("t", "scut"))
    assert run is not None and run.turns == 1 and run.status == "running"
    assert 0 < run.cost_usd
    spent, reserved = await ledger(gw)
    assert reserved == 0 and abs(spent - run.cost_usd) < 1e-6  # settled with what was received
    trace = [e for _, e in await gw.store.events(scoped_run_id("t", "scut")) if e["type"] == "turn"]
    assert trace[-1]["finish"] == "cut"
    await assert_intact_and_resumable(gw, "scut", turns=1)


async def test_stream_with_a_malformed_chunk_is_not_passed_on(gw: Gateway) -> None:
    events = await _stream_events(gw, "smal", "malformed")
    assert b"data: {not json" not in events
    for event in events:  # every event the client got parses
        orjson.loads(event[len(b"data: "):])
    error = orjson.loads(events[-1][len(b"data: "):])["error"]
    assert error["code"] == "upstream_malformed"
    _, reserved = await ledger(gw)
    assert reserved == 0
