"""Which MCP server entries reach the filesystem without a root (`gateway.mcp.reach`)."""

from __future__ import annotations

import pytest

from gateway.mcp.config import McpServerConfig
from gateway.mcp.reach import unscoped


@pytest.mark.parametrize("command", [
    ["mcp-server-git", "--repository", "."], ["/venv/bin/mcp-server-git", "-r", "/srv/repo"],
    ["uvx", "mcp-server-git", "--repository=/srv/repo"], ["python", "-m", "mcp_server_git", "-r/srv/repo"],
    ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/srv/data"],
    ["npx", "-y", "@modelcontextprotocol/server-filesystem@2025.1.0", "/srv/data", "/srv/more"],
    ["mcp-server-time"], ["python", "-m", "tests.mcptools.server"],
])
def test_scoped_or_unknown_servers_are_not_warned_about(command: list[str]) -> None:
    assert unscoped(McpServerConfig("s", command=tuple(command))) is None


@pytest.mark.parametrize("command, name", [
    (["mcp-server-git"], "mcp-server-git"), (["uvx", "mcp-server-git", "-v"], "mcp-server-git"),
    (["python", "-m", "mcp_server_git"], "mcp_server_git"), (["mcp-server-git", "--repository"], "mcp-server-git"),
    (["npx", "-y", "@modelcontextprotocol/server-filesystem"], "@modelcontextprotocol/server-filesystem"),
])
def test_a_filesystem_server_without_a_root_is_named(command: list[str], name: str) -> None:
    reason = unscoped(McpServerConfig("s", command=tuple(command)))
    assert reason is not None and reason.startswith(f"{name} is started without a root")


def test_an_http_server_is_not_judged() -> None:
    assert unscoped(McpServerConfig("s", url="http://127.0.0.1:9/mcp")) is None
