"""Booking a pass-through turn: one store step, and spend that is never lost when it fails."""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson
from aiohttp import web

from gateway.harness.usage import Price, Usage
from tests.server.conftest import MakeGateway

PRICE = Price(2.0, 12.0)
USAGE = Usage(1200, 300)
ANSWER = {"id": "c1", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": USAGE.prompt_tokens, "completion_tokens": USAGE.completion_tokens}}


async def test_a_turn_whose_run_vanished_still_books_its_spend(make_gateway: MakeGateway, aiohttp_server: Any,
                                                               tmp_path: Any) -> None:
    """The run's row is deleted while the upstream answers: the save cannot happen, but the
    money was spent upstream, so the team's reservation is settled for it anyway."""
    box: list[Any] = []

    async def chat(request: web.Request) -> web.Response:
        with sqlite3.connect(box[0]) as conn:  # another process's hand, on the same file
            conn.execute("DELETE FROM runs WHERE id = 't/doomed'")
        return web.Response(body=orjson.dumps(ANSWER), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    upstream = await aiohttp_server(app)
    gw = await make_gateway(
        upstreams=[{"name": "u", "base_url": str(upstream.make_url("/v1"))}],
        models=[{"match": "*", "upstream": "u", "price_in": 2.0, "price_out": 12.0}],
        team={"budget_usd": 5.0, "budget_period": "total"},
    )
    box.append(gw.config.store.options["path"])
    status, _, body = await gw.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, run_id="doomed")
    assert status == 404 and body["error"]["code"] == "run_not_found", body
    assert await gw.store.team_spend("t", "total") == (PRICE.cost(USAGE), 0.0)  # settled, nothing left held
    assert await gw.store.events("t/doomed") == []  # no trace line of a turn that was not saved


async def test_a_turn_answers_with_the_team_budget_the_store_booked(make_gateway: MakeGateway,
                                                                    aiohttp_server: Any) -> None:
    async def chat(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(ANSWER), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    upstream = await aiohttp_server(app)
    gw = await make_gateway(
        upstreams=[{"name": "u", "base_url": str(upstream.make_url("/v1"))}],
        models=[{"match": "*", "upstream": "u", "price_in": 2.0, "price_out": 12.0}],
        team={"budget_usd": 5.0, "budget_period": "total"},
    )
    for turn in (1, 2):
        status, headers, body = await gw.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                              run_id="r1")
        assert status == 200, body
        assert headers["X-Run-Turns"] == str(turn)
        assert float(headers["X-Team-Budget-Remaining-Usd"]) == round(5.0 - turn * PRICE.cost(USAGE), 9)
    assert [e["type"] for _, e in await gw.store.events("t/r1")] == ["upstream_attempt", "turn", "run_stopped"] * 2
