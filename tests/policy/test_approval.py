"""Approval rules decide as written; denials, rejections and expiries leave words behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.harness.approvals import decide
from gateway.harness.execute import CancelScope
from gateway.harness.loop import run
from gateway.harness.options import Verdict
from gateway.harness.state import Decision
from gateway.policy.approval import can_decide, compile_approval, expired, expiry_decision, expiry_sentence
from gateway.policy.decl import ApprovalConfig, Policy, normal_path
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from gateway.policy.schema import load_policy
from tests.policy.conftest import Events, FnModel, WriteFile, answer, new_state, tool_call, tool_messages, turns

POLICY = """
name: guarded
tools:
  - name: delete_file
    description: Delete a file.
    parameters: {type: object, properties: {path: {type: string}, force: {type: boolean}}, required: [path]}
    needs_approval: true
    executor: {python: "tests.policy.sample_tools:echo_sync"}
  - name: write_note
    description: Write a note.
    parameters: {type: object, properties: {text: {type: string}}}
    executor: {python: "tests.policy.sample_tools:echo_sync"}
  - name: read_file
    description: Read a file.
    parameters: {type: object, properties: {path: {type: string}}}
    read_only: true
    executor: {python: "tests.policy.sample_tools:echo_sync"}
  - name: wipe
    description: Wipe everything.
    needs_approval: true
    executor: {python: "tests.policy.sample_tools:echo_sync"}
approval:
  approvers: [ops]
  expires_after_s: 3600
  rules:
    - {tool: delete_file, args: {path: "*.log"}, action: ask}
    - {tool: delete_file, args: {path: "/etc/*"}, action: deny, reason: system files are off limits}
    - {tool: delete_file, args: {path: "tmp/*", force: true}, action: allow}
    - {tool: wipe, action: deny}
    - {tool: "*", read_only: false, action: ask}
