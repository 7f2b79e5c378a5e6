"""Prometheus metrics of one gateway app, in a registry of its own (no process globals).

Labels stay bounded: routes are route templates (never raw paths), models are the names
the config routes (anything else is "other"), reasons are short codes, and no label ever
carries a run id. The run id goes in exemplars instead: every counter increment and
histogram observation made while a request is served (`exemplar_run`) carries
`{run_id="..."}`, which only the OpenMetrics exposition shows (`exposition(accept)`
answers OpenMetrics to a scraper that asks for it, as Prometheus does, and the classic
text format otherwise).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from collections.abc import Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    PlatformCollector,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.harness.usage import Usage
from gateway.providers.repair import REPAIR_KINDS, Repair
from gateway.server.process_metrics import WorkersCollector, register_standard

OTHER = "other"
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

EXEMPLAR_LABEL = "run_id"
TRACE_LABEL = "trace_id"
MAX_EXEMPLAR_RUN_ID = 128 - len(EXEMPLAR_LABEL)
"""OpenMetrics caps an exemplar's label names and values at 128 characters together (and
prometheus_client raises past it); a longer run id (up to 128 are valid) gets no exemplar."""
MAX_RUN_ID_BESIDE_TRACE = MAX_EXEMPLAR_RUN_ID - len(TRACE_LABEL) - 32
"""With tracing on, the trace id (32 hex digits) comes first; a run id longer than this is left out."""
TraceIdSource = Callable[[], "str | None"]

RunIdSource = Callable[[], "str | None"]
"""Tells the run id that metrics recorded now belong to (None: no run)."""

# A ContextVar, not shared state: each request's task (and every task it starts, which
# copies the context) sees its own source. Created once, at module level, as the contextvars
# documentation requires (contexts keep strong references to their variables).
_RUN_ID_SOURCE: ContextVar[RunIdSource | None] = ContextVar("gateway_metrics_run_id_source", default=None)


def exemplar_run(source: RunIdSource) -> Token[RunIdSource | None]:
    """Metrics recorded from now on in this context, and in the tasks it starts, carry
    `source()` as their `run_id` exemplar. Undo with `end_exemplar_run(token)`."""
    return _RUN_ID_SOURCE.set(source)


def end_exemplar_run(token: Token[RunIdSource | None]) -> None:
    """Undo `exemplar_run`."""
    _RUN_ID_SOURCE.reset(token)


def _exemplar(trace_id: TraceIdSource | None = None) -> dict[str, str] | None:
    """`{"run_id": ...}` for the run being served, or None (no run, or an id too long); with
    tracing on, the sampled trace's `trace_id` too (Grafana jumps from it to the trace)."""
    source = _RUN_ID_SOURCE.get()
    run_id = source() if source is not None else None
    if trace_id is not None:
        tid = trace_id()
        if tid is not None:
            if not run_id or len(run_id) > MAX_RUN_ID_BESIDE_TRACE:
                return {TRACE_LABEL: tid}
            return {EXEMPLAR_LABEL: run_id, TRACE_LABEL: tid}
    if not run_id or len(run_id) > MAX_EXEMPLAR_RUN_ID:
        return None
    return {EXEMPLAR_LABEL: run_id}

WEBHOOK_OUTCOMES = ("delivered", "retried", "failed")
TOOL_OUTCOMES = ("ok", "error", "deduped", "denied")
LIMIT_OUTCOMES = ("asked", "exhausted", "granted", "rejected", "expired")
"""The outcomes of `gateway_limit_requests_total` (`Metrics.on_limit_lines`)."""
PASS_THROUGH_STOPS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"), ("max_turns_exceeded", "max_turns"), ("budget_exceeded", "max_budget"),
    ("budget_exceeded", "team_budget"), ("max_duration_exceeded", "max_duration"), ("interrupted", "cancelled"))
