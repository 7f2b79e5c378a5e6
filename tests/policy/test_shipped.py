"""The shipped policies (policies/*.yaml) against the real scripted provider over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.harness.approvals import decide
from gateway.harness.loop import Outcome, run
from gateway.harness.model import Model
from gateway.harness.state import Decision, RunState
from gateway.policy.decl import Policy
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from gateway.policy.sandbox import prepare_sandbox, sandbox_config
from gateway.providers.http_model import HTTPChatModel
from gateway.providers.scenarios import PLAN_ANSWER
from gateway.providers.scripted import standalone_app
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, RESEARCH, RESEARCH_SYSTEM, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, deleted
from tests.policy.conftest import Events, FnModel, answer, tool_call, tool_messages, turns

POLICIES = Path(__file__).resolve().parents[2] / "policies"


@pytest.fixture
def shipped() -> PolicyRegistry:
    reg = PolicyRegistry(POLICIES)
    reg.load()
    return reg


@pytest.fixture
async def scripted(aiohttp_server: Callable[..., Any]) -> AsyncIterator[HTTPChatModel]:
    server = await aiohttp_server(standalone_app())
    async with aiohttp.ClientSession() as session:
        yield HTTPChatModel(session, f"http://127.0.0.1:{server.port}/v1")


def start(policy: Policy, model_name: str, task: str = PLAN_TASK) -> RunState:
    return RunState.new(model_name, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}],
                        limits=policy.limits, policy=policy.name, policy_version=policy.version)


async def drive(reg: PolicyRegistry, name: str, model: Model, model_name: str, tmp_path: Path,
                state: RunState | None = None) -> tuple[Outcome, Path, Events]:
    policy = reg.get(name)
    assert policy is not None
    config = sandbox_config(policy, reg)
    assert config is not None and config.sample == "chapter"
    root = prepare_sandbox(config, tmp_path / "runs")
    events = Events()
    env = ToolEnv(model=model, model_name=model_name, registry=reg, sandbox_root=root, on_event=events)
    out = await run(state or start(policy, model_name), model, compile_options(policy, env))
    return out, root, events


def test_the_shipped_set_loads_and_matches_the_chapter(shipped: PolicyRegistry) -> None:
    assert shipped.names() == ("files", "passthrough", "research", "supervised")
    passthrough, files, research = shipped.get("passthrough"), shipped.get("files"), shipped.get("research")
    assert passthrough is not None and files is not None and research is not None
    assert not passthrough.server_side and passthrough.limits.max_turns == 20
    assert files.specs == FILE_TOOLS  # word for word: the chapter's token counts depend on it
    assert research.specs == (RESEARCH,)
    ex = research.tools[0].executor
    assert ex.kind == "agent" and (ex.policy, ex.max_turns, ex.max_budget_usd) == ("files", 6, 0.05)
    assert ex.system_prompt == RESEARCH_SYSTEM
    assert sandbox_config(passthrough, shipped) is None


async def test_files_plan(shipped: PolicyRegistry, scripted: HTTPChatModel, tmp_path: Path) -> None:
    out, root, events = await drive(shipped, "files", scripted, "scripted-plan", tmp_path)
    state = out.state
    assert state.status == "completed" and out.answer == PLAN_ANSWER and state.turns == 3
    listing, errors_log = tool_messages(state)
    assert "errors.log" in listing and "access.log" in listing and "notes.txt" in listing
    assert errors_log == (root / "errors.log").read_text()
    assert root.parent == tmp_path / "runs"
    # the chapter's figures: the policy file describes the tools exactly as the chapter does
    assert [u.prompt_tokens for u in state.per_turn] == [204, 269, 342]
    assert round(state.cost_usd, 6) == 0.00247


async def test_files_destructive_asks_then_deletes_once_approved(shipped: PolicyRegistry, scripted: HTTPChatModel,
                                                                 tmp_path: Path) -> None:
    out, root, events = await drive(shipped, "files", scripted, "scripted-destructive", tmp_path)
    state = out.state
    assert state.status == "interrupted" and state.interruption is not None
    assert (state.interruption.tool_name, state.interruption.args) == ("delete_file", {"path": "access.log"})
    assert (root / "access.log").exists()
    call_id = state.interruption.call_id
    assert call_id is not None
    decide(state, call_id, Decision("approve", by="ops"))
    files = shipped.get("files")
    assert files is not None
    env = ToolEnv(model=scripted, model_name=state.model, registry=shipped, sandbox_root=root)
    out = await run(state, scripted, compile_options(files, env))
    assert out.state.status == "completed" and out.state.turns == 3
    assert not (root / "access.log").exists() and deleted(Sandbox(root)) == ["access.log"]


async def test_research_runs_a_files_sub_agent(shipped: PolicyRegistry, scripted: HTTPChatModel,
                                               tmp_path: Path) -> None:
    out, _, events = await drive(shipped, "research", scripted, "scripted-research", tmp_path)
    state = out.state
    assert state.status == "completed" and out.answer == "Research found: " + PLAN_ANSWER
    assert tool_messages(state) == [PLAN_ANSWER]  # the child's summary, not its reads
    child_turns = [e for e in events.of("turn") if e["runId"] != state.run_id]
    assert len(child_turns) == 3 and state.turns == 2
    assert state.cost_usd > child_turns[-1]["costUsd"] > 0  # the child's spend is in the parent's


@pytest.mark.parametrize("path", ["../../../etc/passwd", "/etc/passwd", "../sandbox-other/errors.log"])
async def test_path_traversal_is_refused_and_stops_the_run(shipped: PolicyRegistry, tmp_path: Path,
                                                           path: str) -> None:
    model = FnModel(lambda req: tool_call("c1", "read_file", {"path": path}) if turns(req) == 0 else answer("x"))
    out, root, _ = await drive(shipped, "files", model, "any", tmp_path)
    state = out.state
    assert state.status == "failed" and state.reason == "permanent_error"
    assert tool_messages(state) == [f"Error: permission denied: {path} is outside the working folder"]
