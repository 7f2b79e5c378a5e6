"""Bad input: a clear 4xx in the OpenAI error shape, and the store exactly as it was."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.harness.state import scoped_run_id
from gateway.server import context as ctx

from tests.server.conftest import KEY, OTHER_KEY, PLAN_USER, Gateway, MakeGateway

GOOD: dict[str, Any] = {"model": "scripted-plan", "messages": [PLAN_USER]}


async def snapshot(gw: Gateway) -> Any:
    runs = await gw.store.list_runs(limit=1000)
    events = {r.run_id: await gw.store.events(r.run_id) for r in runs}
    ledger = {t.name: await gw.store.team_spend(t.name, gw.app[ctx.GOVERNOR].period(t)) for t in gw.config.teams}
    return [r.to_json() for r in runs], events, ledger


def assert_openai_error(status: int, body: Any, expected_status: int, *, type_: str, code: str | None = None,
                        param: str | None = None, mentions: str = "") -> None:
    assert status == expected_status, body
    assert set(body) >= {"error"} and set(body["error"]) == {"message", "type", "code", "param"}, body
    error = body["error"]
    assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert mentions.lower() in error["message"].lower(), error


async def post_raw(gw: Gateway, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    async with gw.client.post("/v1/chat/completions", data=data, headers=h) as resp:
        return resp.status, orjson.loads(await resp.read())


@pytest.fixture
async def seeded(gw: Gateway) -> Gateway:
    """A gateway where team `o` owns run `theirs` and team `t` owns run `ours` (policy capped)."""
    status, _, _ = await gw.chat(GOOD, key=OTHER_KEY, run_id="theirs")
    assert status == 200
    status, _, _ = await gw.chat(GOOD, run_id="ours", headers={"X-Policy": "capped"})
    assert status == 200
    return gw


BODY_CASES = [
    (b"{not json", 400, "invalid_json", None, "not valid JSON"),
    (b"", 400, "invalid_json", None, "empty"),
    (b"[1, 2]", 400, "invalid_json", None, "JSON object"),
    (orjson.dumps({"messages": [PLAN_USER]}), 400, "missing_field", "model", "model"),
    (orjson.dumps({"model": "scripted-plan"}), 400, "missing_field", "messages", "messages"),
    (orjson.dumps({"model": 7, "messages": [PLAN_USER]}), 400, "invalid_type", "model", "string"),
    (orjson.dumps({"model": "scripted-plan", "messages": "hi"}), 400, "invalid_type", "messages", "array"),
    (orjson.dumps({"model": "scripted-plan", "messages": []}), 400, "invalid_value", "messages", "at least one"),
    (orjson.dumps({"model": "scripted-plan", "messages": ["hi"]}), 400, "invalid_type", "messages[0]", "object"),
    (orjson.dumps({"model": "scripted-plan", "messages": [{"content": "x"}]}), 400, "invalid_value",
     "messages[0].role", "role"),
    (orjson.dumps({**GOOD, "stream": "yes"}), 400, "invalid_type", "stream", "boolean"),
    (orjson.dumps({**GOOD, "max_tokens": "10"}), 400, "invalid_type", "max_tokens", "integer"),
    (orjson.dumps({**GOOD, "max_tokens": 1.5}), 400, "invalid_type", "max_tokens", "integer"),
    (orjson.dumps({**GOOD, "max_tokens": 0}), 400, "invalid_value", "max_tokens", ">= 1"),
    (orjson.dumps({**GOOD, "max_completion_tokens": True}), 400, "invalid_type", "max_completion_tokens", "integer"),
    (orjson.dumps({**GOOD, "tools": {"a": 1}}), 400, "invalid_type", "tools", "array"),
    (orjson.dumps({**GOOD, "stream": True, "stream_options": {"include_usage": "y"}}), 400, "invalid_type",
     "stream_options.include_usage", "boolean"),
    (orjson.dumps({**GOOD, "stream_options": {"include_usage": True}}), 400, "invalid_value", "stream_options",
     "stream is true"),
]


@pytest.mark.parametrize(("data", "status", "code", "param", "mentions"), BODY_CASES)
async def test_bad_bodies(seeded: Gateway, data: bytes, status: int, code: str, param: str | None,
                          mentions: str) -> None:
    before = await snapshot(seeded)
    got_status, body = await post_raw(seeded, data, {"X-Run-Id": "ours"})
    assert_openai_error(got_status, body, status, type_="invalid_request_error", code=code, param=param,
                        mentions=mentions)
    assert await snapshot(seeded) == before


async def test_unknown_model_is_404_model_not_found(seeded: Gateway) -> None:
    before = await snapshot(seeded)
    status, _, body = await seeded.chat({**GOOD, "model": "gpt-nonexistent"}, run_id="new-run")
    assert_openai_error(status, body, 404, type_="not_found_error", code="model_not_found", param="model",
                        mentions="gpt-nonexistent")
    assert await snapshot(seeded) == before


async def test_body_over_the_limit_is_413(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(server={"max_body_bytes": 2048})
    before = await snapshot(gw)
    big = orjson.dumps({"model": "scripted-plan", "messages": [{"role": "user", "content": "x" * 4096}]})
    status, body = await post_raw(gw, big)
    assert_openai_error(status, body, 413, type_="invalid_request_error", code="body_too_large", mentions="2048")
    assert await snapshot(gw) == before
    # just under the limit is fine
    status, _ = await post_raw(gw, orjson.dumps({"model": "scripted-plan", "messages": [PLAN_USER]}))
    assert status == 200


@pytest.mark.parametrize(("header", "mentions"), [
    (None, "missing Authorization"),
    ("Bearer sk-wrong", "invalid API key"),
    ("Basic abc", "Bearer"),
    ("Bearer ", "Bearer"),
])
async def test_missing_or_wrong_key_is_401(seeded: Gateway, header: str | None, mentions: str) -> None:
    before = await snapshot(seeded)
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    async with seeded.client.post("/v1/chat/completions", data=orjson.dumps(GOOD), headers=headers) as resp:
        status, body = resp.status, await resp.json()
    assert_openai_error(status, body, 401, type_="authentication_error", code="invalid_api_key", mentions=mentions)
    assert await snapshot(seeded) == before


async def test_run_ids_are_per_team_so_another_teams_id_is_a_run_of_ones_own(seeded: Gateway) -> None:
    status, headers, body = await seeded.chat(GOOD, run_id="theirs")  # team o has a run "theirs" too
    assert status == 200 and headers["X-Run-Id"] == "theirs" and headers["X-Run-Turns"] == "1", body
    mine = await seeded.store.load_run(scoped_run_id("t", "theirs"))
    theirs = await seeded.store.load_run(scoped_run_id("o", "theirs"))
    assert mine is not None and theirs is not None and (mine.team, theirs.team) == ("t", "o")
    assert theirs.turns == 1  # untouched by team t's call
    async with seeded.client.get("/v1/runs/theirs", headers={"Authorization": f"Bearer {OTHER_KEY}"}) as resp:
        shown = orjson.loads(await resp.read())
    assert resp.status == 200 and shown["id"] == "theirs" and shown["team"] == "o"


async def test_policy_not_allowed_for_the_team_is_403(seeded: Gateway) -> None:
    before = await snapshot(seeded)
    status, _, body = await seeded.chat(GOOD, key=OTHER_KEY, run_id="o-new", headers={"X-Policy": "capped"})
    assert_openai_error(status, body, 403, type_="permission_error", code="policy_not_allowed",
                        mentions="not allowed for team 'o'")
    assert await snapshot(seeded) == before


async def test_changing_the_policy_of_an_existing_run_is_400(seeded: Gateway) -> None:
    before = await snapshot(seeded)
    status, headers, body = await seeded.chat(GOOD, run_id="ours", headers={"X-Policy": "passthrough"})
    assert_openai_error(status, body, 400, type_="invalid_request_error", code="policy_mismatch",
                        mentions="'capped'")
    assert headers["X-Run-Id"] == "ours" and headers["X-Run-Turns"] == "1"  # errors on a run carry its headers
    assert await snapshot(seeded) == before


async def test_malformed_run_id_is_400(seeded: Gateway) -> None:
    before = await snapshot(seeded)
    status, _, body = await seeded.chat(GOOD, run_id="../etc/passwd")
    assert_openai_error(status, body, 400, type_="invalid_request_error", param="X-Run-Id", mentions="X-Run-Id")
    assert await snapshot(seeded) == before


async def test_unknown_route_and_wrong_method_use_the_same_shape(gw: Gateway) -> None:
    async with gw.client.get("/v1/nothing-here") as resp:
        assert_openai_error(resp.status, await resp.json(), 404, type_="not_found_error", code="route_not_found")
    async with gw.client.get("/v1/chat/completions") as resp:
        assert_openai_error(resp.status, await resp.json(), 405, type_="invalid_request_error", mentions="POST")
