"""The trace: one JSON object per event, every one carrying the run id.

Every kind is listed in `EventKind` and documented in docs/trace-events.md. Field names
are part of the contract (camelCase where the first version used it: `runId`, `costUsd`).
"""

from __future__ import annotations

import time
from typing import Any, Literal, get_args

from gateway.harness.options import EventSink

EventKind = Literal[
    "turn",
    "usage_clamped",
    "upstream_attempt",
    "tool_call_repaired",
    "tool_start",
    "tool_progress",
    "tool_result",
    "tool_deduped",
    "tool_denied",
    "approval_required",
    "approval_decided",
    "approval_dropped",
    "approval_expired",
    "run_started",
    "run_resumed",
    "run_stopped",
    "subrun_started",
    "cancel_requested",
    "embeddings",
]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)


def event(run_id: str, kind: EventKind, **fields: Any) -> dict[str, Any]:
    """The one builder of a trace line: `runId`, `type`, the fields, then `ts` (seconds)."""
    out: dict[str, Any] = {"runId": run_id, "type": kind}
    out.update(fields)
    out["ts"] = round(time.time(), 6)
    return out


class Tracer:
    """Stamps events with `runId`, `type` and `ts` and hands them to a sink."""

    __slots__ = ("run_id", "sink")

    def __init__(self, run_id: str, sink: EventSink) -> None:
        self.run_id = run_id
        self.sink = sink

    def __call__(self, kind: EventKind, **fields: Any) -> None:
        self.sink(event(self.run_id, kind, **fields))


class EventList:
    """A sink that keeps events in memory (tests, the demo)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def of(self, kind: EventKind) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]
