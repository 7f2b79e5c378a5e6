"""A policy as data: what a `policies/*.yaml` file declares, validated and frozen.

Nothing here runs anything. `gateway.policy.executors.compile_options` turns a `Policy`
into the harness's `RunOptions`; `gateway.policy.approval` turns its rules into a verdict.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.harness.options import ApprovalAction, Dedupe, LimitAsk
from gateway.harness.state import Limits
from gateway.harness.tools import ToolSpec
from gateway.mcp.config import McpServerConfig
from gateway.mcp.hub import McpHub

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI accepts as a function name: every tool's name, declared or discovered."""

DEFAULT_PERMANENT: tuple[str, ...] = ("PermissionError", "gateway.harness.tools:PermanentToolError")


@dataclass(frozen=True)
class PythonExecutor:
    """`python: "package.module:function"`: sync (run in a thread) or async, imported with the
    policy's folders (`search`) after the gateway's module path (`gateway.policy.resolve`)."""

    target: str
    kind: Literal["python"] = "python"
    search: tuple[Path, ...] = ()


@dataclass(frozen=True)
class HttpExecutor:
    """`http: {url, timeout_s, headers}`: POST `{tool, arguments, run_id, call_id, idempotency_key}`."""

    url: str
    timeout_s: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    kind: Literal["http"] = "http"


@dataclass(frozen=True)
class AgentExecutor:
    """`agent: {policy, model, max_turns, max_budget_usd, system_prompt}`: a sub-run."""

    policy: str
    model: str | None = None
    max_turns: int | None = None
    max_budget_usd: float | None = None
    system_prompt: str | None = None
    kind: Literal["agent"] = "agent"


@dataclass(frozen=True)
class McpExecutor:
    """A tool discovered on an MCP server (the policy's `mcp:` entry `server`), called as
    `tool` (its name on the server) through `hub`, the process's session to that server.
    The hub is a handle, not data: it takes no part in comparisons."""

    server: McpServerConfig
    tool: str
    hub: McpHub = field(compare=False, repr=False)
    kind: Literal["mcp"] = "mcp"


ExecutorConfig = PythonExecutor | HttpExecutor | AgentExecutor | McpExecutor


@dataclass(frozen=True)
class ToolDecl:
    """One tool of the catalog: what the model sees and what runs it."""

    spec: ToolSpec
    executor: ExecutorConfig

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ToolErrorConfig:
    """`tool_errors`: the text written back, whether any error ends the run, and which
    exception classes are permanent (by name: `PermissionError`, `"module:Class"`)."""

    text: str = "Error: {message}"
    fatal: bool = False
    permanent: tuple[str, ...] = DEFAULT_PERMANENT
    search: tuple[Path, ...] = ()
    """The policy's folders, where `module:Class` names are imported from (after the gateway's path)."""


@dataclass(frozen=True)
class RepeatedCall:
    """`stop_when: [{repeated_call: n}]`: stop when the last n tool calls are identical."""

    n: int
    kind: Literal["repeated_call"] = "repeated_call"


StopRule = RepeatedCall


@dataclass(frozen=True)
class Rule:
    """One approval rule; the first rule that matches a call decides it.

    `tool` is a glob on the tool name, `args` maps argument names to globs matched
    against `arg_text(value)` (strings as normalised paths; all must match; a missing
    argument never matches),
    `read_only` and `destructive` (when set) must equal the tool's flags.
    """

    action: ApprovalAction
    tool: str = "*"
    args: Mapping[str, str] = field(default_factory=dict)
    read_only: bool | None = None
    destructive: bool | None = None
    reason: str = ""


OnDecision = Literal["wait", "resume"]


@dataclass(frozen=True)
class ApprovalConfig:
    """`approval`: who may decide (team names), when a pending call expires, the rules."""

    approvers: tuple[str, ...] = ()
    expires_after_s: float | None = None
    rules: tuple[Rule, ...] = ()
    on_decision: OnDecision = "wait"
    """What happens to a server-side run once its pending call is decided: `wait` for a
    resume (POST /v1/runs/{id}/resume, or the client's next call), or `resume` it at once."""


@dataclass(frozen=True)
class SandboxConfig:
    """`sandbox`: the folder the file tools work in.

    `sample: chapter` gives each run a fresh copy of the packaged sample folder of that
    name (three small log files: gateway/data/sandbox); `path: ./dir` works in that folder itself (shared by every run).
    """

    sample: str | None = None
    path: str | None = None


Recovery = Literal["interrupt", "resume"]


@dataclass(frozen=True)
class Policy:
    """One loaded policy file. `version` is the first 12 hex digits of the file's sha256."""

    name: str
    description: str
    limits: Limits
    tools: tuple[ToolDecl, ...]
    tool_errors: ToolErrorConfig
    dedupe: Dedupe
    stop_when: tuple[StopRule, ...]
    approval: ApprovalConfig
    version: str
    path: Path
    sandbox: SandboxConfig | None = None
    system_prompt: str | None = None
    tool_rounds: int | None = None
    """After this many model turns that called tools, the model is asked without tools, so it
    answers (small models otherwise call tools after every result); None: always offered."""
    recovery: Recovery = "interrupt"
    """What the gateway does with a server-side run whose driving process died (its lease
    expired while the run was `running`): `interrupt` it (status interrupted, reason
    crashed: its owner sees it and may resume it) or `resume` it at once."""
    mcp: tuple[McpServerConfig, ...] = ()
    """The MCP servers whose discovered tools are part of `tools` (in the order listed)."""
    python_path: tuple[Path, ...] = ()
    """Where its `module:function` names are imported from after the gateway's module path:
    the file's folder, then its `python_path` entries (absolute)."""
    limit_ask: LimitAsk | None = None
    """`limits: {on_exceed: ask, ask: {...}}`: the limits that ask a person for more instead of
    stopping the run; None: every limit stops it (`on_exceed: stop`)."""

    @property
    def server_side(self) -> bool:
        """A policy with tools runs the loop in the gateway; one without is pass-through."""
        return bool(self.tools)

    def tool(self, name: str) -> ToolDecl | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(t.spec for t in self.tools)


def normal_path(text: str) -> str:
    """`text` read as a POSIX path, lexically normalised: `./a`, `a/`, `.//a` and `b/../a`
    are all `a`, and `//a` is `/a`. Text with a URL scheme (`://`) and "" are left as they are."""
    if not text or "://" in text:
        return text
    out = posixpath.normpath(text)
    return "/" + out.lstrip("/") if out.startswith("//") else out


def arg_text(value: object) -> str:
    """An argument value as approval globs see it (rule globs are read the same way).

    Strings are read as paths (`normal_path`): the file tools act on the path a string
    names, not on its spelling, so a rule on `notes.txt` also matches `./notes.txt` or
    `sub/../notes.txt`, and an allow rule on `tmp/*` does not match `tmp/../notes.txt`.
    Any other value is its JSON text.
    """
    if isinstance(value, str):
        return normal_path(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
