"""Editing a policy file and reloading changes new runs only: a run keeps its version."""

from __future__ import annotations

from pathlib import Path

from gateway.harness.approvals import decide
from gateway.harness.loop import run
from gateway.harness.state import Decision, RunState
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from tests.policy.conftest import FnModel, WriteFile, answer, tool_call, tool_messages, turns

V1 = """
name: ops
tools:
  - name: echo
    description: Echo.
    parameters: {type: object, properties: {text: {type: string}}}
    executor: {python: "tests.policy.sample_tools:echo_sync"}
approval:
  rules:
    - {tool: echo, action: ask}
"""
V2 = V1.replace("action: ask", "action: deny, reason: echo is retired")


def start(reg: PolicyRegistry) -> RunState:
    policy = reg.get("ops")
    assert policy is not None
    return RunState.new("m", [{"role": "user", "content": "echo hi"}], policy=policy.name,
                        policy_version=policy.version)


async def drive(reg: PolicyRegistry, state: RunState) -> RunState:
    policy = reg.get_version(state.policy, state.policy_version)  # the version the run started with
    assert policy is not None
    model = FnModel(lambda req: tool_call("c1", "echo", {"text": "hi"}) if turns(req) == 0 else answer("done"))
    out = await run(state, model, compile_options(policy, ToolEnv(registry=reg)))
    return out.state


async def test_reload_changes_new_runs_only(policy_dir: Path, write: WriteFile) -> None:
    write("ops.yaml", V1)
    reg = PolicyRegistry(policy_dir)
    reg.load()
    old_run = await drive(reg, start(reg))
    assert old_run.status == "interrupted"  # v1 asks a person

    write("ops.yaml", V2)
    assert reg.reload().changed == ("ops",)
    new_run = await drive(reg, start(reg))
    assert new_run.policy_version != old_run.policy_version
    assert new_run.status == "completed"
    assert tool_messages(new_run)[0].startswith("The policy denied the call echo") and "echo is retired" in \
        tool_messages(new_run)[0]

    decide(old_run, "c1", Decision("approve", by="ops"))
    old_run = await drive(reg, old_run)  # still under v1: approved, so it runs
    assert old_run.status == "completed" and tool_messages(old_run)[0].startswith("echo hi")
