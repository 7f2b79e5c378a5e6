"""OpenTelemetry traces of the gateway, exported over OTLP/HTTP (docs/telemetry.md).

`Tracing.start(config)` makes the process's tracer provider (its own, not the global one:
tests run several apps in one process), sampled `ParentBased(TraceIdRatioBased(ratio))`
and exported by a `BatchSpanProcessor` on its own thread. Every span the gateway makes is
opened here, named and attributed per the semantic conventions (`opentelemetry-semantic-
conventions`; the GenAI ones from its incubating modules), so attribute names are written
once:

    {method} {route}          SERVER  each HTTP call (parent: the client's `traceparent`)
      chat {model}            CLIENT  a pass-through model turn (admission and booking as events)
        POST                  CLIENT  each upstream attempt (retries and fallbacks: one each)
      invoke_agent {policy}   INTERNAL a server-side run's drive (links: its earlier drives,
                                       the approval decisions it resumes after)
        chat {model}          CLIENT  each model turn of the loop
          POST                CLIENT  its attempts
        execute_tool {name}   INTERNAL each tool call (deduped and denied ones too, 0 long)

A span that other spans nest under is made *current* (`attach`) while it lasts, so spans
opened below it, and `inject` (the `traceparent` of outgoing calls), find it without being
handed it. Prompt and completion contents are recorded only with `capture_content`, each
attribute cut to `content_max_chars`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Final

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import GenAiOperationNameValues as Operation
from opentelemetry.semconv._incubating.attributes.process_attributes import PROCESS_PID
from opentelemetry.semconv.attributes.client_attributes import CLIENT_ADDRESS
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.http_attributes import (
    HTTP_REQUEST_METHOD,
    HTTP_REQUEST_RESEND_COUNT,
    HTTP_RESPONSE_STATUS_CODE,
    HTTP_ROUTE,
)
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID, SERVICE_NAME, SERVICE_VERSION
from opentelemetry.semconv.attributes.url_attributes import URL_PATH, URL_SCHEME
from opentelemetry.semconv.attributes.user_agent_attributes import USER_AGENT_ORIGINAL
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import __version__
from gateway.config.telemetry import TelemetryConfig
from gateway.harness.usage import Usage
from gateway.providers.failover import Attempt
from gateway.providers.upstream import Upstream

log = logging.getLogger(__name__)

# Attributes of the gateway's own (no convention names them).
RUN_ID: Final = "gateway.run.id"
TEAM: Final = "gateway.team"
POLICY: Final = "gateway.policy"
KEY_ID: Final = "gateway.key.id"
LIMIT: Final = "gateway.limit"
LIMIT_REQUEST: Final = "gateway.limit.request_id"
RUN_STATUS: Final = "gateway.run.status"
STOP_REASON: Final = "gateway.run.stop_reason"
RUN_TURNS: Final = "gateway.run.turns"
RUN_COST: Final = "gateway.run.cost_usd"
RUN_TOOL_CALLS: Final = "gateway.run.tool_calls"
DRIVE: Final = "gateway.run.drive"
TURN_COST: Final = "gateway.turn.cost_usd"
UPSTREAM: Final = "gateway.upstream"
DEPLOYMENT: Final = "gateway.deployment"
TOOL_OUTCOME: Final = "gateway.tool.outcome"
TOOL_DEDUPED: Final = "gateway.tool.deduped"
ATTEMPT: Final = "gateway.attempt.number"
ATTEMPT_OUTCOME: Final = "gateway.attempt.outcome"
ATTEMPT_FALLBACK: Final = "gateway.attempt.fallback"
ATTEMPT_PROBE: Final = "gateway.attempt.probe"
ERROR_CODE: Final = "gateway.error.code"

PROVIDERS: Final = {"openai": "openai", "azure": "azure.ai.openai"}
"""`gen_ai.provider.name` of an upstream kind; other kinds (scripted, local) are named by their kind."""

_PROPAGATOR: Final = TraceContextTextMapPropagator()
"""W3C `traceparent`/`tracestate` (stateless)."""


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit]


def hex_ids(span: Span) -> tuple[str, str] | None:
    """(trace id, span id) of a recorded span, as 32 and 16 hex digits; None otherwise."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