"""(status, reason) a pass-through run can stop with (docs/runs.md, Reasons)."""
ASK_STOP: tuple[str, str] = ("interrupted", "limit")
"""The stop of a run whose policy asks a person for more of a limit (`on_exceed: ask`), in
either mode; exported at 0 only for such policies."""
RUN_STOPS: tuple[tuple[str, str], ...] = (*PASS_THROUGH_STOPS, ("max_tool_calls_exceeded", "max_tool_calls"),
                                          ("interrupted", "approval"), ASK_STOP, ("interrupted", "crashed"),
                                          ("interrupted", "rate_limited"), ("failed", "permanent_error"),
                                          ("failed", "tool_error"), ("failed", "repeated_call"),
                                          ("failed", "upstream_error"), ("failed", "internal_error"))
"""Every (status, reason) of docs/runs.md's Reasons table: what a server-side run can stop with."""


@dataclass(frozen=True)
class KnownPolicy:
    """What the metrics know of a policy at start: its name, its tools if it runs them, and
    the limits it asks a person about (`limits.on_exceed: ask`)."""

    name: str
    tools: tuple[str, ...] = ()
    asks: tuple[str, ...] = ()

ToolOutcome = str
"""ok | error | denied | rejected | deduped | cancelled | timeout (any short code)."""


STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def _code(value: str) -> str:
    """A label value that must be a short code; free text collapses to "other"."""
    return value if _CODE.match(value) else OTHER


