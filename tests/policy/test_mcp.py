"""Policies with `mcp:` servers, loaded and run in this process against the test server
written with the `mcp` SDK (stdio, one session shared by the module's tests): discovery
and its filters, annotations and overrides, errors that name the line, re-discovery on
reload while a run keeps its tool list, the result cap, and the harness loop calling
discovered tools."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcp_types import EmbeddedResource, ImageContent, ResourceLink, TextContent, TextResourceContents

from gateway.harness.loop import run
from gateway.harness.state import Limits
from gateway.mcp.content import flatten
from gateway.mcp.config import McpServerConfig
from gateway.mcp.hub import McpHub, McpUnavailable
from gateway.policy.decl import McpExecutor, Policy
from gateway.policy.errors import PolicyError
from gateway.policy.executors import ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from gateway.policy.schema import load_policy
from tests.mcptools.fixtures import server_log, stdio_server
from tests.policy.conftest import Events, FnModel, WriteFile, answer, new_state, tool_call, tool_messages, turns


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "server.jsonl"


@pytest.fixture(scope="module")
def hub() -> Iterator[McpHub]:
    h = McpHub()
    yield h
    h.close()


def policy_text(log: Path, **server: Any) -> str:
    body: dict[str, Any] = {"name": "mcp", "mcp": [stdio_server("tests", log, **server)]}
    return yaml.safe_dump(body)


def tool_names(policy: Policy) -> list[str]:
    return [t.name for t in policy.tools]


def test_discovery_filters_names_and_reads_annotations(write: WriteFile, hub: McpHub, log: Path) -> None:
    text = policy_text(log, include=["lookup", "wipe", "touch", "slow", "whoami"], exclude=["whoami"],
                       prefix="t_", rename={"wipe": "erase"}, timeout_s=7)
    text += yaml.safe_dump({"tools": [{"name": "t_slow", "description": "Slow, on purpose.", "read_only": True,
                                       "timeout_s": 2}],
                            "approval": {"rules": [{"destructive": True, "action": "ask"}]}})
    policy = load_policy(write("mcp.yaml", text), hub)
    assert tool_names(policy) == ["t_lookup", "erase", "t_touch", "t_slow"]
    specs = {t.name: t.spec for t in policy.tools}
    assert (specs["t_lookup"].read_only, specs["t_lookup"].destructive) == (True, False)  # readOnlyHint
    assert (specs["erase"].read_only, specs["erase"].destructive) == (False, True)  # destructiveHint
    assert (specs["t_touch"].read_only, specs["t_touch"].destructive) == (False, False)  # destructiveHint: false
    assert specs["t_slow"].description == "Slow, on purpose." and specs["t_slow"].read_only  # overridden
    assert (specs["t_slow"].destructive, specs["t_slow"].timeout_s, specs["erase"].timeout_s) == (False, 2, 7)
    assert specs["t_lookup"].parameters["properties"]["key"]["type"] == "string"  # the server's own schema
    executor = policy.tool("erase").executor  # type: ignore[union-attr]
    assert isinstance(executor, McpExecutor) and executor.tool == "wipe"
    assert policy.server_side and [s.name for s in policy.mcp] == ["tests"]
    approval = compile_options(policy, ToolEnv()).approval
    assert approval(specs["erase"], {"target": "x"}).action == "ask"
    assert approval(specs["t_touch"], {"target": "x"}).action == "allow"


@pytest.mark.parametrize(("server", "extra", "field", "problem"), [
    ({"rename": {"nope": "x"}}, {}, "mcp[0].rename.nope", "MCP server 'tests' has no tool 'nope'"),
    ({"include": ["nothing*"]}, {}, "mcp[0]", "offers no tool that include/exclude let through"),
    ({}, {"tools": [{"name": "ghost", "read_only": True}]}, "tools[0]",
     "tool 'ghost' has no executor, so it must name a tool discovered on an MCP server"),
    ({"include": ["lookup"]}, {"tools": [{"name": "lookup", "description": "Mine.", "executor": {"http": "http://x"}}]},
     "mcp[0]", "would be called 'lookup', which another tool of this policy already is"),
    ({"command": ["/nonexistent/mcp-server"]}, {}, "mcp[0]", "cannot discover the tools of MCP server 'tests'"),
    ({"include": ["lookup"]}, {"approval": {"rules": [{"tool": "wipe", "action": "deny"}]}}, "approval.rules[0].tool",
     "'wipe' matches none of this policy's tools (lookup)"),
    ({"url": "http://127.0.0.1:9/mcp", "headers_env": {"Authorization": "NO_SUCH_VARIABLE_HERE"}}, {},
     "mcp[0].headers_env", "environment variable NO_SUCH_VARIABLE_HERE"),
])
def test_errors_name_the_line_and_the_problem(write: WriteFile, hub: McpHub, log: Path, server: dict[str, Any],
                                              extra: dict[str, Any], field: str, problem: str) -> None:
    body: dict[str, Any] = {"name": "mcp", "mcp": [{**stdio_server("tests", log), **server}], **extra}
    if "url" in server:
        for key in ("command", "cwd", "env"):
            del body["mcp"][0][key]
    path = write("bad.yaml", yaml.safe_dump(body))
    with pytest.raises(PolicyError) as caught:
        load_policy(path, hub)
    assert problem in caught.value.problem, caught.value.problem
    assert caught.value.field == field
    lines = path.read_text().splitlines()
    assert caught.value.line is not None and lines[caught.value.line - 1].strip()  # a line of the file


def test_without_a_hub_the_error_says_so(write: WriteFile, log: Path) -> None:
    with pytest.raises(PolicyError, match="this loader has no MCP hub"):
        load_policy(write("mcp.yaml", policy_text(log)))


async def test_reload_rediscovers_and_a_running_run_keeps_its_tool_list(policy_dir: Path, write: WriteFile,
                                                                        hub: McpHub, log: Path) -> None:
    write("mcp.yaml", policy_text(log, include=["grow", "lookup", "fresh_*"]))
    registry = PolicyRegistry(policy_dir, hub)
    registry.load()
    old = registry.get("mcp")
    assert old is not None and tool_names(old) == ["lookup", "grow"]  # the server's order
    options = compile_options(old, ToolEnv())
    model = FnModel(lambda r: tool_call("c1", "grow", {"name": "fresh_tool"}) if turns(r) == 0 else answer("ok"))
    state = new_state(limits=Limits(max_turns=3))
    await run(state, model, options)
    assert tool_messages(state) == ["added fresh_tool"]

    result = registry.reload()  # the file is unchanged; the server's tools are not
    assert result.changed == ("mcp",)
    new = registry.get("mcp")
    assert new is not None and tool_names(new) == ["lookup", "grow", "fresh_tool"] and new.version != old.version
    assert registry.for_run("mcp", old.version) is old  # the run's version keeps its own list
    assert "fresh_tool" not in compile_options(old, ToolEnv()).tools
    assert registry.reload().changed == ()  # nothing new: the same version


async def test_a_run_calls_discovered_tools_with_progress_errors_and_a_result_cap(write: WriteFile, hub: McpHub,
                                                                                  log: Path) -> None:
    text = policy_text(log, include=["slow", "fail", "big"], max_result_chars=60)
    policy = load_policy(write("mcp.yaml", text), hub)
    plan = [("slow", {"steps": 2}), ("fail", {"why": "disk full"}), ("big", {"size": 100}), ("slow", {"steps": "x"})]
    model = FnModel(lambda r: tool_call(f"c{turns(r)}", *plan[turns(r)]) if turns(r) < len(plan) else answer("done"))
    events = Events()
    state = new_state()
    await run(state, model, compile_options(policy, ToolEnv(on_event=events)))
    slow, fail, big, bad = tool_messages(state)
    assert slow == "done in 2 steps"
    assert fail == "Error: Error executing tool fail: failed on purpose: disk full"
    assert big == "x" * 60 + "\n[... 40 more characters cut by the gateway]"
    assert bad.startswith("Error: invalid arguments for slow (argument 'steps')")
    assert [e["label"] for e in events.events if e["type"] == "tool_progress"] == ["step 1 of 2", "step 2 of 2"]
    assert [e["steps"] for e in server_log(log) if e["event"] == "slow"] == [2]  # the bad call never left


def test_the_hub_reports_health_and_stops_its_servers(write: WriteFile, log: Path) -> None:
    own = McpHub()
    load_policy(write("mcp.yaml", policy_text(log, include=["lookup"])), own)
    [health] = own.health()
    assert (health.name, health.transport, health.state, health.starts, health.failures) == ("tests", "stdio", "up",
                                                                                             1, 0)
    assert health.where.startswith(sys.executable)
    own.close()
    assert own.health()[0].state == "stopped"


def test_content_is_flattened_to_text_and_capped() -> None:
    parts = [TextContent(type="text", text="first"), ImageContent(type="image", data="aGVsbG8h", mime_type="image/png"),
             EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///a.txt", text="inside")),
             ResourceLink(type="resource_link", uri="file:///b.bin", name="b")]
    assert flatten(parts) == "first\n[image image/png, about 6 bytes]\ninside\n[resource link file:///b.bin]"
    assert flatten([], {"ok": True}) == '{"ok":true}'
    assert flatten([TextContent(type="text", text="abcdef")], cap=4) == "abcd\n[... 2 more characters cut by the gateway]"


def test_a_server_that_cannot_start_reads_as_down_and_is_tried_again() -> None:
    own = McpHub()
    broken = McpServerConfig(name="broken", command=(sys.executable, "-c", "pass"))  # exits before the handshake
    try:
        for attempt in (1, 2):  # the second attempt waits out the backoff, then tries again
            with pytest.raises(McpUnavailable, match="the MCP server 'broken' could not be started"):
                own.discover(broken)
            [health] = own.health()
            assert (health.state, health.starts, health.failures) == ("down", 0, attempt)
    finally:
        own.close()
