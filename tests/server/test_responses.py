"""The Responses API with the real OpenAI SDK against a real `python -m gateway serve` process.

The client runs the plan task (list, read, answer) as a Responses conversation chained by
previous_response_id, executing the file tools locally, and sends no X-Run-Id: the chain
of responses is the run, so its turns, cost and caps are the run's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from gateway.harness.usage import Price, Usage
from gateway.providers.scenarios import PLAN_ANSWER
from gateway.store import open_store
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, fresh_sandbox
from tests.server.conftest import KEY, OTHER_KEY, config_data, run_tools_locally, write_config
from tests.support.procs import Proc, free_port, start_gateway

TOOLS: list[Any] = [{"type": "function", **t.openai()["function"]} for t in FILE_TOOLS]
PRICE = Price(2.0, 12.0)


def serve(folder: Path, data: dict[str, Any]) -> Proc:
    port = free_port()
    data["server"] = {**data.get("server", {}), "host": "127.0.0.1", "port": port}
    data["teams"][0]["policies"].append("two")
    path = write_config(folder, data)
    (folder / "policies" / "two.yaml").write_text(yaml.safe_dump(
        {"name": "two", "description": "two turns", "limits": {"max_turns": 2, "max_budget_usd": 1.0}}))
    return start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = serve(tmp_path_factory.mktemp("responses") / "gw", config_data(other={"budget_usd": 0.00001}))
    yield proc
    proc.stop()


def sdk(proc: Proc, key: str = KEY, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0, default_headers=headers)


async def load_run(proc: Proc, run_id: str, team: str = "t") -> Any:
    """A run of team `team` (key KEY's) by the id its client knows (stored as team/id)."""
    store = open_store({"kind": "sqlite", "path": str(Path(proc.log).parent / "gateway.db")})
    try:
        return await store.load_run(run_id if "/" in run_id else f"{team}/{run_id}")
    finally:
        await store.close()


def as_chat_message(response: Any) -> dict[str, Any]:
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in response.output if i.type == "function_call"]
    return {"role": "assistant", "content": response.output_text or None, "tool_calls": calls}


async def outputs(sandbox: Sandbox, response: Any) -> list[dict[str, Any]]:
    results = await run_tools_locally(sandbox, as_chat_message(response))
    return [{"type": "function_call_output", "call_id": r["tool_call_id"], "output": r["content"]} for r in results]


async def plan_chain(client: openai.AsyncOpenAI, sandbox: Sandbox, *, stream: bool) -> list[Any]:
    """The plan task as chained responses; returns each response (as the SDK parsed it)."""
    got: list[Any] = []
    items: Any = PLAN_TASK
    previous = None
    for _ in range(5):
        kwargs: dict[str, Any] = {"model": "scripted-plan", "instructions": SYSTEM_PROMPT, "input": items,
                                  "tools": TOOLS}
        if previous is not None:
            kwargs["previous_response_id"] = previous
        if stream:
            async with client.responses.stream(**kwargs) as events:
                kinds = [event.type async for event in events]
                response = await events.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        else:
            response = await client.responses.create(**kwargs)
        got.append(response)
        previous = response.id
        items = await outputs(sandbox, response)
        if not items:
            break
    return got


@pytest.mark.parametrize("stream", [False, True])
async def test_the_plan_task_as_a_chain_of_responses_is_one_run_priced_like_chat(gateway: Proc, tmp_path: Path,
                                                                                 stream: bool) -> None:
    sandbox = Sandbox(fresh_sandbox(tmp_path / "sandbox"))
    chain = await plan_chain(sdk(gateway), sandbox, stream=stream)
    assert [r.output[0].type for r in chain] == ["function_call", "function_call", "message"]
    assert chain[0].output[0].name == "list_files" and chain[0].output[0].call_id == f"call_{chain[0].id[5:]}_c1"
    assert json.loads(chain[1].output[0].arguments) == {"path": "errors.log"}
    assert chain[-1].output_text == PLAN_ANSWER and chain[-1].status == "completed"
    assert all(r.id.startswith("resp_") and r.object == "response" for r in chain)
    if stream:
        runs = {await stored_run_id(gateway, r.id) for r in chain}
    else:
        runs = {r.model_extra["run"]["id"] for r in chain}  # type: ignore[index]
    (run_id,) = runs
    usages = [Usage(r.usage.input_tokens, r.usage.output_tokens) for r in chain]
    assert all(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens for r in chain)
    # the same conversation over chat completions, as a client would send it
    chat = sdk(gateway, **{"X-Run-Id": f"chat-twin-{stream}"})
    messages: list[Any] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]
    chat_tools: Any = [t.openai() for t in FILE_TOOLS]
    twin = Sandbox(fresh_sandbox(tmp_path / "twin"))
    chat_usages = []
    for _ in range(5):
        completion = await chat.chat.completions.create(model="scripted-plan", messages=messages, tools=chat_tools)
        assert completion.usage is not None
        chat_usages.append(Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens))
        message = completion.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        messages.extend(await run_tools_locally(twin, message))
    assert usages == chat_usages
    twin_run = await load_run(gateway, f"chat-twin-{stream}")
    run = await load_run(gateway, run_id)
    assert run.turns == 3 and run.per_turn == usages and run.status == "completed"
    assert run.cost_usd == pytest.approx(twin_run.cost_usd, abs=1e-12)
    assert run.cost_usd == pytest.approx(sum(PRICE.cost(u) for u in usages), abs=1e-12)


