"""The OpenAI Agents SDK with its default model (the Responses API) through a real gateway
process: only the base URL changes. Its function-tool loop runs the plan task (tools run in
the client), streamed and not, and the gateway counts the loop's turns on one run (the SDK
replays its history without previous_response_id or X-Run-Id); a turn cap surfaces as
openai.RateLimitError after one refused request; server-side mode answers in one call."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai
import pytest

from gateway.providers.scenarios import PLAN_ANSWER
from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import fresh_sandbox
from tests.server.conftest import KEY, config_data
from tests.server.served import Served
from tests.server.test_responses import load_run, requests_counted, serve, stored_run_id
from tests.support.procs import Proc

if TYPE_CHECKING:
    from agents import Agent, RunConfig

@functools.cache
def sdk() -> ModuleType:
    """The Agents SDK, imported when a test of this file runs: importing it costs every
    pytest worker that collects the suite about a second."""
    import agents
    import agents.models.openai_provider

    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    return agents


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = serve(tmp_path_factory.mktemp("agents") / "gw", config_data())
    yield proc
    proc.stop()


def run_config(url: str, key: str = KEY) -> RunConfig:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key)  # the SDK's defaults otherwise
    return sdk().RunConfig(model_provider=sdk().models.openai_provider.OpenAIProvider(openai_client=client),
                           tracing_disabled=True)


def file_agent(folder: Path, model: str = "scripted-plan", **settings: Any) -> Agent[Any]:
    @sdk().function_tool
    def list_files() -> str:
        """List the files in the folder."""
        return "\n".join(sorted(p.name for p in folder.iterdir()))

    @sdk().function_tool
    def read_file(path: str) -> str:
        """Read one file of the folder."""
        return (folder / path).read_text()

    return sdk().Agent(name="files", instructions=SYSTEM_PROMPT, model=model, tools=[list_files, read_file],
                       model_settings=sdk().ModelSettings(**settings))


@pytest.mark.parametrize("stream", [False, True])
async def test_the_agents_sdk_runs_its_tool_loop_through_the_gateway_as_one_run(gateway: Proc, tmp_path: Path,
                                                                               stream: bool) -> None:
    agent = file_agent(fresh_sandbox(tmp_path))
    if stream:
        result: Any = sdk().Runner.run_streamed(agent, PLAN_TASK, run_config=run_config(gateway.url))
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
    else:
        result = await sdk().Runner.run(agent, PLAN_TASK, run_config=run_config(gateway.url))
    assert result.final_output == PLAN_ANSWER
    ids = [r.response_id for r in result.raw_responses]
    assert len(ids) == 3
    runs = {await stored_run_id(gateway, i) for i in ids}
    assert len(runs) == 1
    run = await load_run(gateway, runs.pop())
    assert run.turns == 3 and run.status == "completed"
    assert [u.prompt_tokens for u in run.per_turn] == [r.usage.input_tokens for r in result.raw_responses]


async def test_a_turn_cap_stops_the_agents_sdk_with_one_refused_request(gateway: Proc, tmp_path: Path) -> None:
    agent = file_agent(fresh_sandbox(tmp_path), "scripted-runaway", extra_headers={"X-Policy": "two"})
    before = requests_counted(gateway, "/v1/responses", 429)
    with pytest.raises(openai.RateLimitError) as refused:
        await sdk().Runner.run(agent, "Keep listing.", run_config=run_config(gateway.url))
    assert refused.value.code == "max_turns_exceeded"
    assert requests_counted(gateway, "/v1/responses", 429) - before == 1


async def test_server_side_mode_through_the_agents_sdk(tmp_path: Path) -> None:
    served = Served.start(tmp_path / "gw")
    try:
        agent = sdk().Agent(name="plain", instructions="Answer.", model="scripted-plan",
                            model_settings=sdk().ModelSettings(extra_headers={"X-Policy": "files"}))
        result = await sdk().Runner.run(agent, PLAN_TASK, run_config=run_config(served.url, "sk-demo"))
        assert result.final_output == PLAN_ANSWER
        assert len(result.raw_responses) == 1  # the gateway ran the loop: one call
    finally:
        served.proc.stop()
