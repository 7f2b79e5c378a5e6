"""What a policy file says about one MCP server, and what discovery found on it."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Transport = Literal["stdio", "http"]

DEFAULT_MAX_RESULT_CHARS = 100_000
"""A tool result longer than this (after flattening) is cut, with a note saying how much."""


@dataclass(frozen=True)
class McpServerConfig:
    """One `mcp:` entry of a policy: how to reach the server and which of its tools to take.

    Exactly one of `command` (stdio: the server runs as a child process, `env` merged over
    a minimal safe environment, in `cwd`) and `url` (streamable HTTP, with `headers_env`
    mapping header names to the environment variables holding their values).
    """

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    headers_env: tuple[tuple[str, str], ...] = ()
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    prefix: str = ""
    rename: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS
    optional: bool = False
    """The gateway is ready (GET /readyz) while this server is down: its tools fail, the rest work."""

    @property
    def transport(self) -> Transport:
        return "http" if self.url is not None else "stdio"

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two entries the same server (they then share one session)."""
        return (self.command, self.url, self.env, self.cwd, self.headers_env)

    @property
    def where(self) -> str:
        """The server's address for people: the command line, or the URL."""
        return self.url if self.url is not None else " ".join(self.command)

    def headers(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The HTTP headers, read from the environment now (a missing variable is an error)."""
        source = os.environ if environ is None else environ
        out: dict[str, str] = {}
        for header, var in self.headers_env:
            if var not in source:
                raise LookupError(f"environment variable {var} (header {header} of MCP server '{self.name}') is not set")
            out[header] = source[var]
        return out

    def takes(self, tool: str) -> bool:
        """Whether the server's tool passes the include and exclude globs."""
        return (any(fnmatch.fnmatchcase(tool, g) for g in self.include)
                and not any(fnmatch.fnmatchcase(tool, g) for g in self.exclude))

    def exposed_name(self, tool: str) -> str:
        """The name the model sees: a rename if there is one, else the prefix and the name."""
        renamed = dict(self.rename).get(tool)
        return renamed if renamed is not None else self.prefix + tool


@dataclass(frozen=True)
class McpToolInfo:
    """One tool as the server's `tools/list` described it."""

    name: str
    description: str
    input_schema: Mapping[str, Any] = field(default_factory=dict)
    read_only_hint: bool | None = None
    destructive_hint: bool | None = None

    @property
    def read_only(self) -> bool:
        return self.read_only_hint is True

    @property
    def destructive(self) -> bool:
        """MCP's default: a tool that is not read-only may destroy, unless it says it does not."""
        return not self.read_only and self.destructive_hint is not False

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": dict(self.input_schema),
                "read_only_hint": self.read_only_hint, "destructive_hint": self.destructive_hint}
