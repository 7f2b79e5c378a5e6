"""Server-side mode through the Responses API (real gateway process, real OpenAI SDK): the
gateway runs the policy's tools and answers with one response; the client's own function
tools come back as `function_call` items, and the follow-up (previous_response_id, no
X-Run-Id) continues the same run; exits are honest text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.server.served import PLAN_ANSWER, Served, events, get_run

TASK = "Which file mentions a timeout?"
READ_FILE: Any = {"type": "function", "name": "read_file", "description": "Read a file on the client's machine.",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("responses-harness") / "gw")
    yield gateway
    gateway.proc.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_plan_runs_server_side_in_one_response(served: Served, stream: bool) -> None:
    client = served.openai(**{"X-Policy": "files"})
    if stream:
        async with client.responses.stream(model="scripted-plan", input=TASK) as events_:
            kinds = [e.type async for e in events_]
            response = await events_.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    else:
        response = await client.responses.create(model="scripted-plan", input=TASK)
        assert response.model_extra is not None and response.model_extra["run"]["turns"] == 3
        assert response.model_extra["run"]["status"] == "completed"
    assert response.output_text == PLAN_ANSWER
    assert response.usage is not None and response.usage.input_tokens > 0


async def test_a_client_tool_comes_back_as_a_function_call_and_the_chain_continues_the_run(
        served: Served) -> None:
    client = served.openai(**{"X-Policy": "hybrid"})
    raw = await client.responses.with_raw_response.create(model="scripted-plan", input=TASK, tools=[READ_FILE])
    first = raw.parse()
    run_id = raw.headers["X-Run-Id"]
    assert raw.headers["X-Run-Turns"] == "2"
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "read_file" and call.call_id == f"call_{first.id[5:]}_c2"
    async with aiohttp.ClientSession() as session:
        trace = await events(session, served.url, run_id)
        assert [e["toolName"] for e in trace if e["type"] == "tool_start"] == ["list_files"]  # ran server-side
        plain = served.openai()  # no X-Run-Id, no X-Policy: the chain says which run
        raw = await plain.responses.with_raw_response.create(
            model="scripted-plan", previous_response_id=first.id, tools=[READ_FILE],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "worker 7 timed out (client)"}])
        final = raw.parse()
        assert raw.headers["X-Run-Id"] == run_id and raw.headers["X-Run-Turns"] == "3"
        assert final.output_text == PLAN_ANSWER
        stored = await get_run(session, served.url, run_id)
    assert stored["status"] == "completed"


async def test_an_exit_is_an_honest_sentence(served: Served) -> None:
    client = served.openai(**{"X-Policy": "files"})
    response = await client.responses.create(model="scripted-destructive", input="Free some space")
    assert response.output_text.startswith("The run is waiting for a person to approve delete_file(")
    assert response.model_extra is not None and response.model_extra["run"]["status"] == "interrupted"