async def stored_run_id(proc: Proc, response_id: str) -> str:
    """The run a stored response belongs to (a stream's final event carries no `run` object)."""
    store = open_store({"kind": "sqlite", "path": str(Path(proc.log).parent / "gateway.db")})
    try:
        got = await store.get_response(response_id)
    finally:
        await store.close()
    assert got is not None
    return str(json.loads(got[1])["run_id"])


async def test_a_streamed_create_sends_typed_events_in_sequence_without_done(gateway: Proc) -> None:
    stream = await sdk(gateway).responses.create(model="scripted-plan", input=PLAN_TASK, tools=TOOLS, stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == final.output[0].arguments
    assert final.output[0].name == "list_files" and final.usage is not None and final.usage.output_tokens > 0


async def test_the_chain_is_the_run_so_its_turn_cap_holds_without_x_run_id(gateway: Proc, tmp_path: Path) -> None:
    client = sdk(gateway)
    first = await client.responses.create(model="scripted-runaway", input="go", tools=TOOLS,
                                          extra_headers={"X-Policy": "two"})
    second = await client.responses.create(model="scripted-runaway", previous_response_id=first.id, tools=TOOLS,
                                           input=[{"type": "function_call_output", "call_id": "c1", "output": "a"}])
    assert second.model_extra is not None and second.model_extra["run"]["turns"] == 2
    with pytest.raises(openai.RateLimitError) as refused:
        await client.responses.create(model="scripted-runaway", previous_response_id=second.id, tools=TOOLS,
                                      input=[{"type": "function_call_output", "call_id": "c2", "output": "b"}])
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert refused.value.code == "max_turns_exceeded"
    run = await load_run(gateway, first.model_extra["run"]["id"])  # type: ignore[index]
    assert run.turns == 2 and run.status == "max_turns_exceeded"


async def test_a_team_budget_refusal_forwards_and_stores_nothing(gateway: Proc) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        await sdk(gateway, OTHER_KEY).responses.create(model="scripted-plan", input="hi")
    assert refused.value.code == "team_budget_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
])
async def test_bad_input_is_a_400_naming_the_field_and_nothing_is_booked(gateway: Proc, extra: dict[str, Any],
                                                                         param: str) -> None:
    kwargs: dict[str, Any] = {"model": "scripted-plan", "input": "hi", **extra}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as bad:
        await sdk(gateway, **{"X-Run-Id": "bad-input"}).responses.create(**kwargs)
    assert bad.value.param == param, bad.value.message
    text = json.dumps(bad.value.body)
    assert param in text and "Error" not in text and "Traceback" not in text
    assert await load_run(gateway, "bad-input") is None