def link_to(trace_id: object, span_id: object, **attributes: str) -> Link | None:
    """A span link to (trace id, span id) as stored in a trace event (hex), or None if they are not ids."""
    try:
        tid, sid = int(str(trace_id), 16), int(str(span_id), 16)
    except ValueError:
        return None
    if not (0 < tid < 1 << 128 and 0 < sid < 1 << 64):
        return None
    sc = SpanContext(tid, sid, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return Link(sc, attributes or None)


class Opened:
    """A span, current (`attach`ed) from its start until `end()`."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: object | None = otel_context.attach(trace.set_span_in_context(span))

    @property
    def ids(self) -> tuple[str, str] | None:
        return hex_ids(self.span)

    @property
    def recording(self) -> bool:
        """Not ended (and sampled): what is told to it now is kept."""
        return self.span.is_recording()

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self.span.add_event(name, dict(attributes))

    def end(self) -> None:
        """Detach (in the task that attached it) and end; a second call does nothing."""
        token, self._token = self._token, None
        if token is None:
            return
        otel_context.detach(token)  # type: ignore[arg-type]
        self.span.end()

    def abandon(self) -> None:
        """End it from wherever (its task is gone: nothing to detach there)."""
        if self._token is not None:
            self._token = None
            self.span.set_attribute(TOOL_OUTCOME, "abandoned")
            self.span.end()


class ServerSpan(Opened):
    """The SERVER span of one HTTP request."""

    __slots__ = ()

    def finish(self, status: int, error_code: str | None) -> None:
        span = self.span
        span.set_attribute(HTTP_RESPONSE_STATUS_CODE, status)
        if status >= 500:  # a 4xx is the client's doing: not an error of this server (HTTP conventions)
            span.set_attribute(ERROR_TYPE, error_code or str(status))
            span.set_status(Status(StatusCode.ERROR))
        if error_code:
            span.set_attribute(ERROR_CODE, error_code)
        self.end()


class ChatSpan(Opened):
    """`chat {model}`: one model turn, pass-through or server-side."""

    __slots__ = ("_tracing",)

    def __init__(self, span: Span, tracing: Tracing) -> None:
        super().__init__(span)
        self._tracing = tracing

    def admitted(self, seconds: float, max_tokens: int | None) -> None:
        """The admission step (turn slot, budget holds, rate limits) let the call go."""
        attributes: dict[str, Any] = {"gateway.seconds": round(seconds, 6)}
        if max_tokens is not None:
            attributes[gen_ai.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        self.span.add_event("gateway.admission", attributes)

    def refused(self, code: str) -> None:
        self.span.add_event("gateway.admission", {"gateway.refused": code})
        self.span.set_attribute(ERROR_CODE, code)

    def booked(self, *, usage: Usage, cost_usd: float, finish: str, upstream: Upstream | None, deployment: str,
               response_model: str | None = None, seconds: float | None = None, spooled: bool = False) -> None:
        """The turn as booked on its run: the usage and cost the run was charged."""
        span = self.span
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
            gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
            gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: (finish,),
            gen_ai.GEN_AI_RESPONSE_MODEL: response_model or deployment,
            TURN_COST: cost_usd,
            DEPLOYMENT: deployment,
        }
        if upstream is not None:
            attributes[UPSTREAM] = upstream.name
            attributes[gen_ai.GEN_AI_PROVIDER_NAME] = PROVIDERS.get(upstream.config.kind, upstream.config.kind)
        span.set_attributes(attributes)
        event: dict[str, Any] = {"gateway.spooled": spooled}
        if seconds is not None:
            event["gateway.seconds"] = round(seconds, 6)
        span.add_event("gateway.booking", event)

    def output(self, message: Mapping[str, Any]) -> None:
        """The reply (only with `capture_content`)."""
        if self._tracing.capture:
            self.span.set_attribute(gen_ai.GEN_AI_OUTPUT_MESSAGES, self._tracing.content([message]))

    def failed(self, code: str) -> None:
        self.span.set_attribute(ERROR_TYPE, code)
        self.span.set_status(Status(StatusCode.ERROR))


class AgentSpan(Opened):
    """`invoke_agent {policy}`: one drive of a server-side run."""

    __slots__ = ()

    def stopped(self, *, status: str, reason: str, turns: int, cost_usd: float, tool_calls: int, usage: Usage) -> None:
        """Where the run stands after the drive; `usage`: the tokens this drive spent."""
        self.span.set_attributes({
            RUN_STATUS: status, STOP_REASON: reason, RUN_TURNS: turns, RUN_COST: cost_usd,
            RUN_TOOL_CALLS: tool_calls,
            gen_ai.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
            gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        })
        if status == "failed":
            self.span.set_status(Status(StatusCode.ERROR, reason))


class _AttemptSpan:
    """One upstream attempt, current while it runs (its `traceparent` goes to the upstream)."""

    __slots__ = ("_opened",)

    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    def __call__(self, attempt: Attempt | None) -> None:
        span = self._opened.span
        if attempt is None:
            span.set_attribute(ATTEMPT_OUTCOME, "abandoned")
        else:
            span.set_attributes({ATTEMPT_OUTCOME: attempt.outcome, "gateway.seconds": round(attempt.seconds, 6)})
            if attempt.status is not None:
                span.set_attribute(HTTP_RESPONSE_STATUS_CODE, attempt.status)
            if attempt.outcome != "ok":
                span.set_attribute(ERROR_TYPE, attempt.outcome)
                span.set_status(Status(StatusCode.ERROR))
        self._opened.end()


class Tracing:
    """This process's tracer and the spans of the gateway."""

    def __init__(self, config: TelemetryConfig, provider: TracerProvider) -> None:
        self.config = config
        self.provider = provider
        self.tracer = provider.get_tracer("gateway", __version__)
        self.capture = config.capture_content
        self.max_chars = config.content_max_chars

    @classmethod
    def start(cls, config: TelemetryConfig, worker: int | None = None) -> Tracing:
        """The tracer provider of `config` (its exporter's thread starts with the first span)."""
        assert config.otlp_endpoint is not None
        instance = f"{socket.gethostname()}/{os.getpid()}" + ("" if worker is None else f"/worker{worker}")
        resource = Resource.create({SERVICE_NAME: config.service_name, SERVICE_VERSION: __version__,
                                    SERVICE_INSTANCE_ID: instance, PROCESS_PID: os.getpid(), **config.resource})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, headers=dict(config.headers) or None, timeout=10)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(config, provider)

    def shutdown(self) -> None:
        """Export what is left and stop (blocks up to the exporter's timeout: run it on a thread)."""
        try:
            self.provider.shutdown()
        except Exception:  # an unreachable collector must not fail the shutdown
            log.exception("the trace exporter did not shut down cleanly")

    # W3C trace context

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The client's trace context (`traceparent`, `tracestate`), if it sent a valid one."""
        if "traceparent" not in headers:
            return None
        found = _PROPAGATOR.extract(headers)
        return found if trace.get_current_span(found).get_span_context().is_valid else None

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add the current span's `traceparent` (and `tracestate`) to outgoing `headers`."""
        _PROPAGATOR.inject(headers)

    def current_ids(self) -> tuple[str, str] | None:
        """(trace id, span id) of the current span when it is recorded (sampled)."""
        span = trace.get_current_span()
        return hex_ids(span) if span.is_recording() else None

    def trace_id(self) -> str | None:
        """The current sampled trace's id (32 hex digits): the metrics' exemplar."""
        sc = trace.get_current_span().get_span_context()
        if not (sc.is_valid and sc.trace_flags.sampled):
            return None
        return format(sc.trace_id, "032x")

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """An event on the current span (the request's, or the drive's)."""
        trace.get_current_span().add_event(name, dict(attributes))

    @staticmethod
    def call_attributes(tool: str, call_id: str, run_id: str) -> dict[str, Any]:
        """Which call of which run an event is about."""
        return {gen_ai.GEN_AI_TOOL_NAME: tool, gen_ai.GEN_AI_TOOL_CALL_ID: call_id, RUN_ID: run_id}

    @staticmethod
    def limit_attributes(limit: str, request_id: str, run_id: str) -> dict[str, Any]:
        """Which limit request of which run an event is about."""
        return {LIMIT: limit, LIMIT_REQUEST: request_id, RUN_ID: run_id}

    def decision(self, *, tool: str | None, call_id: str, run_id: str, decision: str, by: str,
                 key_id: str | None, expired: bool, limit: str | None = None) -> None:
        """An approval decided (a call's, or a limit request's: `limit`): an event on the
        current span (the decision's request), with its actor."""
        attributes = self.limit_attributes(limit, call_id, run_id) if limit else self.call_attributes(
            tool or "", call_id, run_id)
        attributes.update({"gateway.approval.decision": decision, "gateway.approval.by": by,
                           "gateway.approval.expired": expired})
        if key_id:
            attributes[KEY_ID] = key_id
        self.event("gateway.approval.decided", attributes)

    def content(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return _bounded(orjson.dumps(list(messages), default=str).decode(), self.max_chars)

    # Spans

    def server(self, method: str, route: str, path: str, headers: Mapping[str, str], scheme: str,
               peer: str | None) -> ServerSpan:
        attributes: dict[str, Any] = {HTTP_REQUEST_METHOD: method, HTTP_ROUTE: route, URL_PATH: path,
                                      URL_SCHEME: scheme}
        agent = headers.get("User-Agent")
        if agent:
            attributes[USER_AGENT_ORIGINAL] = agent[:256]
        if peer:
            attributes[CLIENT_ADDRESS] = peer
        span = self.tracer.start_span(f"{method} {route}", context=self.extract(headers), kind=SpanKind.SERVER,
                                      attributes=attributes)
        return ServerSpan(span)

    def chat(self, model: str, *, run_id: str, team: str, policy: str, stream: bool = False,
             messages: Sequence[Mapping[str, Any]] | None = None) -> ChatSpan:
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: Operation.CHAT.value, gen_ai.GEN_AI_REQUEST_MODEL: model,
            gen_ai.GEN_AI_CONVERSATION_ID: run_id, RUN_ID: run_id, TEAM: team, POLICY: policy,
        }
        if stream:
            attributes[gen_ai.GEN_AI_REQUEST_STREAM] = True
        if self.capture and messages is not None:
            attributes[gen_ai.GEN_AI_INPUT_MESSAGES] = self.content(messages)
        span = self.tracer.start_span(f"{Operation.CHAT.value} {model}", kind=SpanKind.CLIENT, attributes=attributes)
        return ChatSpan(span, self)

    def agent(self, policy: str, *, version: str, run_id: str, team: str, model: str, drive: str,
              links: Iterable[Link] = ()) -> AgentSpan:
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: Operation.INVOKE_AGENT.value, gen_ai.GEN_AI_AGENT_NAME: policy,
            gen_ai.GEN_AI_AGENT_VERSION: version, gen_ai.GEN_AI_CONVERSATION_ID: run_id,
            gen_ai.GEN_AI_REQUEST_MODEL: model, RUN_ID: run_id, TEAM: team, POLICY: policy, DRIVE: drive,
        }
        span = self.tracer.start_span(f"{Operation.INVOKE_AGENT.value} {policy}", kind=SpanKind.INTERNAL,
                                      attributes=attributes, links=list(links))
        return AgentSpan(span)

    def tool(self, name: str, call_id: str, run_id: str, args: str | None) -> Opened:
        """`execute_tool {name}`, current while the tool runs (an HTTP tool gets its `traceparent`)."""
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: Operation.EXECUTE_TOOL.value, gen_ai.GEN_AI_TOOL_NAME: name,
            gen_ai.GEN_AI_TOOL_CALL_ID: call_id, gen_ai.GEN_AI_TOOL_TYPE: "function", RUN_ID: run_id,
        }
        if self.capture and args is not None:
            attributes[gen_ai.GEN_AI_TOOL_CALL_ARGUMENTS] = _bounded(args, self.max_chars)
        span = self.tracer.start_span(f"{Operation.EXECUTE_TOOL.value} {name}", kind=SpanKind.INTERNAL,
                                      attributes=attributes)
        return Opened(span)

    @staticmethod
    def tool_ended(opened: Opened, outcome: str, *, deduped: bool = False) -> None:
        opened.span.set_attributes({TOOL_OUTCOME: outcome, TOOL_DEDUPED: deduped})
        if outcome == "error":
            opened.span.set_status(Status(StatusCode.ERROR))
        opened.end()

    def begin(self, number: int, upstream: Upstream, model: str, fallback: bool, probe: bool) -> _AttemptSpan:
        """An upstream attempt (`providers.failover.AttemptTracer`)."""
        attributes: dict[str, Any] = {HTTP_REQUEST_METHOD: "POST", UPSTREAM: upstream.name, DEPLOYMENT: model,
                                      ATTEMPT: number, ATTEMPT_FALLBACK: fallback, ATTEMPT_PROBE: probe}
        if number > 1:
            attributes[HTTP_REQUEST_RESEND_COUNT] = number - 1
        host, port = upstream.address
        if host:
            attributes[SERVER_ADDRESS] = host
            if port is not None:
                attributes[SERVER_PORT] = port
        span = self.tracer.start_span("POST", kind=SpanKind.CLIENT, attributes=attributes)
        return _AttemptSpan(Opened(span))
