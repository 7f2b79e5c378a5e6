"""Policy files are validated whole: errors name the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.harness.state import DEFAULT_MAX_TOOL_CALLS, Limits
from gateway.policy.errors import PolicyError
from gateway.policy.schema import AgentExecutor, HttpExecutor, PythonExecutor, RepeatedCall, load_policy
from tests.policy.conftest import WriteFile

GOOD = """
name: good
description: A policy with one tool of each executor kind.
limits: {max_turns: 7, max_budget_usd: 0.25, budget_mode: strict}
tool_errors: {text: "Tool {tool} failed: {message}", fatal: false, permanent: [PermissionError, "gateway.harness.tools:PermanentToolError"]}
dedupe: all
stop_when: [{repeated_call: 3}]
tools:
  - name: echo
    description: Echo text.
    parameters: {type: object, properties: {text: {type: string}}, required: [text]}
    read_only: true
    timeout_s: 2
    executor: {python: "tests.policy.sample_tools:echo_sync"}
  - name: remote
    description: Ask a server.
    executor: {http: {url: "http://127.0.0.1:9/tool", timeout_s: 1.5, headers: {X-Token: abc}}}
  - name: research
    description: A sub-run.
    parameters: {type: object, properties: {question: {type: string}}}
    executor: {agent: {policy: good, model: scripted-plan, max_turns: 6, max_budget_usd: 0.05}}
approval:
  approvers: [ops]
  expires_after_s: 60
  rules:
    - {tool: echo, args: {text: "*.log"}, action: deny, reason: no logs}
    - {tool: "*", read_only: false, action: ask}