"""


@pytest.fixture
def policy(write: WriteFile) -> Policy:
    return load_policy(write("guarded.yaml", POLICY))


@pytest.mark.parametrize(("tool", "args", "verdict", "rule"), [
    ("delete_file", {"path": "access.log"}, Verdict("ask"), 0),
    ("delete_file", {"path": "/etc/passwd"}, Verdict("deny", "system files are off limits"), 1),
    ("delete_file", {"path": "tmp/a.txt", "force": True}, Verdict("allow"), 2),
    ("delete_file", {"path": "tmp/a.txt", "force": False}, Verdict("ask"), 4),  # force must match "true"
    ("delete_file", {"path": "tmp/a.txt"}, Verdict("ask"), 4),  # a missing argument never matches
    ("wipe", {}, Verdict("deny", "approval rule 4 of the policy denies it"), 3),
    ("write_note", {"text": "x"}, Verdict("ask"), 4),  # needs_approval false, but the rule asks
    ("read_file", {"path": "a.log"}, Verdict("allow"), None),  # no rule: the tool's own flag
])
def test_rules_decide_in_order(policy: Policy, tool: str, args: dict[str, object], verdict: Verdict,
                               rule: int | None) -> None:
    approval = compile_approval(policy.approval, policy.specs)
    decl = policy.tool(tool)
    assert decl is not None
    assert approval.explain(decl.spec, args) == (verdict, rule)
    assert approval(decl.spec, args) == verdict


SHIPPED = PolicyRegistry(Path(__file__).resolve().parents[2] / "policies")


@pytest.mark.parametrize("path", ["notes.txt", "./notes.txt", "sub/../notes.txt", ".//notes.txt", "notes.txt/",
                                  "./sub/./../notes.txt", "notes.txt/.", "a/b/../../notes.txt"])
def test_a_deny_rule_on_a_path_catches_every_spelling_of_it(path: str) -> None:
    SHIPPED.load()
    files = SHIPPED.get("files")
    assert files is not None and (decl := files.tool("delete_file")) is not None
    verdict, rule = compile_approval(files.approval).explain(decl.spec, {"path": path})
    assert (verdict.action, rule) == ("deny", 0), (path, verdict)


@pytest.mark.parametrize(("path", "verdict", "rule"), [
    ("tmp/../notes.txt", Verdict("ask"), 4),  # an allow on tmp/* does not reach out of tmp
    ("tmp/./a.txt", Verdict("allow"), 2),
    ("//etc//passwd", Verdict("deny", "system files are off limits"), 1),
    ("/tmp/../etc/passwd", Verdict("deny", "system files are off limits"), 1),
    ("./x/../access.log", Verdict("ask"), 0),
])
def test_globs_match_the_normalised_path(policy: Policy, path: str, verdict: Verdict, rule: int) -> None:
    decl = policy.tool("delete_file")
    assert decl is not None
    assert compile_approval(policy.approval).explain(decl.spec, {"path": path, "force": True}) == (verdict, rule)


def test_rule_globs_are_read_as_paths_too_and_urls_are_left_alone(write: WriteFile) -> None:
    written = load_policy(write("dotted.yaml", POLICY.replace('path: "tmp/*"', 'path: "./tmp//*"')))
    assert written.approval.rules[2].args["path"] == "tmp/*"
    assert normal_path("http://host//a/../b") == "http://host//a/../b" and normal_path("") == ""


def test_without_rules_the_tool_flag_decides(policy: Policy) -> None:
    approval = compile_approval(ApprovalConfig())
    flagged, plain = policy.tool("delete_file"), policy.tool("write_note")
    assert flagged is not None and plain is not None
    assert approval(flagged.spec, {"path": "x"}) == Verdict("ask")
    assert approval(plain.spec, {}) == Verdict("allow")


def test_who_may_decide(policy: Policy) -> None:
    assert can_decide(policy.approval, "ops")
    assert not can_decide(policy.approval, "demo", run_team="demo")  # approvers listed: only they
    open_config = ApprovalConfig()
    assert can_decide(open_config, "demo", run_team="demo")
    assert not can_decide(open_config, "other", run_team="demo")


def test_expiry(policy: Policy) -> None:
    asked = 1_000_000.0
    assert not expired(asked, asked + 3599, policy.approval)
    assert expired(asked, asked + 3600, policy.approval)
    assert not expired(asked, asked + 10**9, ApprovalConfig())
    assert expiry_sentence(policy.approval) == ("Nobody decided on this call within 1 hour, so the approval "
                                                "request expired and the call was rejected.")
    assert "within 90 seconds" in expiry_sentence(ApprovalConfig(expires_after_s=90))


async def test_through_the_loop_allow_deny_ask_reject_and_expire(policy_dir: Path, write: WriteFile) -> None:
    write("guarded.yaml", POLICY)
    reg = PolicyRegistry(policy_dir)
    reg.load()
    policy = reg.get("guarded")
    assert policy is not None
    events = Events()
    options = compile_options(policy, ToolEnv(registry=reg, on_event=events))
    steps = [
        tool_call("c1", "read_file", {"path": "a.log"}),  # allowed (no rule, read-only)
        tool_call("c2", "delete_file", {"path": "/etc/passwd"}),  # denied by rule with a reason
        tool_call("c3", "delete_file", {"path": "tmp/x", "force": True}),  # allowed by rule
        tool_call("c4", "delete_file", {"path": "access.log"}),  # ask -> a person rejects
        tool_call("c5", "delete_file", {"path": "errors.log"}),  # ask -> nobody decides in time
    ]
    model = FnModel(lambda req: steps[turns(req)] if turns(req) < len(steps) else answer("done"))
    state = new_state()

    out = await run(state, model, options, CancelScope())
    assert out.state.status == "interrupted" and out.state.interruption is not None
    assert out.state.interruption.call_id == "c4" and out.state.interruption.tool_name == "delete_file"
    msgs = tool_messages(state)
    assert msgs[0].startswith("echo None") and msgs[2].startswith("echo None")  # c1 and c3 ran
    assert msgs[1] == ('The policy denied the call delete_file({"path":"/etc/passwd"}). It was not run and '
                       'nothing was done. Reason: system files are off limits')
    assert [e["callId"] for e in events.of("approval_required")] == ["c4"]

    decide(state, "c4", Decision("reject", "keep the access log for the audit", "ops"))
    out = await run(state, model, options)
    assert out.state.status == "interrupted" and out.state.interruption is not None
    assert out.state.interruption.call_id == "c5"
    assert tool_messages(state)[3] == ('A person declined the call delete_file({"path":"access.log"}). It was not '
                                       'run and nothing was done. The reviewer said: keep the access log for the audit')

    asked_at = time.time()
    assert expired(asked_at, asked_at + 3600, policy.approval)
    decide(state, "c5", expiry_decision(policy.approval))
    out = await run(state, model, options)
    assert out.state.status == "completed"
    assert tool_messages(state)[4].startswith('Nobody approved the call delete_file({"path":"errors.log"}) in time')
    assert tool_messages(state)[4].endswith(expiry_sentence(policy.approval))
    assert state.decisions["c5"].by == "approval-expiry"
    assert sum(m.startswith("echo") for m in tool_messages(state)) == 2  # only c1 and c3 ever ran