class Metrics:
    """Every metric of docs/metrics.md."""

    def __init__(self, known_models: Iterable[str] = (), upstreams: Iterable[str] = (),
                 webhooks: Iterable[tuple[str, Iterable[str]]] = ()) -> None:
        """`webhooks`: (name, events) of each configured webhook, whose delivery counters start at 0."""
        self.registry = CollectorRegistry(auto_describe=True)
        # `gateway serve --workers N` sets it: every worker writes its figures to files in
        # that folder, and a scrape of any worker reads all of them (no exemplars then).
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.known_models: frozenset[str] = frozenset()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.trace_id: TraceIdSource | None = None
        """The current sampled trace's id, for the exemplars (set while tracing is on)."""
        self._turn_children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}
        r = self.registry
        self.requests = Counter("gateway_requests_total", "HTTP requests by route template and status.",
                                ["route", "code"], registry=r)
        self.turns = Counter("gateway_turns_total", "Model turns (upstream calls that completed).",
                             ["team", "policy", "model"], registry=r)
        self.tokens = Counter("gateway_tokens_total", "Tokens by kind (prompt | completion).",
                              ["team", "model", "kind"], registry=r)
        self.cost = Counter("gateway_cost_usd_total", "Spend in USD at configured prices.",
                            ["team", "model"], registry=r)
        self.runs_stopped = Counter("gateway_runs_stopped_total", "Runs that stopped, by status and reason code.",
                                    ["team", "policy", "status", "reason"], registry=r)
        self.usage_clamped = Counter("gateway_usage_clamped_total",
                                     "Upstream replies whose reported usage was beyond belief and booked at the "
                                     "gateway's own count instead, by upstream and kind (prompt | completion).",
                                     ["upstream", "kind"], registry=r)
        self.upstream_attempts = Counter("gateway_upstream_attempts_total",
                                         "Upstream attempts (a call retried or failed over makes several), by "
                                         "upstream and outcome (ok, unreachable, timeout, rate_limited, "
                                         "server_error, denied, rejected, malformed, cut, misconfigured).",
                                         ["upstream", "outcome"], registry=r)
        self.tool_call_repairs = Counter("gateway_tool_call_repairs_total",
                                         "Upstream tool calls the gateway repaired (upstream option tool_repair), "
                                         "by upstream and kind of repair.", ["upstream", "kind"], registry=r)
        self.tool_calls = Counter("gateway_tool_calls_total", "Server-side tool calls by outcome.",
                                  ["policy", "tool", "outcome"], registry=r)
        self.tool_duration = Histogram("gateway_tool_duration_seconds", "Server-side tool run time.",
                                       ["tool"], registry=r,
                                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.upstream_duration = Histogram("gateway_upstream_duration_seconds", "Upstream call time (whole answer).",
                                           ["upstream", "model"], registry=r,
                                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("gateway_ttft_seconds", "Time to the first streamed chunk from the upstream.",
                              ["upstream", "model"], registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.overhead = Histogram("gateway_overhead_seconds", "Handler time minus upstream time, per proxied call.",
                                  registry=r,
                                  buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.team_spend = Gauge("gateway_team_spend_usd", "Team spend in the current budget period (ledger).",
                                ["team"], registry=r, multiprocess_mode="mostrecent")
        self.team_remaining = Gauge("gateway_team_budget_remaining_usd",
                                    "Team budget left in the period (budget - spent - reserved).", ["team"], registry=r,
                                    multiprocess_mode="mostrecent")
        self.approvals_pending = Gauge("gateway_approvals_pending", "Calls waiting for a person's decision.",
                                       ["team"], registry=r, multiprocess_mode="mostrecent")
        self.limit_requests = Counter(
            "gateway_limit_requests_total",
            "Limits that ask a person (on_exceed: ask), by policy, limit and outcome (asked, exhausted: reached with "
            "no grant left, granted, rejected, expired).", ["policy", "limit", "outcome"], registry=r)
        self.runs_active = Gauge("gateway_runs_active", "Runs with a call in progress (summed over the live workers).",
                                 registry=r, multiprocess_mode="livesum")
        self.turns_per_run = Histogram("gateway_turns_per_run", "Turns of a run when it stops.", ["team", "policy"],
                                       registry=r, buckets=(1, 2, 3, 5, 8, 13, 20, 30, 50, 100, 200))
        self.cost_per_run = Histogram("gateway_cost_per_run_usd", "Cost of a run when it stops.", ["team", "policy"],
                                      registry=r, buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                           0.1, 0.5, 1, 5))

        self.webhook_deliveries = Counter(
            "gateway_webhook_deliveries_total",
            "Webhook delivery attempts by webhook name, event and outcome (delivered | retried | failed: given up).",
            ["webhook", "event", "outcome"], registry=r)
        self.tool_threads = Gauge("gateway_tool_threads", "Threads of the pool sync python tools run on "
                                  "(server.tool_threads; summed over the live workers).", registry=r,
                                  multiprocess_mode="livesum")
        self.tool_threads_busy = Gauge("gateway_tool_threads_busy", "Tool threads running a sync python tool now.",
                                       registry=r, multiprocess_mode="livesum")
        self.tool_calls_waiting = Gauge("gateway_tool_calls_waiting", "Sync python tool calls waiting for a tool "
                                        "thread (all busy): the pool is saturated while this is above 0.",
                                        registry=r, multiprocess_mode="livesum")
        self.work_waits = Counter("gateway_work_waits_total", "Calls that waited for a slot of the process's own "
                                  "work (server.work_slots), by team: the fair share at work.", ["team"], registry=r)
        self.connections = Gauge("gateway_connections", "Client connections this process serves now.", registry=r,
                                 multiprocess_mode="livesum")
        self.connections_refused = Counter("gateway_connections_refused_total",
                                           "Client connections refused past server.max_connections.", registry=r)
        self.request_timeouts = Counter("gateway_request_timeouts_total", "Requests whose head or body a client "
                                        "sent too slowly (kind header | body), answered 408.", ["kind"], registry=r)
        for kind in ("header", "body"):
            self.request_timeouts.labels(kind)
        self.ready = Gauge("gateway_ready", "1 while the readiness check passes in this process, 0 while it fails "
                           "(GET /readyz; the minimum over the live workers).", ["check"], registry=r,
                           multiprocess_mode="livemin")
        self.spooled = Gauge("gateway_spool_records", "Turns (and spend) waiting in the spool for the store to take "
                             "them.", registry=r, multiprocess_mode="livemax")
        self.webhook_outbox = Gauge("gateway_webhook_outbox_depth",
                                    "Notices in the store's outbox not yet delivered nor given up (every replica's).",
                                    registry=r, multiprocess_mode="mostrecent")
        self.store_seconds = Histogram("gateway_store_seconds", "Time of one store call, by operation (a method of "
                                       "the Store protocol).", ["op"], registry=r, buckets=STORE_BUCKETS)
        self.loop_lag = Gauge("gateway_event_loop_lag_seconds", "How late the event loop ran a timer due now, the "
                              "most over the last 5 s (each live worker's).", registry=r, multiprocess_mode="liveall")
        self.upstream_connections = Gauge("gateway_upstream_connections", "This process's connections to the "
                                          "upstreams, by state (in_use | idle; summed over the live workers).",
                                          ["state"], registry=r, multiprocess_mode="livesum")
        for state in ("in_use", "idle"):
            self.upstream_connections.labels(state)
        if self.multiprocess_dir is None:  # multiprocess mode: every worker's, at scrape (`_scraped`)
            register_standard(r)
        self.configure(known_models, upstreams, webhooks)

    def configure(self, known_models: Iterable[str], upstreams: Iterable[str],
                  webhooks: Iterable[tuple[str, Iterable[str]]]) -> None:
        """What the config names (at start, and on a reload): its routed models become model
        labels (the ones known before stay, so labels stay bounded by what configs named), and
        the series of its upstreams and webhooks are exported at 0 from now on, so a dashboard
        shows "none" rather than "no data"."""
        self.known_models = self.known_models | frozenset(known_models)
        for upstream in upstreams:
            for kind in ("prompt", "completion"):
                self.usage_clamped.labels(upstream, kind)
            self.upstream_attempts.labels(upstream, "ok")
            for repair in REPAIR_KINDS:
                self.tool_call_repairs.labels(upstream, repair)
        for name, events in webhooks:
            for event in events:
                for outcome in WEBHOOK_OUTCOMES:
                    self.webhook_deliveries.labels(name, event, outcome)

    def start_at_zero(self, teams: Mapping[str, Sequence[KnownPolicy]]) -> None:
        """Export at 0 the label sets of the counters the dashboards query that the config
        knows before any traffic: each team's turns, tokens and cost for each model it routes
        by name, its runs' stops by policy (the reasons the policy's mode can have), each
        policy's tool calls by outcome, and its limit requests by limit and outcome. So
        `rate()` and `increase()` panels read 0, not "No data", and count a series' first
        increment (Prometheus cannot see the 0 -> 1 of a series born at 1). `teams`: team ->
        the policies it may use."""
        models = sorted(self.known_models)
        known: dict[str, KnownPolicy] = {}
        for team, policies in teams.items():
            for model in models:
                self._child(self.cost, team, model)
                for kind in ("prompt", "completion"):
                    self._child(self.tokens, team, model, kind)
            for policy in policies:
                known[policy.name] = policy
                for model in models:
                    self._child(self.turns, team, policy.name, model)
                stops = [s for s in (RUN_STOPS if policy.tools else PASS_THROUGH_STOPS) if s != ASK_STOP]
                for status, reason in [*stops, ASK_STOP] if policy.asks else stops:
                    self._child(self.runs_stopped, team, policy.name, status, reason)
        for policy in known.values():
            for tool in policy.tools:
                for outcome in TOOL_OUTCOMES:
                    self._child(self.tool_calls, policy.name, tool, outcome)
            for limit in policy.asks:
                for outcome in LIMIT_OUTCOMES:
                    self._child(self.limit_requests, policy.name, limit, outcome)

    def _exemplar(self) -> dict[str, str] | None:
        return _exemplar(self.trace_id)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: the lookup runs on every call of the hot path."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def model_label(self, model: str) -> str:
        """The model's name if the config routes it by name (or a scripted scenario), else "other"."""
        return model if model in self.known_models else OTHER

    def on_request(self, route: str, code: int) -> None:
        self._child(self.requests, route, str(code)).inc()

    def on_overhead(self, seconds: float) -> None:
        self.overhead.observe(max(0.0, seconds))

    def on_upstream(self, upstream: str, model: str, seconds: float) -> None:
        self._child(self.upstream_duration, upstream, self.model_label(model)).observe(seconds, self._exemplar())

    def on_usage_clamped(self, upstream: str, kinds: tuple[str, ...]) -> None:
        for kind in kinds:
            self.usage_clamped.labels(upstream, kind).inc()

    def on_attempt(self, upstream: str, outcome: str) -> None:
        """One upstream attempt (`outcome` a short code from `gateway.providers.routing.Outcome`)."""
        self._child(self.upstream_attempts, upstream, _code(outcome)).inc(1, self._exemplar())

    def on_tool_call_repairs(self, upstream: str, repairs: Iterable[Repair]) -> None:
        for repair in repairs:
            self.tool_call_repairs.labels(upstream, repair.kind).inc()

    def on_ttft(self, upstream: str, model: str, seconds: float) -> None:
        self._child(self.ttft, upstream, self.model_label(model)).observe(seconds, self._exemplar())

    def on_turn(self, team: str, policy: str, model: str, usage: Usage, cost_usd: float) -> None:
        """One model turn of a run (pass-through or server-side)."""
        key = (team, policy, model)
        children = self._turn_children.get(key)
        if children is None:  # labels are bounded, so is this cache (unknown models share "other")
            label = self.model_label(model)
            children = (self._child(self.turns, team, policy, label),
                        self._child(self.tokens, team, label, "prompt"),
                        self._child(self.tokens, team, label, "completion"),
                        self._child(self.cost, team, label))
            if label == model:
                self._turn_children[key] = children
        turns, prompt, completion, cost = children
        exemplar = self._exemplar()
        turns.inc(1, exemplar)
        prompt.inc(usage.prompt_tokens, exemplar)
        completion.inc(usage.completion_tokens, exemplar)
        cost.inc(cost_usd, exemplar)

    def on_spend(self, team: str, model: str, usage: Usage, cost_usd: float) -> None:
        """Tokens and dollars spent by a call that is not a turn (embeddings)."""
        label = self.model_label(model)
        exemplar = self._exemplar()
        self._child(self.tokens, team, label, "prompt").inc(usage.prompt_tokens, exemplar)
        self._child(self.cost, team, label).inc(cost_usd, exemplar)

    def on_tool(self, policy: str, tool: str, outcome: ToolOutcome, seconds: float | None = None) -> None:
        """One server-side tool call; `seconds` only for calls that ran."""
        exemplar = self._exemplar()
        self._child(self.tool_calls, policy, tool, _code(outcome)).inc(1, exemplar)
        if seconds is not None:
            self._child(self.tool_duration, tool).observe(seconds, exemplar)

    def on_run_stopped(self, team: str, policy: str, status: str, reason: str, turns: int, cost_usd: float) -> None:
        """A run left `running`. `reason` is a short code (max_turns, max_budget, team_budget,
        max_tool_calls, max_duration, completed, cancelled, approval, upstream_error, ...);
        free text is counted as "other"."""
        exemplar = self._exemplar()
        self._child(self.runs_stopped, team, policy, status, _code(reason)).inc(1, exemplar)
        self._child(self.turns_per_run, team, policy).observe(turns, exemplar)
        self._child(self.cost_per_run, team, policy).observe(cost_usd, exemplar)

    def on_limit_lines(self, policy: str, events: Iterable[Mapping[str, Any]]) -> None:
        """`gateway_limit_requests_total` from the trace lines of limit requests: `limit_reached`
        (asked, or exhausted: no grant left), `limit_granted`, `limit_rejected` (rejected, or
        expired); other lines are ignored. Every path that writes those lines counts here."""
        for event in events:
            kind = event.get("type")
            if kind == "limit_reached":
                outcome = "asked" if event.get("asked") else "exhausted"
            elif kind == "limit_granted":
                outcome = "granted"
            elif kind == "limit_rejected":
                outcome = "expired" if event.get("expired") else "rejected"
            else:
                continue
            self._child(self.limit_requests, policy, _code(str(event.get("limit"))), outcome).inc()

    def set_approvals_pending(self, team: str, count: int) -> None:
        self.approvals_pending.labels(team).set(count)

    def run_active(self, delta: int) -> None:
        self.runs_active.inc(delta)

    def set_team_budget(self, team: str, spent: float, remaining: float | None) -> None:
        self.team_spend.labels(team).set(spent)
        if remaining is not None:
            self.team_remaining.labels(team).set(remaining)

    def _scraped(self) -> CollectorRegistry:
        """What a scrape reads: this registry, or every worker's files in multiprocess mode."""
        if self.multiprocess_dir is None:
            return self.registry
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self.multiprocess_dir)  # type: ignore[no-untyped-call]
        merged.register(WorkersCollector(self.multiprocess_dir))
        PlatformCollector(registry=merged)
        return merged

    def on_webhook(self, webhook: str, event: str, outcome: str) -> None:
        """One delivery attempt of a notice: delivered, retried (it failed, and will be tried
        again) or failed (it failed for the last time)."""
        self._child(self.webhook_deliveries, webhook, _code(event), _code(outcome)).inc()

    def on_tool_threads(self, busy: int, waiting: int) -> None:
        """Tool threads that started or ended a call, calls that began or ended waiting for
        one (changes; called from any thread: prometheus_client's values are thread-safe)."""
        if busy:
            self.tool_threads_busy.inc(busy)
        if waiting:
            self.tool_calls_waiting.inc(waiting)

    def on_connection(self, event: str) -> None:
        """A client connection opened, closed, refused or timed out (`listener.ConnectionEvent`)."""
        if event == "opened":
            self.connections.inc()
        elif event == "closed":
            self.connections.dec()
        elif event == "refused":
            self.connections_refused.inc()
        elif event in ("header_timeout", "body_timeout"):
            self.request_timeouts.labels(event.partition("_")[0]).inc()

    def on_work_wait(self, team: str) -> None:
        self._child(self.work_waits, team).inc()

    def on_ready(self, check: str, ok: bool) -> None:
        """A readiness check's state (`gateway.server.http.readiness`)."""
        self._child(self.ready, _code(check)).set(1 if ok else 0)

    def set_spooled(self, records: int) -> None:
        self.spooled.set(records)

    def set_outbox_depth(self, depth: int) -> None:
        self.webhook_outbox.set(depth)

    def on_store(self, op: str, seconds: float) -> None:
        """One store call (`gateway.store.timed`); `op` is a method name of the Store protocol."""
        self._child(self.store_seconds, op).observe(seconds)

    def set_loop_lag(self, seconds: float) -> None:
        self.loop_lag.set(seconds)

    def set_upstream_connections(self, in_use: int, idle: int) -> None:
        self._child(self.upstream_connections, "in_use").set(in_use)
        self._child(self.upstream_connections, "idle").set(idle)

    def render(self) -> bytes:
        """The classic text format (no exemplars)."""
        return bytes(generate_latest(self._scraped()))

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """(body, Content-Type) for a scrape sending `accept`: OpenMetrics, with the run-id
        exemplars, when it asks for OpenMetrics 1.0 (as Prometheus does); the classic text
        format otherwise."""
        encoder, content_type = choose_encoder(accept or "")
        return bytes(encoder(self._scraped())), content_type