"""


def test_a_good_policy_loads_every_field(write: WriteFile) -> None:
    path = write("good.yaml", GOOD)
    p = load_policy(path)
    assert p.name == "good" and p.path == path
    assert p.limits == Limits(7, 0.25, "strict")
    assert [t.name for t in p.tools] == ["echo", "remote", "research"]
    assert p.tools[0].executor == PythonExecutor("tests.policy.sample_tools:echo_sync", search=(path.parent.resolve(),))
    assert p.tools[0].spec.read_only and p.tools[0].spec.timeout_s == 2.0
    assert p.tools[1].executor == HttpExecutor("http://127.0.0.1:9/tool", 1.5, {"X-Token": "abc"})
    assert p.tools[1].spec.parameters == {"type": "object", "properties": {}}
    assert p.tools[2].executor == AgentExecutor("good", "scripted-plan", 6, 0.05)
    assert p.tool_errors.text.startswith("Tool {tool}") and len(p.tool_errors.permanent) == 2
    assert p.dedupe == "all" and p.stop_when == (RepeatedCall(3),)
    assert p.approval.approvers == ("ops",) and p.approval.expires_after_s == 60.0
    assert p.approval.rules[0].args == {"text": "*.log"} and p.approval.rules[0].reason == "no logs"
    assert p.approval.rules[1].read_only is False and p.approval.rules[1].tool == "*"
    assert p.server_side and len(p.version) == 12 and int(p.version, 16) >= 0


def test_a_policy_without_tools_is_passthrough_and_version_follows_bytes(write: WriteFile) -> None:
    a = load_policy(write("pt.yaml", "limits: {max_turns: 3}\n"))
    assert a.name == "pt" and not a.server_side and a.limits.max_turns == 3 and a.dedupe == "read_only"
    assert a.tool_rounds is None
    assert load_policy(write("r.yaml", "tool_rounds: 2\n")).tool_rounds == 2
    b = load_policy(write("pt.yaml", "limits: {max_turns: 3}  # edited\n"))
    assert a.version != b.version


def test_tool_call_and_wall_clock_limits(write: WriteFile) -> None:
    a = load_policy(write("a.yaml", "limits: {max_tool_calls: 7, max_duration_s: 90}\n"))
    assert a.limits.max_tool_calls == 7 and a.limits.max_duration_s == 90.0
    b = load_policy(write("b.yaml", "limits: {max_turns: 3, max_tool_calls: null}\n"))
    assert b.limits.max_tool_calls == DEFAULT_MAX_TOOL_CALLS and b.limits.max_duration_s is None  # always a cap


def test_limits_that_ask_a_person(write: WriteFile) -> None:
    p = load_policy(write("ask.yaml", "limits:\n  max_turns: 20\n  max_budget_usd: 0.5\n  on_exceed: ask\n"
                                      "  ask:\n    grant: {max_turns: 10, max_budget_usd: 0.25}\n    max_grants: 3\n"
                                      "    max_total: {max_turns: 60, max_budget_usd: 2}\n"
                                      "approval: {approvers: [ops, sre]}\n"))
    ask = p.limit_ask
    assert ask is not None and ask.approvers == ("ops", "sre")  # the approval's approvers by default
    assert ask.grant == {"max_turns": 10, "max_budget_usd": 0.25} and type(ask.grant["max_turns"]) is int
    assert ask.max_grants == 3 and ask.max_total == {"max_turns": 60, "max_budget_usd": 2.0}
    own = load_policy(write("own.yaml", "limits: {max_turns: 2, on_exceed: ask, ask: {approvers: [leads], "
                                        "grant: {max_turns: 1}}}\napproval: {approvers: [ops]}\n"))
    assert own.limit_ask is not None and own.limit_ask.approvers == ("leads",) and own.limit_ask.max_grants is None
    assert load_policy(write("stop.yaml", "limits: {max_turns: 2, on_exceed: stop}\n")).limit_ask is None
    assert load_policy(write("plain.yaml", "limits: {max_turns: 2}\n")).limit_ask is None


ASK = "limits:\n  max_turns: 2\n  on_exceed: ask\n"
BAD = [
    ("on_exceed", "limits: {on_exceed: pause}\n", 1, "limits.on_exceed", "must be one of stop, ask"),
    ("ask without grant", ASK + "approval: {approvers: [ops]}\n", 3, "limits.on_exceed", "needs limits.ask"),
    ("ask under stop", "limits: {max_turns: 2, ask: {grant: {max_turns: 1}}}\n", 1, "limits.ask",
     "on_exceed is 'stop'"),
    ("no approvers", ASK + "  ask: {grant: {max_turns: 1}}\n", 4, "limits.ask", "no approvers"),
    ("grant of no cap", ASK + "  ask: {approvers: [ops], grant: {max_budget_usd: 1}}\n", 4,
     "limits.ask.grant.max_budget_usd", "sets no limits.max_budget_usd"),
    ("grant of a fraction of a turn", ASK + "  ask: {approvers: [ops], grant: {max_turns: 1.5}}\n", 4,
     "limits.ask.grant.max_turns", "whole number"),
    ("grant of an unknown limit", ASK + "  ask: {approvers: [ops], grant: {max_tokens: 5}}\n", 4,
     "limits.ask.grant.max_tokens", "unknown limit"),
    ("empty grant", ASK + "  ask: {approvers: [ops], grant: {}}\n", 4, "limits.ask.grant", "at least one"),
    ("total below the cap", ASK + "  ask: {approvers: [ops], grant: {max_turns: 1}, max_total: {max_turns: 1}}\n",
     4, "limits.ask.max_total.max_turns", "below limits.max_turns"),
    ("zero grants", ASK + "  ask: {approvers: [ops], grant: {max_turns: 1}, max_grants: 0}\n", 4,
     "limits.ask.max_grants", "at least 1"),
    ("unknown ask field", ASK + "  ask: {approvers: [ops], grant: {max_turns: 1}, every: 2}\n", 4,
     "limits.ask.every", "unknown field"),
    ("unknown top field", "name: x\nmax_turns: 3\n", 2, "max_turns", "unknown field"),
    ("zero tool calls", "limits: {max_tool_calls: 0}\n", 1, "limits.max_tool_calls", "at least 1"),
    ("negative duration", "limits: {max_duration_s: -5}\n", 1, "limits.max_duration_s", "positive number"),
    ("zero turns", "name: x\nlimits:\n  max_turns: 0\n", 3, "limits.max_turns", "at least 1"),
    ("budget mode", "name: x\nlimits: {budget_mode: never}\n", 2, "limits.budget_mode", "must be one of turn, strict"),
    ("negative budget", "limits:\n  max_budget_usd: -1\n", 2, "limits.max_budget_usd", "positive number"),
    ("dedupe", "dedupe: sometimes\n", 1, "dedupe", "read_only, all, off"),
    ("zero tool rounds", "tool_rounds: 0\n", 1, "tool_rounds", "at least 1"),
    ("dedupe on", "dedupe: on\n", 1, "dedupe", "read_only, all, off"),
    ("tools not a list", "tools: {name: x}\n", 1, "tools", "must be a list"),
    (
        "missing executor",
        "tools:\n  - name: a\n    description: A.\n",
        2, "tools[0]", "missing required field 'executor'",
    ),
    (
        "two executors",
        "tools:\n  - name: a\n    description: A.\n    executor:\n      python: 'os:getcwd'\n      http: 'http://x'\n",
        4, "tools[0].executor", "exactly one of python, http, agent",
    ),
    (
        "python target missing",
        "tools:\n  - name: a\n    description: A.\n    executor: {python: 'tests.policy.sample_tools:nope'}\n",
        4, "tools[0].executor.python", "has no attribute 'nope'",
    ),
    (
        "python target not callable",
        "tools:\n  - name: a\n    description: A.\n    executor: {python: 'tests.policy.sample_tools:not_callable'}\n",
        4, "tools[0].executor.python", "not callable",
    ),
    (
        "bad json schema",
        "tools:\n  - name: a\n    description: A.\n    parameters:\n      type: object\n      properties:\n"
        "        n: {type: integr}\n    executor: {python: 'os:getcwd'}\n",
        7, "tools[0].parameters.properties.n.type", "not a valid JSON schema",
    ),
    (
        "http url",
        "tools:\n  - name: a\n    description: A.\n    executor: {http: {url: 'ftp://x/y'}}\n",
        4, "tools[0].executor.http.url", "not an http:// or https:// URL",
    ),
    (
        "duplicate tool",
        "tools:\n  - {name: a, description: A., executor: {python: 'os:getcwd'}}\n"
        "  - {name: a, description: B., executor: {python: 'os:getcwd'}}\n",
        3, "tools[1].name", "declared twice",
    ),
    ("bad template", "tool_errors: {text: 'Error: {msg}'}\n", 1, "tool_errors.text", "bad template"),
    (
        "unknown exception",
        "tool_errors:\n  permanent: [PermissionError, NoSuchError]\n",
        2, "tool_errors.permanent[1]", "not a builtin exception",
    ),
    ("repeated_call 1", "stop_when:\n  - repeated_call: 1\n", 2, "stop_when[0].repeated_call", "at least 2"),
    (
        "rule tool unknown",
        "tools:\n  - {name: a, description: A., executor: {python: 'os:getcwd'}}\n"
        "approval:\n  rules:\n    - {tool: delete_file, action: ask}\n",
        5, "approval.rules[0].tool", "matches none of this policy's tools (a)",
    ),
    (
        "rule action",
        "tools:\n  - {name: a, description: A., executor: {python: 'os:getcwd'}}\n"
        "approval:\n  rules:\n    - tool: a\n      action: maybe\n",
        6, "approval.rules[0].action", "must be one of allow, deny, ask",
    ),
    (
        "rule arg unknown",
        "tools:\n  - {name: a, description: A., parameters: {type: object, properties: {path: {type: string}}},"
        " executor: {python: 'os:getcwd'}}\n"
        "approval:\n  rules:\n    - tool: a\n      args: {file: '*.log'}\n      action: ask\n",
        6, "approval.rules[0].args.file", "has an argument 'file'",
    ),
    ("duplicate key", "name: x\nname: y\n", 2, "name", "duplicate key"),
    ("yaml syntax", "name: x\nlimits: {max_turns: 3\n", 3, "(document)", "not valid YAML"),
    ("empty", "", 1, "(document)", "empty"),
    ("not a mapping", "- a\n- b\n", 1, "(document)", "must be a mapping"),
]


@pytest.mark.parametrize(("label", "text", "line", "field", "problem"), BAD, ids=[b[0] for b in BAD])
def test_errors_name_file_line_and_field(
    write: WriteFile, label: str, text: str, line: int, field: str, problem: str
) -> None:
    path = write("bad.yaml", text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    err = info.value
    assert (err.file, err.line, err.field) == (str(path), line, field), str(err)
    assert problem in err.problem
    assert str(err).startswith(f"{path}:{line}: {field}: ")


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read the file"):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(bad)


def test_a_policy_module_named_like_a_library_is_refused_naming_both(write: WriteFile) -> None:
    path = write("clash.yaml", """
name: clash
tools:
  - {name: dump, description: D., executor: {python: "json:dumps"}}
""")
    (path.parent / "json.py").write_text("def dumps(args, ctx):\n    return 'mine'\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.field == "tools[0].executor.python"
    assert f"not this policy's {path.parent.resolve() / 'json.py'}" in info.value.problem
    assert "rename the policy's module" in info.value.problem
