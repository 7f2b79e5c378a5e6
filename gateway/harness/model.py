"""The one I/O edge the loop needs to think: ask a model for the next message.

`Model` is a Protocol so the loop never knows whether it talks to the scripted provider
over HTTP, a local llama.cpp server, a hosted API, or an in-process fake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.harness.state import Message
from gateway.harness.trace import RepairFields, UpstreamAttemptFields
from gateway.harness.usage import Usage


@dataclass(frozen=True)
class ModelRequest:
    """One chat-completions call, as the loop decides it."""

    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    run_id: str = ""
    # What the run may still spend (None: no run budget); strict-mode adapters clamp to it.
    budget_remaining_usd: float | None = None
    # The run's budget asks a person before it is passed (`on_exceed: ask`): the whole call (its
    # prompt and its output allowance) must fit in `budget_remaining_usd`, and its output is
    # held to that allowance; else the model raises `LimitReached` without making the call.
    fit_budget: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelReply:
    """The assistant message of one turn and what it cost in tokens."""

    message: Message
    usage: Usage
    finish_reason: str = "stop"
    # When the upstream's own usage was not believed: what it reported (the loop traces
    # `usage_clamped` with it; `usage` is what is booked).
    reported: Usage | None = None
    upstream: str = ""
    # What the turn cost, when the model priced it itself (the gateway's governed model
    # prices with the route that answered); None: the loop prices it with `options.price`.
    cost_usd: float | None = None
    # The trace fields of each upstream attempt the turn took (`upstream_attempt` lines).
    attempts: tuple[UpstreamAttemptFields, ...] = ()
    # What the gateway repaired in the upstream's tool calls (gateway.providers.repair), as
    # `{repair, tool, detail}`: the loop traces a `tool_call_repaired` line for each.
    repairs: tuple[RepairFields, ...] = ()


class LimitReached(Exception):
    """A model call refused before it was made because it could pass the run's budget
    (`ModelRequest.fit_budget`): nothing was spent; the loop stops at the budget."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Model(Protocol):
    async def complete(self, request: ModelRequest) -> ModelReply:
        """Return the next assistant message. Raises `UpstreamError` on failure."""
        ...
