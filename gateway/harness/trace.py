"""The trace: one JSON object per event, every one carrying the run id.

Every kind is listed in `EventKind`, has a TypedDict of its fields here and is documented
in docs/trace-events.md (tests/harness/test_trace_events.py holds the doc and these types
together). Field names are part of the contract (camelCase where the first version used
it: `runId`, `costUsd`).

`Tracer` is the one builder of trace lines: its overloads give each kind its fields, so a
missing or misspelt field is a mypy error, and it stamps `runId`, `type` and `ts`.

Reading lines back: a line from a store or a trace file was written by whichever version
drove the run. Narrow on `event["type"]` (every version wrote it), then read the kind's
fields with `.get`: a line of an older version may lack a field added since.
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired[...] only from evaluated
# annotations (Python 3.11), and the doc test reads `__optional_keys__`.
import time
from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict, TypeVar, Unpack, cast, get_args, overload

from gateway.harness.execute import CallOutcome
from gateway.harness.usage import Usage, clamped_kinds

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
    "limit_reached",
    "limit_granted",
    "limit_rejected",
    "run_started",
    "run_resumed",
    "run_stopped",
    "subrun_started",
    "cancel_requested",
    "embeddings",
]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)

# The fields of each kind: what the caller of `Tracer` gives.


class TurnFields(TypedDict):
    turn: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    costUsd: float
    finish: str


class UsageClampedFields(TypedDict):
    upstream: str
    reported: dict[str, int]
    booked: dict[str, int]
    kinds: list[str]


def usage_clamped(upstream: str, reported: Usage, booked: Usage) -> UsageClampedFields:
    """The fields of a `usage_clamped` line: what `upstream` reported and what was booked
    instead (the one builder, for server-side turns, pass-through turns and embeddings)."""
    return {"upstream": upstream, "reported": reported.to_json(), "booked": booked.to_json(),
            "kinds": clamped_kinds(reported, booked)}


class UpstreamAttemptFields(TypedDict):
    """What `gateway.providers.failover.Attempt.fields` records of one attempt."""

    attempt: int
    upstream: str
    model: str
    outcome: str
    status: int | None
    seconds: float
    retryAfterS: float | None
    fallback: bool
    probe: bool


class RepairFields(TypedDict):
    """One repair of a reply's tool calls (`gateway.providers.repair.Repair.to_json`)."""

    repair: str
    tool: str
    detail: str


class ToolCallRepairedFields(RepairFields):
    upstream: str
    turn: int


class ToolCallFields(TypedDict):
    """A tool call as the model made it (`tool_start`, `tool_deduped`, `approval_required`)."""

    toolName: str
    args: str
    callId: str


class ToolProgressFields(TypedDict):
    toolName: str
    label: str


class ToolResultFields(TypedDict):
    toolName: str
    ms: float
    ok: bool
    callId: str
    outcome: CallOutcome  # cancelled: the Stop ended it; the call stays pending


class ToolDeniedFields(ToolCallFields):
    reason: str


class TraceLink(TypedDict):
    """The OpenTelemetry span that wrote the line, while tracing is on: the run's later drives
    link to it (docs/telemetry.md#runs-across-pauses)."""

    traceId: NotRequired[str]
    spanId: NotRequired[str]


class DecisionFields(TypedDict):
    """A decision on a call (`approval_decided`, `approval_expired`)."""

    callId: str
    toolName: str | None
    args: str | None
    decision: str
    reason: str
    by: str
    expired: bool


class ApprovalDecidedFields(DecisionFields, TraceLink):
    """A person's decision (`approval_decided`): also the span of the request that made it."""


class ApprovalDroppedFields(TypedDict):
    callId: str | None
    toolName: str | None
    args: str | None
    reason: str
    by: str


class LimitReachedFields(TypedDict):
    """A limit that asks a person was reached (`on_exceed: ask`)."""

    callId: str | None  # the request's id; None when nobody is asked (max_grants, max_total)
    limit: str
    used: float
    cap: float
    grant: dict[str, float]  # the grant proposed
    grants: int  # grants the run had before
    asked: bool
    detail: str


class LimitGrantedFields(TraceLink):
    """A person raised a run's limits: by how much, each limit before and after (and, while
    tracing is on, the span of the request that granted it)."""

    callId: str
    limit: str
    grant: dict[str, float]
    before: dict[str, float]
    after: dict[str, float]
    by: str
    reason: str


class LimitRejectedFields(TypedDict):
    """A limit request declined (by a person, or by the expiry): the run ends at the limit."""

    callId: str
    limit: str
    reason: str
    by: str
    expired: bool


class RunCounts(TypedDict):
    """Where the run stands (the end of every start line)."""

    turns: int
    costUsd: float


class RunStartedSetup(TypedDict):
    """What the call that starts a server-side run gives its `run_started` line."""

    team: str
    policy: str
    policyVersion: str
    model: str


