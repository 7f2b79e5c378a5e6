"""MCP servers known to reach the filesystem, and whether a policy's entry gives them a root.

A stdio server runs as the gateway's user: a git or filesystem server started without a
root reads (and changes) whatever that user can. `unscoped(config)` names the problem
for the servers this module knows; `gateway policy check` prints it as a warning
(docs/policies.md, "Scoping an MCP server's reach"). Servers it does not know are not
judged: read their documentation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.mcp.config import McpServerConfig


@dataclass(frozen=True)
class Reach:
    """A server known to reach the filesystem: the names it is started by (a program, a
    `python -m` module, an npm package) and how its root is given."""

    names: tuple[str, ...]
    reaches: str
    """What it reaches without a root."""
    flags: tuple[str, ...] = ()
    """Options naming the root (`--repository PATH`); none: the root is a positional argument."""
    fix: str = ""


KNOWN: tuple[Reach, ...] = (
    Reach(("mcp-server-git", "mcp_server_git"), "any git repository the gateway's user can read",
          ("--repository", "-r"), "pin one with `--repository PATH` (e.g. command: [mcp-server-git, --repository, "
                                   "\".\"] with cwd: the repository)"),
    Reach(("@modelcontextprotocol/server-filesystem", "mcp-server-filesystem"),
          "no folder (or, given the client's roots, any)", (),
          "name the folders it may use as its arguments (e.g. [npx, -y, @modelcontextprotocol/server-filesystem, "
          "/srv/data])"),
)


def _program(token: str) -> str:
    """`/usr/bin/mcp-server-git` -> `mcp-server-git`; `pkg@1.2` -> `pkg` (npm versions)."""
    name = os.path.basename(token) if not token.startswith("@") else token
    at = name.rfind("@")
    return name[:at] if at > 0 else name


def _has_root(reach: Reach, args: Sequence[str]) -> bool:
    if not reach.flags:
        return any(not a.startswith("-") for a in args)
    for i, arg in enumerate(args):
        for flag in reach.flags:
            if arg == flag and i + 1 < len(args):
                return True
            if arg.startswith(flag + "=") or (len(flag) == 2 and arg.startswith(flag) and len(arg) > 2):
                return True
    return False


def unscoped(config: McpServerConfig) -> str | None:
    """Why this stdio server reaches further than it should (a sentence), or None (scoped,
    not a server this module knows, or an HTTP server: its reach is its host's business)."""
    for i, token in enumerate(config.command):
        name = _program(token)
        for reach in KNOWN:
            if name in reach.names:
                if _has_root(reach, config.command[i + 1:]):
                    return None
                return f"{name} is started without a root, so it reaches {reach.reaches}; {reach.fix}"
    return None
