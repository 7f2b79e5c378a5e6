"""A driven run's trace events, as OpenTelemetry spans (tracing on; docs/telemetry.md).

The driver opens the drive's `invoke_agent {policy}` span (`agent_span`), linked to the run's
earlier drive and to the approval decisions made since (their span ids are in the run's own
trace events: `run_started`/`run_resumed` and `approval_decided` carry `traceId`/`spanId`,
so a drive on another replica, or after a restart, links across the pause). `RunSpans`, a
listener of the run's `TraceWriter`, turns the loop's events into spans as they are
emitted, in the loop's own task: `tool_start` opens `execute_tool {name}` and makes it
current (an HTTP tool, an MCP server and a sub-run's turns are its children), `tool_result`
ends it with its outcome; a deduped or denied call is an `execute_tool` span of no length;
`approval_required` and `limit_reached` are events on the drive's span. The model turns are
spans of their own (`governed_model`). A person's decision is an event on the span of the
request that made it (`decided`), and its trace line names that span: a call's
(`approval_decided`) and a limit's grant (`limit_granted`) are what later drives link to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gateway.config.settings import TeamConfig
from gateway.harness.model import LimitReached
from gateway.harness.state import Decision, RunState, public_run_id
from gateway.harness.trace import TraceLink
from gateway.providers.errors import UpstreamError
from gateway.server.http.errors import ApiError, LimitExceeded
from gateway.store.base import Event

if TYPE_CHECKING:
    from gateway.telemetry.tracing import AgentSpan, ChatSpan, Opened, Tracing

DRIVE_STARTS = frozenset({"run_started", "run_resumed"})
DECISIONS = {"approval_decided": "approval_decision", "limit_granted": "limit_grant"}
"""The trace lines of a person's decision that a later drive links to, and the link's kind."""


def agent_span(tracing: Tracing, state: RunState, seen: Sequence[tuple[int, Event]], start: str) -> AgentSpan:
    """The drive's span, linked to the run's last drive and the decisions recorded since."""
    from gateway.telemetry.tracing import link_to

    links: list[Any] = []
    for _, event in reversed(seen):
        if "traceId" not in event:
            continue
        kind = event.get("type")
        if kind in DECISIONS:
            link = link_to(event.get("traceId"), event.get("spanId"), **{"gateway.link": DECISIONS[kind]})
        elif kind in DRIVE_STARTS:
            link = link_to(event.get("traceId"), event.get("spanId"), **{"gateway.link": "earlier_drive"})
        else:
            continue
        if link is not None:
            links.append(link)
        if kind in DRIVE_STARTS:
            break
    return tracing.agent(state.policy, version=state.policy_version, run_id=state.public_id, team=state.team,
                         model=state.model, drive=start, links=reversed(links))


@contextlib.contextmanager
def chat_outcome(span: ChatSpan) -> Iterator[None]:
    """Ends a `chat {model}` span (a pass-through call's, or a server-side run's model turn)
    as the turn ended: refused by a limit, failed upstream or at the edge, or answered."""
    try:
        yield
    except LimitExceeded as exc:
        span.refused(exc.code or exc.type)
        raise
    except LimitReached:  # the run's own budget, asking a person for more (on_exceed: ask)
        span.refused("budget_exceeded")
        raise
    except UpstreamError as exc:
        span.failed(exc.code or "upstream_error")
        raise
    except ApiError as exc:
        span.failed(exc.code or exc.type)
        raise
    finally:
        span.end()


def decided(tracing: Tracing | None, team: TeamConfig, run_id: str, call_id: str, decision: Decision, *,
            tool: str | None = None, limit: str | None = None, expired: bool = False) -> TraceLink:
    """A person's decision on a run (on a call, or on a limit request: `limit`), made by the
    current request: an event on its span with the actor (tracing on), and the fields of
    the trace line that record it, so that the run's next drive links to that span."""
    if tracing is None:
        return {}
    tracing.decision(tool=tool, call_id=call_id, run_id=run_id, decision=decision.decision, by=decision.by,
                     key_id=team.caller.key_id if team.caller is not None else None, expired=expired, limit=limit)
    ids = tracing.current_ids()
    return {"traceId": ids[0], "spanId": ids[1]} if ids is not None else {}


def trace_link(opened: Opened) -> TraceLink:
    """The fields naming `opened`'s span in a trace event (none when it is not recorded)."""
    ids = opened.ids if opened.span.is_recording() else None
    return {"traceId": ids[0], "spanId": ids[1]} if ids is not None else {}


class RunSpans:
    """The listener (see the module docstring); `close()` ends what a failed drive left open."""

    def __init__(self, tracing: Tracing, agent: AgentSpan) -> None:
        self.tracing = tracing
        self.agent = agent
        self._tools: dict[tuple[str, str], Opened] = {}

    def __call__(self, event: Event) -> None:
        kind = event["type"]
        if kind not in _KINDS:
            return
        run_id, call_id, name = str(event["runId"]), str(event.get("callId") or ""), str(event.get("toolName") or "")
        args = event.get("args")
        args = str(args) if args is not None else None
        tracing = self.tracing
        if kind == "tool_start":
            self._tools[(run_id, call_id)] = tracing.tool(name, call_id, public_run_id(run_id), args)
        elif kind == "tool_result":
            opened = self._tools.pop((run_id, call_id), None)
            if opened is not None:
                tracing.tool_ended(opened, str(event.get("outcome") or ("ok" if event.get("ok") else "error")))
        elif kind in ("tool_deduped", "tool_denied"):
            opened = tracing.tool(name, call_id, public_run_id(run_id), args)
            tracing.tool_ended(opened, "deduped" if kind == "tool_deduped" else "denied",
                               deduped=kind == "tool_deduped")
        elif kind == "approval_required":
            self.agent.event("gateway.approval.required", tracing.call_attributes(name, call_id, public_run_id(run_id)))
        elif kind == "limit_reached":
            self.agent.event("gateway.limit.reached", {
                **tracing.limit_attributes(str(event.get("limit")), call_id, public_run_id(run_id)),
                **{f"gateway.limit.{k}": v for k in ("used", "cap") if isinstance(v := event.get(k), (int, float))}})

    def close(self) -> None:
        for opened in self._tools.values():
            opened.abandon()
        self._tools.clear()


_KINDS = frozenset({"tool_start", "tool_result", "tool_deduped", "tool_denied", "approval_required", "limit_reached"})