class RunResumedSetup(TypedDict):
    """What the call that continues a run gives its `run_resumed` line: the limits from now
    on (a resume), or what a chat call brought (`by: "client"`)."""

    by: str
    maxTurns: NotRequired[int | None]
    maxBudgetUsd: NotRequired[float | None]
    maxToolCalls: NotRequired[int | None]
    maxDurationS: NotRequired[float | None]
    toolResults: NotRequired[int]
    messages: NotRequired[int]


StartSetup = RunStartedSetup | RunResumedSetup
"""The fields a call gives the line that starts a drive (`run_started` or `run_resumed`)."""


class RunStartedFields(RunStartedSetup, RunCounts, TraceLink):
    pass


class RunResumedFields(RunResumedSetup, RunCounts, TraceLink):
    pass


class RunStoppedFields(TypedDict):
    status: str
    reason: str | None
    turns: int
    toolCalls: NotRequired[int]
    costUsd: float
    detail: NotRequired[str | None]


class SubrunStartedFields(TypedDict):
    childRunId: str
    toolName: str
    callId: str


class CancelRequestedFields(TypedDict):
    reason: str
    by: str


class EmbeddingsFields(TypedDict):
    model: str
    prompt_tokens: int
    costUsd: float


# The lines: the fields, the kind, the run, and (all but `subrun_started`) the time.


class _Line(TypedDict):
    runId: str


class _Stamped(_Line):
    ts: float


class TurnEvent(_Stamped, TurnFields):
    type: Literal["turn"]


class UsageClampedEvent(_Stamped, UsageClampedFields):
    type: Literal["usage_clamped"]


class UpstreamAttemptEvent(_Stamped, UpstreamAttemptFields):
    type: Literal["upstream_attempt"]


class ToolCallRepairedEvent(_Stamped, ToolCallRepairedFields):
    type: Literal["tool_call_repaired"]


class ToolStartEvent(_Stamped, ToolCallFields):
    type: Literal["tool_start"]


class ToolProgressEvent(_Stamped, ToolProgressFields):
    type: Literal["tool_progress"]


class ToolResultEvent(_Stamped, ToolResultFields):
    type: Literal["tool_result"]


class ToolDedupedEvent(_Stamped, ToolCallFields):
    type: Literal["tool_deduped"]


class ToolDeniedEvent(_Stamped, ToolDeniedFields):
    type: Literal["tool_denied"]


class ApprovalRequiredEvent(_Stamped, ToolCallFields):
    type: Literal["approval_required"]


class ApprovalDecidedEvent(_Stamped, ApprovalDecidedFields):
    type: Literal["approval_decided"]


class ApprovalDroppedEvent(_Stamped, ApprovalDroppedFields):
    type: Literal["approval_dropped"]


class ApprovalExpiredEvent(_Stamped, DecisionFields):
    type: Literal["approval_expired"]


class LimitReachedEvent(_Stamped, LimitReachedFields):
    type: Literal["limit_reached"]


class LimitGrantedEvent(_Stamped, LimitGrantedFields):
    type: Literal["limit_granted"]


class LimitRejectedEvent(_Stamped, LimitRejectedFields):
    type: Literal["limit_rejected"]


class RunStartedEvent(_Stamped, RunStartedFields):
    type: Literal["run_started"]


class RunResumedEvent(_Stamped, RunResumedFields):
    type: Literal["run_resumed"]


class RunStoppedEvent(_Stamped, RunStoppedFields):
    type: Literal["run_stopped"]


class SubrunStartedEvent(_Line, SubrunStartedFields):
    type: Literal["subrun_started"]


class CancelRequestedEvent(_Stamped, CancelRequestedFields):
    type: Literal["cancel_requested"]


class EmbeddingsEvent(_Stamped, EmbeddingsFields):
    type: Literal["embeddings"]


Event = (TurnEvent | UsageClampedEvent | UpstreamAttemptEvent | ToolCallRepairedEvent | ToolStartEvent
         | ToolProgressEvent | ToolResultEvent | ToolDedupedEvent | ToolDeniedEvent | ApprovalRequiredEvent
         | ApprovalDecidedEvent | ApprovalDroppedEvent | ApprovalExpiredEvent | LimitReachedEvent | LimitGrantedEvent
         | LimitRejectedEvent | RunStartedEvent | RunResumedEvent
         | RunStoppedEvent | SubrunStartedEvent | CancelRequestedEvent | EmbeddingsEvent)
"""A trace line: one of the kinds above, told apart by `type`."""

EventSink = Callable[[Event], None]
"""Where a run's trace lines go (`RunOptions.on_event`)."""

E = TypeVar("E", bound=Event)


