"""Tools as the harness sees them: a spec for the model, a callable, a context.

A tool is data plus one async callable. The harness never imports an executor; the
policy layer builds `Tool`s (python, http, agent executors) and hands them over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.harness.usage import Usage

JSONObject = dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool, plus how the harness must treat it."""

    name: str
    description: str
    parameters: JSONObject = field(default_factory=lambda: {"type": "object", "properties": {}})
    read_only: bool = False
    needs_approval: bool = False
    timeout_s: float | None = None
    # May destroy or overwrite (an approval rule can match on it): MCP's destructiveHint;
    # a policy file's default is `not read_only`.
    destructive: bool = False

    def openai(self) -> JSONObject:
        """The chat-completions `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolContext:
    """Handed to every tool run: who is calling, and the two wires back to the harness.

    `cancelled` is set when the run is stopped; a well-written tool checks it (or waits on
    it) and returns within milliseconds. `progress(label)` becomes a `tool_progress` trace
    line. Writes should pass `idempotency_key` (`<run_id>:<call_id>`) to whatever they change.
    """

    run_id: str
    call_id: str
    tool_name: str
    cancelled: asyncio.Event
    progress: Callable[[str], None] = lambda label: None
    # What the calling run may still spend (None: no run budget): caps a sub-run's budget.
    budget_remaining_usd: float | None = None
    # Charges the calling run as the tool spends (a sub-run's turns), so a Stop mid-tool
    # loses no spend and the parent's budget sees it live.
    spend: Callable[[Usage, float], None] = lambda usage, cost_usd: None

    @property
    def idempotency_key(self) -> str:
        return f"{self.run_id}:{self.call_id}"


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer when it is more than text: a sub-run reports what it spent."""

    content: str
    usage: Usage = field(default_factory=Usage)
    cost_usd: float = 0.0


ToolOutput = str | ToolResult


class ToolFunction(Protocol):
    def __call__(self, args: Mapping[str, Any], ctx: ToolContext) -> Awaitable[ToolOutput]: ...


@dataclass(frozen=True)
class Tool:
    """A tool spec bound to the coroutine that runs it."""

    spec: ToolSpec
    run: ToolFunction

    @property
    def name(self) -> str:
        return self.spec.name


class ToolError(Exception):
    """A tool failed in a way the model may act on (the text goes back to the model)."""


class PermanentToolError(ToolError):
    """A tool failed in a way no retry can fix (e.g. permission denied): stop the run."""
