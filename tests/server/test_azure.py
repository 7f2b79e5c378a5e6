"""`kind: azure` against a fake Azure OpenAI resource (tests/support/azure.py) through a real
gateway process: the api-key header, the api-version query and the deployment path on
every call (chat streamed and not, tools, embeddings), the content filter's refusal and
verdicts passed on as Azure gave them, a 429's `retry-after-ms` waited for by the route's
retry, and the openai SDK and the Agents SDK working unchanged (only the base URL differs).
Secrets from the environment (the key, a header) reach the upstream and nothing else: not
the trace file, the log, /metrics or the database."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.server.conftest import KEY, config_data, write_config
from tests.server.test_agents_sdk import sdk
from tests.support import azure
from tests.support.procs import Proc, free_port, start_gateway
from tests.support.upstreams import in_thread

TENANT_SECRET = "tenant-secret-5b9e1d20c4"
WRONG_KEY = "wrong-key-e81a"
ENV = {"GW_TEST_AZURE_KEY": azure.KEY, "GW_TEST_TENANT_SECRET": TENANT_SECRET, "GW_TEST_WRONG_KEY": WRONG_KEY}


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[azure.FakeAzure, str]]:
    resource = azure.FakeAzure()
    with in_thread(resource.app) as root:
        yield resource, root


def serve(folder: Path, upstreams: list[dict[str, Any]], models: list[dict[str, Any]]) -> Proc:
    """A gateway process with these upstreams and routes, ENV in its environment."""
    port = free_port()
    data = config_data(server={"port": port}, upstreams=upstreams, models=models)
    return start_gateway(["serve", "--config", str(write_config(folder, data))], "/healthz", port,
                         folder / "gateway.log", env=ENV)


@pytest.fixture(scope="module")
def gateway(fake: tuple[azure.FakeAzure, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    _, root = fake
    base = {"kind": "azure", "base_url": root}
    proc = serve(
        tmp_path_factory.mktemp("azure") / "gw",
        upstreams=[{"name": "azure", **base, "api_key_env": "GW_TEST_AZURE_KEY",
                    "headers": {"X-Tenant-Secret": {"env": "GW_TEST_TENANT_SECRET"}, "X-Team": "research"}},
                   {"name": "azure_unset", **base, "api_key_env": "GW_TEST_AZURE_KEY",
                    "headers": {"X-Missing": {"env": "GW_TEST_NEVER_SET"}}},
                   {"name": "azure_wrong_key", **base, "api_key_env": "GW_TEST_WRONG_KEY"}],
        models=[{"match": "gpt-4o", "deployments": [{"upstream": "azure", "model": "gpt4o-prod"}],
                 "price_in": 2.5, "price_out": 10.0},
                {"match": "text-embedding-3-small", "deployments": [{"upstream": "azure", "model": "embed-prod"}],
                 "price_in": 0.02},
                {"match": "gpt4o-prod", "upstream": "azure"},  # a route named after its deployment
                {"match": "unset-model", "deployments": [{"upstream": "azure_unset", "model": "gpt4o-prod"}]},
                {"match": "wrong-key", "deployments": [{"upstream": "azure_wrong_key", "model": "gpt4o-prod"}]}])
    yield proc
    proc.stop()


def client(gateway: Proc, run_id: str | None = None) -> openai.AsyncOpenAI:
    """The SDK at its defaults but for retries (use it in `async with`: it closes its connections)."""
    headers = {"X-Run-Id": run_id} if run_id else {}
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, default_headers=headers)


def assert_azure_call(call: dict[str, Any], deployment: str, api: str = "chat/completions") -> None:
    """What Azure requires of every call: the deployment's path, the api-version, the api-key."""
    assert call["path"] == f"/openai/deployments/{deployment}/{api}"
    assert call["query"] == {"api-version": azure.API_VERSION}
    assert call["headers"]["api-key"] == azure.KEY and "authorization" not in call["headers"]
    assert call["headers"]["x-tenant-secret"] == TENANT_SECRET and call["headers"]["x-team"] == "research"


async def post(gateway: Proc, path: str, body: dict[str, Any], run_id: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            gateway.url + path, data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id}) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def ask(gateway: Proc, model: str, content: str, run_id: str,
              **extra: Any) -> tuple[int, dict[str, str], bytes]:
    """POST one user message as a chat completion."""
    return await post(gateway, "/v1/chat/completions",
                      {"model": model, "messages": [{"role": "user", "content": content}], **extra}, run_id)


