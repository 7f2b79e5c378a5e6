"""How a run is governed: everything the loop needs besides the state and the model.

A policy file (gateway.policy) compiles to `RunOptions`; the demo builds them by hand.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.harness.approvals import rejection_text
from gateway.harness.state import Amounts, Interruption, LimitName, RunState, Status
from gateway.harness.tools import PermanentToolError, Tool, ToolSpec
from gateway.harness.trace import EventSink
from gateway.harness.usage import DEFAULT_PRICE, Price, Usage

Dedupe = Literal["read_only", "all", "off"]
ApprovalAction = Literal["allow", "deny", "ask"]


@dataclass(frozen=True)
class Verdict:
    """What the approval policy says about one call before it runs."""

    action: ApprovalAction
    reason: str = ""


class ApprovalPolicy(Protocol):
    def __call__(self, spec: ToolSpec, args: Mapping[str, Any]) -> Verdict: ...


def default_approval(spec: ToolSpec, args: Mapping[str, Any]) -> Verdict:
    """The tool's own flag decides: `needs_approval` asks a person, everything else runs."""
    return Verdict("ask") if spec.needs_approval else Verdict("allow")


@dataclass(frozen=True)
class ToolErrorPolicy:
    """How a tool that raised is reported.

    `text` is a template with `{message}`, `{tool}` and `{error_type}`; `fatal` stops the
    run at the first error; exceptions of a `permanent` class stop it with a reason
    (retrying them only burns turns).
    """

    text: str = "Error: {message}"
    fatal: bool = False
    permanent: tuple[type[BaseException], ...] = (PermissionError, PermanentToolError)

    def render(self, tool: str, exc: BaseException) -> str:
        message = str(exc) or type(exc).__name__
        return self.text.format(message=message, tool=tool, error_type=type(exc).__name__)


@dataclass(frozen=True)
class LimitAsk:
    """A policy's `limits: {on_exceed: ask, ask: {...}}`: a limit that `grant` names asks a
    person for more instead of stopping the run (gateway.harness.limit_requests).

    `approvers` may grant (team names); `grant` is what one grant adds to each limit;
    after `max_grants` grants (None: no such bound), or once a limit reached `max_total`,
    the limit stops the run as `on_exceed: stop` does.
    """

    approvers: tuple[str, ...]
    grant: Amounts
    max_grants: int | None = None
    max_total: Amounts = field(default_factory=dict)

    def asks(self, name: LimitName) -> bool:
        """Whether reaching limit `name` asks a person (else it stops the run)."""
        return name in self.grant


StopReason = Literal[
    "completed",  # the model answered in prose
    "max_turns",  # the turn cap
    "max_budget",  # the run budget
    "max_tool_calls",  # the cap on tool executions
    "max_duration",  # the wall-clock cap
    "approval",  # a call waits for a person
    "limit",  # a limit was reached and waits for a person's grant (on_exceed: ask)
    "cancelled",  # Stop, client disconnect (detail says which)
    "tool_error",  # a tool failed and the policy says tool errors are fatal
    "permanent_error",  # a tool failed in a way no retry can fix
    "repeated_call",  # the same call asked for N times in a row
    "stop_condition",  # any other stop condition of a policy
]


@dataclass(frozen=True)
class Stop:
    """A decision to end the run: its status, a bounded reason code, and words for people."""

    status: Status
    reason: StopReason
    detail: str = ""
    interruption: Interruption | None = None


class StopCondition(Protocol):
    """An exit checked at the top of every iteration, before the model is asked.

    The turn cap and the budget are two of these; a policy adds more (`repeated_call`).
    Returns None to go on, or the `Stop` to make.
    """

    def __call__(self, state: RunState) -> Stop | None: ...


RejectionText = Callable[[str, Any, str, str], str]
"""(tool name, args, reason, decided by) -> what the model reads for a rejected call."""
Checkpoint = Callable[[RunState], Awaitable[None]]


async def _no_checkpoint(state: RunState) -> None:
    return None


@dataclass
class RunOptions:
    """The governance of one run (tool catalog, error wording, dedupe, stops, approvals)."""

    tools: Mapping[str, Tool] = field(default_factory=dict)
    client_tools: Sequence[dict[str, Any]] = ()
    price: Price = DEFAULT_PRICE
    tool_errors: ToolErrorPolicy = field(default_factory=ToolErrorPolicy)
    dedupe: Dedupe = "read_only"
    # After this many model turns that called tools, not counting turns whose calls all failed, ask
    # without tools (None: always offer them).
    tool_rounds: int | None = None
    stop_when: Sequence[StopCondition] = ()
    approval: ApprovalPolicy = default_approval
    limit_ask: LimitAsk | None = None  # None: a limit stops the run (on_exceed: stop)
    rejection_text: RejectionText = rejection_text  # never return "": silence reads as success
    max_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, seed, ...: sent with every call
    on_event: EventSink = lambda event: None
    checkpoint: Checkpoint = _no_checkpoint
    # Told of every dollar this run spends (its turns and its tools'); a sub-run chains it
    # to the parent's ToolContext.spend so spend rolls up live through any depth.
    on_spend: Callable[[Usage, float], None] | None = None
    clock: Callable[[], float] = time.time  # wall-clock seconds, for limits.max_duration_s

    def tool_specs(self) -> list[dict[str, Any]]:
        """The `tools` array sent to the model: server-side tools, then the client's own."""
        return [t.spec.openai() for t in self.tools.values()] + list(self.client_tools)
