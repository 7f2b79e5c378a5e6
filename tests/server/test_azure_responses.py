"""`kind: azure` with `api: responses` against the fake Azure OpenAI resource
(tests/support/azure.py) through a real gateway process: the openai SDK's Responses calls,
streamed and not, reach Azure's `/openai/responses` with the `api-key` header, the
preview `api-version` and the route's deployment as the body's `model`; the answer comes
back and the turn is booked; a content-filter refusal is the client's 400 as on the chat
path, and an answer cut by the filter an incomplete response; 429's `retry-after-ms` is
waited for; the Agents SDK runs its tool loop on the native path. One resource and one
gateway serve the module; each test reads only the calls it caused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.server.conftest import KEY
from tests.server.test_agents_sdk import sdk
from tests.server.test_azure import client, fake, serve, weather_agent  # fake: this module's own resource (a module fixture)
from tests.support import azure
from tests.support.procs import Proc

PRICE_IN, PRICE_OUT = 2.5, 10.0
COST = (12 * PRICE_IN + 5 * PRICE_OUT) / 1e6  # the fake's usage: 12 tokens in, 5 out


@pytest.fixture(scope="module")
def gateway(fake: tuple[azure.FakeAzure, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = serve(tmp_path_factory.mktemp("azure-responses") / "gw",
                 upstreams=[{"name": "azure", "kind": "azure", "base_url": fake[1],
                             "api_key_env": "GW_TEST_AZURE_KEY", "api": "responses",
                             "api_version": azure.RESPONSES_API_VERSION}],
                 models=[{"match": "gpt-4o", "deployments": [{"upstream": "azure", "model": "gpt4o-prod"}],
                          "price_in": PRICE_IN, "price_out": PRICE_OUT}])
    yield proc
    proc.stop()


def assert_azure_responses_call(call: dict[str, Any], deployment: str = "gpt4o-prod") -> None:
    """What Azure requires of a Responses call: its path, the preview api-version, the
    api-key, and the deployment as the model (the route's model map)."""
    assert call["path"] == "/openai/responses"
    assert call["query"] == {"api-version": azure.RESPONSES_API_VERSION}
    assert call["headers"]["api-key"] == azure.KEY and "authorization" not in call["headers"]
    assert call["body"]["model"] == deployment and call["body"]["store"] is False


async def run_of(gateway: Proc, run_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(
            gateway.url + f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


async def respond(sdk: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> tuple[Any, str]:
    """A response made with `responses.create`, or `responses.stream` (its final response:
    the SDK's, or an incomplete one's last event, which the SDK's helper does not take),
    and the text the client was sent (the stream's deltas)."""
    if not stream:
        got = await sdk.responses.create(model="gpt-4o", **kwargs)
        return got, got.output_text
    async with sdk.responses.stream(model="gpt-4o", **kwargs) as events:
        seen = [e async for e in events]
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        if seen[-1].type == "response.incomplete":
            return seen[-1].response, text
        return await events.get_final_response(), text


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sdk_reaches_azure_responses_with_key_version_and_deployment_and_the_turn_is_booked(
        gateway: Proc, fake: tuple[azure.FakeAzure, str], stream: bool) -> None:
    resource, _ = fake
    before = len(resource.calls)
    run_id = f"azr-hello-{stream}"
    async with client(gateway, run_id) as sdk:
        response, text = await respond(sdk, stream, input="hi", instructions="Be brief.")
    assert text == response.output_text == "Hello from gpt4o-prod."
    assert response.status == "completed" and response.id.startswith("resp_") and response.id != "resp_az1"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (12, 5)  # Azure's own count
    [call] = resource.calls[before:]
    assert_azure_responses_call(call)
    assert call["body"]["input"] == [{"role": "user", "content": "hi"}] and call["body"]["instructions"] == "Be brief."
    assert bool(call["body"].get("stream")) == stream
    run = await run_of(gateway, run_id)
    assert run["turns"] == 1 and run["cost_usd"] == pytest.approx(COST)


async def test_the_run_id_and_figures_come_back_in_the_headers(gateway: Proc,
                                                               fake: tuple[azure.FakeAzure, str]) -> None:
    async with client(gateway, "azr-headers") as sdk:
        raw = await sdk.responses.with_raw_response.create(model="gpt-4o", input="hi")
    assert_azure_responses_call(fake[0].calls[-1])
    assert raw.headers["X-Run-Id"] == "azr-headers" and raw.headers["X-Run-Turns"] == "1"
    assert float(raw.headers["X-Run-Cost-Usd"]) == pytest.approx(COST)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_content_filter_refusal_is_the_client_s_400_as_for_chat(
        gateway: Proc, fake: tuple[azure.FakeAzure, str], stream: bool) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with client(gateway, f"azr-refused-{stream}") as sdk:
        with pytest.raises(openai.BadRequestError) as info:
            await respond(sdk, stream, input="FILTER_PROMPT: something")
    error = info.value.body
    assert isinstance(error, dict)
    assert info.value.status_code == 400 and info.value.code == "content_filter" and error["param"] == "prompt"
    assert error["innererror"] == azure.REFUSAL["error"]["innererror"]  # type: ignore[index]
    assert "refused the request with its content filter (400)" in error["message"]
    assert len(resource.calls) - before == 1  # not retried (the route has retries: 2)
    assert_azure_responses_call(resource.calls[-1])
    assert info.value.response.headers["X-Run-Turns"] == "0"  # nothing booked


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_cut_by_the_filter_is_an_incomplete_response_and_booked(
        gateway: Proc, fake: tuple[azure.FakeAzure, str], stream: bool) -> None:
    run_id = f"azr-cut-{stream}"
    async with client(gateway, run_id) as sdk:
        response, _ = await respond(sdk, stream, input="FILTER_ANSWER")
    assert_azure_responses_call(fake[0].calls[-1])
    assert response.status == "incomplete" and response.incomplete_details.reason == "content_filter"
    assert response.output_text == "Here is how"
    run = await run_of(gateway, run_id)
    assert run["turns"] == 1 and run["cost_usd"] == pytest.approx(COST)


async def test_a_429_s_retry_after_ms_is_waited_for_by_the_route_s_retry(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    before = len(resource.calls)
    async with client(gateway, "azr-throttled") as sdk:
        response = await sdk.responses.create(model="gpt-4o", input="THROTTLE responses")
    assert response.output_text == "Hello from gpt4o-prod."
    first, second = resource.calls[before:]
    assert second["t"] - first["t"] >= azure.RETRY_AFTER_MS / 1000
    for call in (first, second):
        assert_azure_responses_call(call)


async def test_the_agents_sdk_runs_its_tool_loop_on_azure_s_responses_api(
        gateway: Proc, fake: tuple[azure.FakeAzure, str]) -> None:
    resource, _ = fake
    async with weather_agent(gateway) as (agent, config):
        before = len(resource.calls)
        result = await sdk().Runner.run(agent, "Weather?", run_config=config)
        assert result.final_output == "The tool said: sunny"
        first, second = resource.calls[before:]  # the loop's two turns, each on Azure's Responses API
        for call in (first, second):
            assert_azure_responses_call(call)
        assert first["body"]["tools"][0]["name"] == "get_weather"
        assert second["body"]["input"][-1] == {"type": "function_call_output", "call_id": "call_az1",
                                               "output": "sunny"}
        before = len(resource.calls)
        streamed: Any = sdk().Runner.run_streamed(agent, "Weather?", run_config=config)
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds and streamed.final_output == "The tool said: sunny"
        assert [c["path"] for c in resource.calls[before:]] == ["/openai/responses"] * 2