async def test_get_and_delete_a_stored_response_and_another_team_gets_404(gateway: Proc) -> None:
    client, other = sdk(gateway), sdk(gateway, OTHER_KEY)
    created = await client.responses.create(model="scripted-plan", input=PLAN_TASK, tools=TOOLS,
                                            metadata={"case": "get"})
    fetched = await client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output[0].call_id == created.output[0].call_id and fetched.metadata == {"case": "get"}
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as continued:
        await other.responses.create(model="scripted-plan", input="x", previous_response_id=created.id)
    assert continued.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(created.id)
    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    unstored = await client.responses.create(model="scripted-plan", input=PLAN_TASK, tools=TOOLS, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_models_retrieve_names_a_routed_model_and_404s_another(gateway: Proc) -> None:
    client = sdk(gateway)
    model = await client.models.retrieve("scripted-plan")
    assert model.id == "scripted-plan" and model.owned_by == "scripted"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-nope")
    assert missing.value.code == "model_not_found"


async def test_a_client_that_replays_its_history_continues_the_run_its_items_came_from(gateway: Proc,
                                                                                      tmp_path: Path) -> None:
    """The Agents SDK's default: no previous_response_id, the whole history sent each turn
    (the output items as it got them, ids included)."""
    sandbox = Sandbox(fresh_sandbox(tmp_path / "sandbox"))
    client = sdk(gateway)
    history: list[Any] = [{"role": "user", "content": PLAN_TASK}]
    runs = []
    for _ in range(5):
        response = await client.responses.create(model="scripted-plan", instructions=SYSTEM_PROMPT, input=history,
                                                 tools=TOOLS)
        runs.append(response.model_extra["run"]["id"])  # type: ignore[index]
        history += [item.model_dump(exclude_unset=True) for item in response.output]
        results = await outputs(sandbox, response)
        if not results:
            break
        history += results
    assert response.output_text == PLAN_ANSWER
    assert len(runs) == 3 and len(set(runs)) == 1
    run = await load_run(gateway, runs[0])
    assert run.turns == 3 and run.status == "completed"
    with pytest.raises(openai.RateLimitError) as refused:  # the same history under a cap of two turns
        history = [{"role": "user", "content": "go"}]
        for _ in range(3):
            response = await client.responses.create(model="scripted-runaway", input=history, tools=TOOLS,
                                                     extra_headers={"X-Policy": "two"})
            history += [item.model_dump(exclude_unset=True) for item in response.output]
            history += [{"type": "function_call_output", "call_id": response.output[0].call_id,  # type: ignore[union-attr]
                         "output": "a.txt"}]
    assert refused.value.code == "max_turns_exceeded" and len(history) == 5


@pytest.mark.parametrize("stream", [False, True])
async def test_max_output_tokens_cuts_the_answer_and_the_response_says_incomplete(gateway: Proc,
                                                                                  stream: bool) -> None:
    done: list[Any] = [{"role": "user", "content": PLAN_TASK}]
    for n in (1, 2):  # two tool rounds already done: the script answers in prose now
        done += [{"type": "function_call", "call_id": f"c{n}", "name": "list_files", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": f"c{n}", "output": "errors.log"}]
    client = sdk(gateway)
    kwargs: dict[str, Any] = {"model": "scripted-plan", "input": done, "tools": TOOLS, "max_output_tokens": 3}
    if stream:
        events = [e async for e in await client.responses.create(stream=True, **kwargs)]
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = await client.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and 0 < response.usage.output_tokens <= 3
    assert response.output_text and PLAN_ANSWER.startswith(response.output_text)


async def test_another_openai_path_is_a_404_naming_what_the_gateway_serves(gateway: Proc) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk(gateway).files.list()
    text = json.dumps(missing.value.body)
    assert "GET /v1/files" in text and "POST /v1/responses" in text and "POST /v1/chat/completions" in text
    assert "GET|DELETE /v1/responses/{id}" in text and missing.value.code == "route_not_found"


async def test_a_stream_the_upstream_cuts_ends_with_response_failed_and_the_part_received_is_booked(
        gateway: Proc) -> None:
    done: list[Any] = [{"role": "user", "content": PLAN_TASK}]
    for n in (1, 2):
        done += [{"type": "function_call", "call_id": f"c{n}", "name": "list_files", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": f"c{n}", "output": "errors.log"}]
    client = sdk(gateway, **{"X-Run-Id": "cut-stream", "X-Scripted-Fail": "cut"})
    stream = await client.responses.create(model="scripted-plan", input=done, tools=TOOLS, stream=True)
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    assert events[-1].response.error is not None and events[-1].response.error.code == "upstream_cut"
    assert "response.output_text.delta" in {e.type for e in events}
    run = await load_run(gateway, "cut-stream")
    assert run.turns == 1 and run.cost_usd > 0
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored: nothing to continue
        await sdk(gateway).responses.retrieve(events[-1].response.id)


async def test_models_retrieve_of_a_name_the_scripted_glob_matches_but_does_not_play_is_404(gateway: Proc) -> None:
    with pytest.raises(openai.NotFoundError):
        await sdk(gateway).models.retrieve("scripted-nothing")


def requests_counted(proc: Proc, route: str, code: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(proc.url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_requests_total{") and f'code="{code}"' in line and f'route="{route}"' in line)


async def test_an_operator_chosen_refusal_status_stops_a_retrying_client_at_the_first_refusal(tmp_path: Path) -> None:
    proc = serve(tmp_path / "gw", config_data(server={"refusal_status": 402}))
    try:
        # the SDK's default retries: a 402 is not retried whatever the headers say
        client = openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key=KEY)
        first = await client.responses.create(model="scripted-runaway", input="go", tools=TOOLS,
                                              extra_headers={"X-Policy": "two"})
        second = await client.responses.create(model="scripted-runaway", previous_response_id=first.id, tools=TOOLS,
                                               input=[{"type": "function_call_output", "call_id": "c1", "output": "a"}])
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(model="scripted-runaway", previous_response_id=second.id, tools=TOOLS,
                                          input=[{"type": "function_call_output", "call_id": "c2", "output": "b"}])
        assert refused.value.status_code == 402
        body = refused.value.body
        assert isinstance(body, dict) and body["type"] == body["code"] == "max_turns_exceeded"
        assert requests_counted(proc, "/v1/responses", 402) == 1
    finally:
        proc.stop()


async def test_a_history_replayed_the_ai_sdk_way_continues_the_run(gateway: Proc) -> None:
    """Vercel's `ai` SDK replays function calls without item ids (their call ids name the
    response) and earlier assistant text as `item_reference`s to stored items."""
    client = sdk(gateway)
    first = await client.responses.create(model="scripted-plan", input=PLAN_TASK, tools=TOOLS)
    call = first.output[0]
    assert call.type == "function_call"
    history: list[Any] = [{"role": "user", "content": PLAN_TASK},
                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
                          {"type": "function_call_output", "call_id": call.call_id, "output": "errors.log"}]
    second = await client.responses.create(model="scripted-plan", input=history, tools=TOOLS)
    assert second.model_extra is not None and first.model_extra is not None
    assert second.model_extra["run"]["id"] == first.model_extra["run"]["id"]
    assert second.model_extra["run"]["turns"] == 2
    answer = await client.responses.create(model="scripted-plan", tools=TOOLS, input=[
        *history, {"type": "function_call", "call_id": second.output[0].call_id,  # type: ignore[union-attr]
                   "name": "read_file", "arguments": "{}"},
        {"type": "function_call_output", "call_id": second.output[0].call_id, "output": "timeout"}])  # type: ignore[union-attr]
    assert answer.output_text == PLAN_ANSWER
    follow_up = [{"role": "user", "content": "And then?"}]
    referenced = await client.responses.create(model="scripted-plan", tools=TOOLS, input=[
        *history, {"type": "item_reference", "id": answer.output[0].id}, *follow_up])
    assert referenced.model_extra is not None and referenced.model_extra["run"]["turns"] == 4
    with pytest.raises(openai.BadRequestError) as unknown:
        await client.responses.create(model="scripted-plan", input=[
            {"type": "item_reference", "id": "msg_" + "0" * 32 + "_0"}, *follow_up])
    assert unknown.value.param == "input[0].id"
    with pytest.raises(openai.BadRequestError) as foreign:  # another team's item is unknown to this team
        await sdk(gateway, OTHER_KEY).responses.create(model="scripted-plan", input=[
            {"type": "item_reference", "id": answer.output[0].id}, *follow_up])
    assert foreign.value.param == "input[0].id"


async def test_a_replayed_history_with_store_false_still_continues_the_run(gateway: Proc) -> None:
    client = sdk(gateway)
    first = await client.responses.create(model="scripted-plan", input=PLAN_TASK, tools=TOOLS, store=False)
    call = first.output[0]
    assert call.type == "function_call"
    second = await client.responses.create(model="scripted-plan", tools=TOOLS, store=False, input=[
        {"role": "user", "content": PLAN_TASK}, call.model_dump(exclude_unset=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "errors.log"}])
    assert second.model_extra is not None and first.model_extra is not None
    assert second.model_extra["run"]["id"] == first.model_extra["run"]["id"]
    with pytest.raises(openai.NotFoundError):  # nothing of it is kept to fetch or continue
        await client.responses.create(model="scripted-plan", input="more", previous_response_id=first.id)
