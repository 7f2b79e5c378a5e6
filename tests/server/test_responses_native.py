"""A Responses call routed to an upstream that speaks the Responses API itself (`api:
responses`), through a real gateway process with the real OpenAI SDK. The upstream here is
a small real HTTP server that answers like one: a function call first, then text; it
records what it gets. The gateway sends it the whole conversation with `store: false`
(the chain is kept by the gateway), books its usage exactly, and re-issues its answer
under the gateway's own ids, streamed or not. One upstream and one gateway serve the
module's tests (on the module's event loop); each test sees only the calls it caused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.harness.usage import Price, Usage
from tests.server.conftest import config_data
from tests.server.test_responses import TOOLS, load_run, sdk, serve, stored_run_id
from tests.support.procs import Proc, free_port
from tests.support.upstreams import answer_response, response_of

pytestmark = pytest.mark.asyncio(loop_scope="module")
PRICE = Price(2.0, 12.0)
SEEN = web.AppKey("seen", list)


def answer_for(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
    last = body["input"][-1]
    if last.get("type") == "function_call_output":
        output = [{"id": "msg_up", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": f"done: {last['output']}", "annotations": []}]}]
    else:  # asked so, a small model's call: the tool's schema echoed as its arguments
        args = '{"type": "object", "properties": {}}' if last.get("content") == "echo the schema" else "{}"
        output = [{"id": "fc_up", "type": "function_call", "status": "completed", "call_id": "n1",
                   "name": "list_files", "arguments": args}]
    return output, Usage(100 + 10 * len(body["input"]), 7)


async def native(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[SEEN].append(body)
    output, usage = answer_for(body)
    return await answer_response(request, body, response_of(output, (usage.prompt_tokens, usage.completion_tokens),
                                                            body["model"]))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def native_server() -> AsyncIterator[tuple[web.Application, str]]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/responses", native)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield app, f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


@pytest.fixture
def upstream(native_server: tuple[web.Application, str]) -> web.Application:
    """The module's upstream app, its record cleared: the test sees only its own calls."""
    app = native_server[0]
    app[SEEN].clear()
    return app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(native_server: tuple[web.Application, str],
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Proc]:
    data = config_data(upstreams=[{"name": "native", "base_url": native_server[1], "api": "responses"}],
                       models=[{"match": "*", "upstream": "native", "price_in": 2.0, "price_out": 12.0}])
    proc = await asyncio.to_thread(serve, tmp_path_factory.mktemp("native") / "gw", data)
    yield proc
    proc.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_native_upstream_gets_the_whole_conversation_and_its_usage_is_booked(
        upstream: web.Application, gateway: Proc, stream: bool) -> None:
    client = sdk(gateway)

    async def create(**kwargs: Any) -> Any:
        if not stream:
            return await client.responses.create(model="native-1", tools=TOOLS, **kwargs)
        async with client.responses.stream(model="native-1", tools=TOOLS, **kwargs) as events:
            async for _ in events:
                pass
            return await events.get_final_response()

    first = await create(input="list them", instructions="Be brief.")
    call = first.output[0]
    assert call.type == "function_call" and call.name == "list_files" and call.call_id == f"call_{first.id[5:]}_n1"
    second = await create(previous_response_id=first.id,
                          input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}])
    assert second.output_text == "done: a.txt" and second.id != "resp_upstream"
    seen = upstream[SEEN]
    assert [b.get("store") for b in seen] == [False, False] and all("previous_response_id" not in b for b in seen)
    assert seen[0]["instructions"] == "Be brief." and "instructions" not in seen[1]  # not carried over
    assert seen[1]["input"] == [{"role": "user", "content": "list them"},
                                {"type": "function_call", "call_id": "n1", "name": "list_files", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "n1", "output": "a.txt"}]
    usages = [Usage(r.usage.input_tokens, r.usage.output_tokens) for r in (first, second)]
    assert usages == [Usage(110, 7), Usage(130, 7)]
    run = await load_run(gateway, await stored_run_id(gateway, second.id))
    assert run.turns == 2 and run.per_turn == usages
    assert run.cost_usd == pytest.approx(sum(PRICE.cost(u) for u in usages), abs=1e-12)


async def test_a_native_upstream_gets_the_strict_clamp_as_max_output_tokens(upstream: web.Application,
                                                                            gateway: Proc) -> None:
    client = sdk(gateway, **{"X-Policy": "strict"})
    await client.responses.create(model="native-1", input="list them", max_output_tokens=100_000)
    clamp = upstream[SEEN][-1]["max_output_tokens"]
    assert 0 < clamp < 100_000
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="native-1", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def repairing(native_server: tuple[web.Application, str],
                    tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Proc]:
    """A gateway whose native upstream has `tool_repair`."""
    data = config_data(upstreams=[{"name": "native", "base_url": native_server[1], "api": "responses",
                                   "tool_repair": True}],
                       models=[{"match": "*", "upstream": "native", "price_in": 2.0, "price_out": 12.0}])
    proc = await asyncio.to_thread(serve, tmp_path_factory.mktemp("repairing") / "gw", data)
    yield proc
    proc.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_native_upstreams_function_call_is_repaired_with_tool_repair(repairing: Proc, stream: bool) -> None:
    client = sdk(repairing)
    if stream:
        async with client.responses.stream(model="native-1", tools=TOOLS, input="echo the schema") as events:
            async for _ in events:
                pass
            response = await events.get_final_response()
    else:
        response = await client.responses.create(model="native-1", tools=TOOLS, input="echo the schema")
    call = response.output[0]
    assert call.type == "function_call" and call.name == "list_files" and call.arguments == "{}"
    run = await load_run(repairing, await stored_run_id(repairing, response.id))
    assert run.messages[-1]["tool_calls"][0]["function"]["arguments"] == "{}"  # booked repaired