async def test_chat_goes_to_the_deployment_with_key_and_version_and_azure_fields_pass_unchanged(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    status, headers, raw = await ask(gateway, "gpt-4o", "hi", "az-plain")
    assert status == 200, raw
    body = orjson.loads(raw)
    assert body["choices"][0]["message"]["content"] == "Hello from gpt4o-prod."
    assert body["prompt_filter_results"] == azure.PROMPT_FILTER_RESULTS
    assert body["choices"][0]["content_filter_results"] == azure.FILTERS_SAFE
    assert body["model"] == azure.MODEL and body["run"]["turns"] == 1 and headers["X-Run-Turns"] == "1"
    [call] = resource.calls[before:]
    assert_azure_call(call, "gpt4o-prod")
    assert call["body"]["model"] == "gpt4o-prod"  # the model map: the deployment's name, in the path and the body


async def test_a_stream_passes_azure_s_choiceless_first_chunk_and_filter_results_on(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    status, _, raw = await ask(gateway, "gpt4o-prod", "FILTER_ANSWER please", "az-stream", stream=True)
    assert status == 200, raw
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    chunks = [orjson.loads(e[6:]) for e in events if e != b"data: [DONE]"]
    assert chunks[0] == {"choices": [], "created": 0, "id": "", "model": "", "object": "",
                         "prompt_filter_results": azure.PROMPT_FILTER_RESULTS}
    finish = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finish[-1]["choices"][0]["finish_reason"] == "content_filter"
    assert finish[-1]["choices"][0]["content_filter_results"] == azure.ANSWER_FILTERED
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Here is how"
    assert events[-1] == b"data: [DONE]" and not any("usage" in c for c in chunks)  # the client did not ask
    [call] = resource.calls[before:]
    assert_azure_call(call, "gpt4o-prod")
    assert call["body"]["stream_options"] == {"include_usage": True}  # the gateway's own ask, for the booking


async def test_an_answer_cut_by_the_filter_is_passed_on_and_booked(gateway: Proc) -> None:
    status, _, raw = await ask(gateway, "gpt-4o", "FILTER_ANSWER", "az-cut")
    body = orjson.loads(raw)
    assert status == 200 and body["choices"][0]["finish_reason"] == "content_filter"
    assert body["choices"][0]["content_filter_results"] == azure.ANSWER_FILTERED
    assert body["run"]["turns"] == 1 and body["run"]["usage"]["completion_tokens"] == 5


async def test_a_content_filter_refusal_is_the_client_s_400_not_retried_not_charged(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with client(gateway, "az-refused") as sdk:
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model="gpt-4o",
                                              messages=[{"role": "user", "content": "FILTER_PROMPT: something"}])
    error = info.value.body
    assert isinstance(error, dict)
    assert info.value.status_code == 400 and info.value.code == "content_filter" and error["param"] == "prompt"
    assert error["innererror"] == azure.REFUSAL["error"]["innererror"]  # type: ignore[index]
    assert "refused the request with its content filter (400)" in error["message"]
    assert len(resource.calls) - before == 1  # a refusal is not retried (the route has retries: 2)
    assert info.value.response.headers["X-Run-Turns"] == "0"


async def test_a_429_s_retry_after_ms_is_waited_for_by_the_route_s_retry(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with client(gateway, "az-throttled") as sdk:
        got = await sdk.chat.completions.create(model="gpt-4o",
                                                messages=[{"role": "user", "content": "THROTTLE once"}])
    assert got.choices[0].message.content == "Hello from gpt4o-prod."
    first, second = resource.calls[before:]
    assert second["t"] - first["t"] >= azure.RETRY_AFTER_MS / 1000  # not sooner than Azure asked
    for call in (first, second):
        assert_azure_call(call, "gpt4o-prod")


async def test_a_429_past_the_route_s_retries_tells_the_client_how_long_to_wait(gateway: Proc) -> None:
    status, headers, raw = await ask(gateway, "gpt4o-prod", "THROTTLE 2", "az-throttled-2")
    error = orjson.loads(raw)["error"]
    assert status == 502 and error["code"] == "upstream_status" and "answered 429" in error["message"]
    assert headers["retry-after-ms"] == str(azure.RETRY_AFTER_MS) and headers["Retry-After"] == "1"


async def test_tools_streamed_and_not_with_the_openai_sdk(gateway: Proc,
                                                          fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    tools: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                          "parameters": {"type": "object", "properties": {}}}}]
    ask: list[Any] = [{"role": "user", "content": "Weather?"}]
    async with client(gateway, "az-tools") as sdk:
        first = await sdk.chat.completions.create(model="gpt-4o", messages=ask, tools=tools)
        [call] = first.choices[0].message.tool_calls or []
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        history = [*ask, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        before = len(resource.calls)
        stream = await sdk.chat.completions.create(model="gpt-4o", messages=history, tools=tools, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "The tool said: sunny"
        [sent] = resource.calls[before:]
        assert_azure_call(sent, "gpt4o-prod")
        assert sent["body"]["tools"] == tools and sent["body"]["messages"][-1]["content"] == "sunny"
    async with aiohttp.ClientSession() as session, session.get(
            gateway.url + "/v1/runs/az-tools", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert (await resp.json())["turns"] == 2  # both calls of the loop are one run


async def test_embeddings_go_to_the_embeddings_deployment(gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with client(gateway, "az-embed") as sdk:
        got = await sdk.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert [d.embedding for d in got.data] == [[0.25, -0.5, 0.0], [0.25, -0.5, 1.0]]
    [call] = resource.calls[before:]
    assert_azure_call(call, "embed-prod", "embeddings")
    assert call["body"] == {"model": "embed-prod", "input": ["a", "b"], "encoding_format": "base64"}


@contextlib.asynccontextmanager
async def weather_agent(gateway: Proc) -> AsyncIterator[tuple[Any, Any]]:
    """The Agents SDK's agent with one tool (`get_weather`: "sunny"), and a run config that
    sends its model calls through `gateway`."""
    @sdk().function_tool
    def get_weather() -> str:
        """The weather now."""
        return "sunny"

    agent = sdk().Agent(name="weather", instructions="Answer with the tool.", model="gpt-4o", tools=[get_weather])
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=KEY) as oa:  # the SDK's defaults otherwise
        yield agent, sdk().RunConfig(model_provider=sdk().models.openai_provider.OpenAIProvider(openai_client=oa),
                                     tracing_disabled=True)


async def test_the_agents_sdk_runs_its_tool_loop_against_azure_through_the_gateway(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with weather_agent(gateway) as (agent, config):
        result = await sdk().Runner.run(agent, "Weather?", run_config=config)
        assert result.final_output == "The tool said: sunny"
        calls = resource.calls[before:]
        assert len(calls) == 2  # its Responses calls, translated to Azure's chat completions
        for call in calls:
            assert_azure_call(call, "gpt4o-prod")
        streamed: Any = sdk().Runner.run_streamed(agent, "Weather?", run_config=config)
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds and streamed.final_output == "The tool said: sunny"


async def test_a_header_variable_that_is_not_set_fails_that_call_naming_it(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    status, _, raw = await ask(gateway, "unset-model", "hi", "az-unset")
    error = orjson.loads(raw)["error"]
    assert status == 502 and error["code"] == "upstream_misconfigured"
    assert error["message"] == ("upstream 'azure_unset': environment variable GW_TEST_NEVER_SET (header X-Missing) "
                                "is not set")
    assert len(resource.calls) == before  # nothing was sent
    ok, _, _ = await ask(gateway, "gpt-4o", "hi", "az-unset-2")
    assert ok == 200  # the gateway and its other upstreams serve on


async def test_a_wrong_key_is_azure_s_401_named(gateway: Proc) -> None:
    status, _, raw = await ask(gateway, "wrong-key", "hi", "az-wrong")
    error = orjson.loads(raw)["error"]
    assert status == 502 and error["code"] == "upstream_status"
    assert error["message"].startswith("upstream 'azure_wrong_key' answered 401: Access denied")


async def test_secrets_from_the_environment_are_nowhere_but_at_the_upstream(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    # calls that succeed, fail, stream and refuse, so every path has written what it writes
    for content, stream in (("hi", False), ("hi", True), ("FILTER_PROMPT", False), ("THROTTLE secrets", False)):
        await ask(gateway, "gpt-4o", content, "az-secret", stream=stream)
    await ask(gateway, "wrong-key", "hi", "az-secret")
    assert any(c["headers"].get("x-tenant-secret") == TENANT_SECRET for c in resource.calls)  # it was sent
    async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as resp:
        metrics = await resp.read()
    folder = gateway.log.parent
    places = {"metrics": metrics, "log": gateway.log.read_bytes(), "trace file": (folder / "trace.jsonl").read_bytes()}
    for db in folder.glob("gateway.db*"):
        places[db.name] = db.read_bytes()
    assert b"az-secret" in places["trace file"]  # the run was traced...
    for secret in (TENANT_SECRET, azure.KEY, WRONG_KEY):
        for where, data in places.items():
            assert secret.encode() not in data, f"{secret} is in the {where}"  # ...without a secret