class Tracer:
    """The one builder of a run's trace lines: `runId`, `type`, the fields in the order
    given, then `ts` (seconds, 6 decimals). Each line goes to `sink` (if any) and is
    returned."""

    __slots__ = ("run_id", "sink")

    def __init__(self, run_id: str, sink: EventSink | None = None) -> None:
        self.run_id = run_id
        self.sink = sink

    @overload
    def __call__(self, kind: Literal["turn"], /, **fields: Unpack[TurnFields]) -> TurnEvent: ...
    @overload
    def __call__(self, kind: Literal["usage_clamped"], /, **fields: Unpack[UsageClampedFields]) -> UsageClampedEvent: ...
    @overload
    def __call__(self, kind: Literal["upstream_attempt"], /,
                 **fields: Unpack[UpstreamAttemptFields]) -> UpstreamAttemptEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_call_repaired"], /,
                 **fields: Unpack[ToolCallRepairedFields]) -> ToolCallRepairedEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_start"], /, **fields: Unpack[ToolCallFields]) -> ToolStartEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_progress"], /, **fields: Unpack[ToolProgressFields]) -> ToolProgressEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_result"], /, **fields: Unpack[ToolResultFields]) -> ToolResultEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_deduped"], /, **fields: Unpack[ToolCallFields]) -> ToolDedupedEvent: ...
    @overload
    def __call__(self, kind: Literal["tool_denied"], /, **fields: Unpack[ToolDeniedFields]) -> ToolDeniedEvent: ...
    @overload
    def __call__(self, kind: Literal["approval_required"], /,
                 **fields: Unpack[ToolCallFields]) -> ApprovalRequiredEvent: ...
    @overload
    def __call__(self, kind: Literal["approval_decided"], /,
                 **fields: Unpack[ApprovalDecidedFields]) -> ApprovalDecidedEvent: ...
    @overload
    def __call__(self, kind: Literal["approval_dropped"], /,
                 **fields: Unpack[ApprovalDroppedFields]) -> ApprovalDroppedEvent: ...
    @overload
    def __call__(self, kind: Literal["approval_expired"], /,
                 **fields: Unpack[DecisionFields]) -> ApprovalExpiredEvent: ...
    @overload
    def __call__(self, kind: Literal["limit_reached"], /,
                 **fields: Unpack[LimitReachedFields]) -> LimitReachedEvent: ...
    @overload
    def __call__(self, kind: Literal["limit_granted"], /,
                 **fields: Unpack[LimitGrantedFields]) -> LimitGrantedEvent: ...
    @overload
    def __call__(self, kind: Literal["limit_rejected"], /,
                 **fields: Unpack[LimitRejectedFields]) -> LimitRejectedEvent: ...
    @overload
    def __call__(self, kind: Literal["run_started"], /, **fields: Unpack[RunStartedFields]) -> RunStartedEvent: ...
    @overload
    def __call__(self, kind: Literal["run_resumed"], /, **fields: Unpack[RunResumedFields]) -> RunResumedEvent: ...
    @overload
    def __call__(self, kind: Literal["run_stopped"], /, **fields: Unpack[RunStoppedFields]) -> RunStoppedEvent: ...
    @overload
    def __call__(self, kind: Literal["subrun_started"], /,
                 **fields: Unpack[SubrunStartedFields]) -> SubrunStartedEvent: ...
    @overload
    def __call__(self, kind: Literal["cancel_requested"], /,
                 **fields: Unpack[CancelRequestedFields]) -> CancelRequestedEvent: ...
    @overload
    def __call__(self, kind: Literal["embeddings"], /, **fields: Unpack[EmbeddingsFields]) -> EmbeddingsEvent: ...

    def __call__(self, kind: EventKind, /, **fields: Any) -> Event:
        out: dict[str, Any] = {"runId": self.run_id, "type": kind}
        out.update(fields)
        if kind != "subrun_started":  # the contract: that line has no `ts`
            out["ts"] = round(time.time(), 6)
        line = cast(Event, out)
        if self.sink is not None:
            self.sink(line)
        return line

    def start(self, kind: Literal["run_started", "run_resumed"], setup: StartSetup | None,
              counts: RunCounts, link: TraceLink | None = None) -> RunStartedEvent | RunResumedEvent:
        """The line that starts a drive: what the call gave (`setup`: a `RunStartedSetup` for
        `run_started`, which the caller pairs; None for a drive no call prepared), then where
        the run stands, then the drive's span (tracing on)."""
        return cast(RunStartedEvent | RunResumedEvent, self(cast(Any, kind), **(setup or {}), **counts,
                                                            **(link or {})))


def with_run_id(event: E, run_id: str) -> E:
    """A copy of `event` under another run id (the API shows the client's id, not the stored one)."""
    out = dict(event)
    out["runId"] = run_id
    return cast(E, out)


class EventList:
    """A sink that keeps events in memory (tests, the demo)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e["type"] == kind]
