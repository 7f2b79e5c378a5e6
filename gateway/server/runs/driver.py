"""Driving a server-side run: one replica at a time, every change saved, Stop reachable.

`RunDriver.drive(run_id, ...)` takes the run's lease (an expired lease of a dead replica
can be taken over), reloads the run, compiles the tools of the policy *version* the run
started under, and runs the harness loop with:

- `checkpoint` = the buffered trace and the state in one store step (`TraceWriter.commit`,
  optimistic revision): every state change is durable before the next model call or tool
  run, and a line announcing it (`approval_required`, `run_stopped`) is never read before it;
- `on_event` = the run's `TraceWriter` (store, trace file, metrics, the caller's listeners);
- a `CancelScope` registered in `ActiveRuns` (the cancel route and a client that went
  away press it), and a watcher for cancel requests written by other replicas.

Errors the loop lets through (upstream failure, the team budget refusing a call) end the
run with a status and a reason, saved and traced like any other exit.

The lease lasts `server.lease_ttl_s` and is renewed every third of it while the run is
driven, so a replica that dies holds its runs at most that long; sandboxes live under
`runs_dir`, which replicas share. Every write of the drive (trace lines, the notices they
cause, saves) is fenced by the lease's epoch in its own store step (`Lease`): once another
replica (or this one's recovery sweep) took the run over after the lease lapsed (a frozen
or stalled replica, a store unreachable for a whole TTL), nothing more of this drive is
written (`LeaseLost`), and the run's metrics, which count stored lines only, say nothing
of it either. A replica that cannot
renew stops driving at its next renewal; a model call it has in flight is still booked on
the team's ledger when its answer comes (`governed_model`).

The lease keeper and the cancel watcher never hold a run's answer back: they stop on an
event (a cancellation can be lost inside redis-py while a command is in flight), every
store call they make has a deadline, and the driver waits for them at most
`BACKGROUND_GRACE_S` once the run stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from gateway.config.settings import DEFAULT_LEASE_TTL_S, DEFAULT_STORE_TIMEOUT_S
from gateway.harness.execute import CancelScope
from gateway.harness.loop import Outcome, run
from gateway.harness.model import Model
from gateway.harness.state import Interruption, RunState, public_run_id
from gateway.harness.options import RunOptions
from gateway.harness.trace import RunStoppedFields, StartSetup, TraceLink, Tracer
from gateway.harness.usage import Price, Usage
from gateway.policy.decl import Policy
from gateway.policy.executors import CompileError, ToolEnv, compile_options
from gateway.policy.registry import PolicyRegistry
from gateway.policy.sandbox import prepare_sandbox, sandbox_config
from gateway.policy.threads import ToolThreads
from gateway.providers.errors import UpstreamError
from gateway.server.http.errors import (
    ApiError,
    Conflict,
    LimitExceeded,
    NotFound,
    RateLimited,
    limit_stop,
)
from gateway.server.metrics import Metrics
from gateway.server.runs.cancels import ActiveRuns, RunBusy, watch_remote_cancel
from gateway.server.runs.pending_approvals import PendingApprovals
from gateway.server.runs.run_spans import RunSpans, agent_span, trace_link
from gateway.server.runs.tracelog import Listener, TraceWriter
from gateway.store.audit import AuditEntry
from gateway.store.base import Event, Lease, Store
from gateway.store.errors import LeaseLost, StoreError

if TYPE_CHECKING:
    from gateway.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

StartKind = Literal["run_started", "run_resumed"]
INTERNAL_ERROR = "the gateway failed while driving the run; see its log"
Prepare = Callable[[RunState, Policy], "StartSetup | None"]


@dataclass(frozen=True)
class Audited:
    """A `Prepare` that is an administrative act (a resume with raised limits): its audit
    records are written with the first save of the drive it starts (gateway.server.audit)."""

    prepare: Prepare
    audit: tuple[AuditEntry, ...]

    def __call__(self, state: RunState, policy: Policy) -> StartSetup | None:
        return self.prepare(state, policy)
"""Changes a call makes to the run before it is driven (append tool results, raise limits).

Runs under the lease on the freshly loaded run; returns the fields of the start event
(None: the call has nothing to drive, answer with the run as it is). Raises ApiError
to refuse, before anything is saved.
"""

BACKGROUND_GRACE_S = 0.5
"""How long a run's answer may wait for its background tasks (cancel watcher, lease keeper) to stop."""

ModelFactory = Callable[[RunState], Model]
"""The model a run's turns (and its sub-runs') go to: the team's governed upstream."""


@dataclass(frozen=True)
class Drive:
    """What one drive did: how the loop returned, and the tokens this drive spent."""

    outcome: Outcome
    usage: Usage
    driven: bool = True

    @property
    def state(self) -> RunState:
        return self.outcome.state


class PolicyGone(Conflict):
    """The policy version the run started under is not loaded any more."""


@dataclass(frozen=True)
class FromClient:
    """What a chat call brings to a server-side run: its own tools and its sampling settings."""

    tools: Sequence[dict[str, Any]] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None


class RunDriver:
    """Drives server-side runs for one gateway process."""

    def __init__(self, store: Store, policies: PolicyRegistry, *, model_for: ModelFactory,
                 price_for: Callable[[str], Price], runs_dir: Path, session: aiohttp.ClientSession | None = None,
                 trace_file: Path | None = None, metrics: Metrics | None = None, owner: str | None = None,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S, cancel_poll_s: float = 0.1,
                 store_deadline_s: float = DEFAULT_STORE_TIMEOUT_S, threads: ToolThreads | None = None,
                 tracing: Tracing | None = None) -> None:
        self.store = store
        self.policies = policies
        self.model_for = model_for
        self.price_for = price_for
        self.runs_dir = runs_dir
        self.session = session
        self.trace_file = trace_file
        self.metrics = metrics
        self.owner = owner or f"gw-{uuid.uuid4().hex[:12]}"
        self.lease_ttl_s = lease_ttl_s
        self.cancel_poll_s = cancel_poll_s
        self.store_deadline_s = store_deadline_s
        self.threads = threads
        self.active = ActiveRuns()
        self.approvals = PendingApprovals(store, metrics)
        self.tracing = tracing
        """Each drive an `invoke_agent` span, each tool call an `execute_tool` one (`run_spans`)."""

    def policy_of(self, state: RunState) -> Policy:
        """The run's policy (`PolicyRegistry.for_run`); PolicyGone when none is loaded."""
        policy = self.policies.for_run(state.policy, state.policy_version)
        if policy is None:
            raise PolicyGone(f"run {state.public_id} is governed by policy '{state.policy}', which this gateway "
                             f"no longer has (loaded: {', '.join(self.policies.names()) or 'none'})",
                             code="policy_not_found")
        return policy

    def sandbox_of(self, state: RunState, policy: Policy) -> Path | None:
        """The run's folder: made on its first drive, found again on every later one
        (by any process sharing `runs_dir`), so its files survive restarts."""
        config = sandbox_config(policy, self.policies)
        if config is None:
            return None
        if config.path is not None:
            return prepare_sandbox(config, self.runs_dir, base_dir=policy.path.parent)
        home = self.runs_dir / state.run_id
        existing = sorted(p for p in home.iterdir() if p.is_dir()) if home.is_dir() else []
        return existing[0] if existing else prepare_sandbox(config, home)

    async def drive(self, run_id: str, *, prepare: Prepare | None = None, client: FromClient = FromClient(),
                    listeners: Sequence[Listener] = (), start: StartKind = "run_resumed") -> Drive:
        """Drive the run until it stops or hands calls to the client.

        Raises RunBusy if it is driven elsewhere, NotFound if it does not exist, and what
        `prepare` raises; anything else the loop raises ends the run (saved, traced).
        """
        writer = TraceWriter(self.store, run_id, trace_file=self.trace_file, listeners=listeners)
        with self.active.claim(run_id, writer) as scope:
            lease = await self.store.acquire_lease(run_id, self.owner, self.lease_ttl_s)
            if lease is None:
                raise RunBusy(run_id, "by another gateway replica")
            writer.lease = lease
            if self.metrics is not None:
                self.metrics.run_active(1)
            try:
                drive = await self._drive(run_id, lease, scope, writer, prepare, client, start)
                if drive.state.waits_for_decision and drive.driven:
                    self.approvals_changed()
                return drive
            except LeaseLost:
                log.warning("run %s: this process lost its lease (it stalled past server.lease_ttl_s, or another "
                            "replica took the run over); nothing more of this drive was written", run_id)
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.run_active(-1)
                try:
                    await self.store.release_lease(run_id, self.owner)
                except StoreError as exc:  # it expires by itself within lease_ttl_s; the answer stands
                    log.warning("run %s: could not release its lease: %s", run_id, exc)

    async def _drive(self, run_id: str, lease: Lease, scope: CancelScope, writer: TraceWriter,
                     prepare: Prepare | None, client: FromClient, start: StartKind) -> Drive:
        # Cancel requests of other replicas are read from here on: any written before we held
        # the lease found the run undriven and stopped it themselves.
        seen = await self.store.events(run_id)
        state = await self.store.load_run(run_id)
        if state is None:
            raise NotFound(f"run {public_run_id(run_id)} not found", code="run_not_found")
        policy = self.policy_of(state)
        fields = prepare(state, policy) if prepare is not None else None
        if isinstance(prepare, Audited):
            writer.audit(prepare.audit)
        if prepare is not None and fields is None:  # nothing to drive (it waits for a person): keep what the call added
            await writer.commit(state)
            return Drive(Outcome(state, "stopped", last_answer(state)), Usage(), driven=False)
        usage_before = state.usage
        model = self.model_for(state)
        if self.metrics is not None:  # counts what the run's trace stores, never a lost drive's lines
            writer.written.append(_MetricsListener(self.metrics, state, policy))

        checkpoint = writer.commit
        tracing = self.tracing
        try:
            env = ToolEnv(session=self.session, model=model, model_name=state.model, price_for=self.price_for,
                          registry=self.policies, sandbox_root=self.sandbox_of(state, policy), on_event=writer,
                          threads=self.threads, propagate=tracing.inject if tracing is not None else None)
            options = compile_options(policy, env, client_tools=list(client.tools), sampling=dict(client.sampling),
                                      max_tokens=client.max_tokens, checkpoint=checkpoint)
        except (CompileError, OSError) as exc:
            raise Conflict(f"run {public_run_id(run_id)} cannot be driven: {exc}", code="run_not_drivable") from None
        if tracing is None:
            return await self._loop(run_id, lease, state, model, options, scope, writer, seen, start, fields,
                                    usage_before)
        agent = agent_span(tracing, state, seen, start)
        spans = RunSpans(tracing, agent)
        writer.listeners.append(spans)
        try:
            drive = await self._loop(run_id, lease, state, model, options, scope, writer, seen, start, fields,
                                     usage_before, trace_link(agent))
            agent.stopped(status=state.status, reason=state.reason or "", turns=state.turns,
                          cost_usd=round(state.cost_usd, 9), tool_calls=state.tool_calls, usage=drive.usage)
            return drive
        finally:
            spans.close()
            agent.end()

    async def _loop(self, run_id: str, lease: Lease, state: RunState, model: Model, options: RunOptions,
                    scope: CancelScope, writer: TraceWriter, seen: Sequence[tuple[int, Event]], start: StartKind,
                    fields: StartSetup | None, usage_before: Usage, link: TraceLink | None = None) -> Drive:
        """The drive itself: its start line, the lease keeper, the cancel watcher, the loop."""
        checkpoint = writer.commit
        Tracer(run_id, writer).start(start, fields, {"turns": state.turns, "costUsd": round(state.cost_usd, 9)},
                                     link)
        await checkpoint(state)
        writer.start()
        stop = asyncio.Event()
        keep = _Keep()
        keeper = asyncio.ensure_future(self._keep_lease(lease, scope, stop, keep))
        watcher = asyncio.ensure_future(watch_remote_cancel(
            self.store, run_id, scope, seen[-1][0] if seen else 0, self.cancel_poll_s, stop, self.store_deadline_s))
        try:
            try:
                outcome = await run(state, model, options, scope)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except LeaseLost as exc:
                if keep.unrenewed:  # it lapsed while the store did not answer: an outage (503), not a takeover
                    raise StoreError(f"run {run_id}: its lease lapsed while the store was unreachable") from exc
                raise
            except Exception as exc:  # the loop let it through: end the run with a reason
                if isinstance(exc, StoreError):  # StaleRun included: the saved run is not ours to overwrite
                    raise
                outcome = await self._end(state, exc, writer, checkpoint)
        finally:
            await self._stop_background(stop, keeper, watcher)
            await writer.close()
        return Drive(outcome, _minus(state.usage, usage_before))

    async def _stop_background(self, stop: asyncio.Event, *tasks: asyncio.Future[None]) -> None:
        """End the run's background tasks without ever letting them hold the answer back.

        `stop` ends their loops at the next check even if a cancellation is lost inside the
        store client; they get a short grace (so a lease renewal in flight lands before the
        lease is released), then are left to finish on their own, their errors logged.
        """
        stop.set()
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=BACKGROUND_GRACE_S)
        for task in tasks:
            if task in pending:
                log.warning("a background task of a run did not stop within %.1fs; not waiting for it",
                            BACKGROUND_GRACE_S)
                task.add_done_callback(_log_failure)
            else:
                _log_failure(task)

    async def _keep_lease(self, lease: Lease, scope: CancelScope, stop: asyncio.Event, keep: _Keep) -> None:
        """Renew the lease while driving; stop driving if another replica took it (held, or
        taken and released meanwhile: a renewal then gets a new epoch, and this drive's
        writes are fenced by the old one), or if the store could not renew it for a whole
        TTL. `keep` says whether a renewal failed since the lease was last renewed."""
        run_id = lease.run_id
        held_until = time.monotonic() + self.lease_ttl_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lease_ttl_s / 3):
                    await stop.wait()
            if stop.is_set():
                return
            asked = time.monotonic()  # the store's clock starts the new TTL no earlier than this
            try:
                async with asyncio.timeout(self.store_deadline_s):
                    renewed = await self.store.acquire_lease(run_id, self.owner, self.lease_ttl_s)
            except (StoreError, TimeoutError) as exc:
                keep.unrenewed = True
                if time.monotonic() < held_until:
                    log.warning("run %s: lease renewal failed, retrying: %s", run_id, exc)
                    continue
                scope.cancel(f"the gateway lost the run's lease (store unreachable: {exc})")
                return
            if renewed is None or renewed.epoch != lease.epoch:
                if renewed is not None:  # another took it and let go meanwhile: not the lease this drive writes under
                    with contextlib.suppress(StoreError, TimeoutError):
                        async with asyncio.timeout(self.store_deadline_s):
                            await self.store.release_lease(run_id, self.owner)
                scope.cancel("this gateway replica lost the run's lease (it stalled past server.lease_ttl_s, "
                             "or another replica took the run over)")
                return
            held_until = asked + self.lease_ttl_s
            keep.unrenewed = False

    async def _end(self, state: RunState, exc: Exception, writer: TraceWriter,
                   checkpoint: Callable[[RunState], Any]) -> Outcome:
        """Save a run the loop could not finish: a refused call or a failed upstream."""
        if isinstance(exc, LimitExceeded):
            state.status, state.reason, state.interruption = limit_stop(exc.kind)
            if exc.kind in ("team_budget_exceeded", "key_budget_exceeded", "user_budget_exceeded"):
                state.error = exc.message
        elif isinstance(exc, RateLimited):  # waited defaults.rate_limit_wait_s already: resume it later
            state.status, state.reason = "interrupted", "rate_limited"
            state.interruption = Interruption("rate_limited", reason=exc.message)
            state.error = exc.message
        elif isinstance(exc, (ApiError, UpstreamError)):
            state.status, state.reason, state.error = "failed", "upstream_error", exc.message
            for fields in exc.attempts if isinstance(exc, UpstreamError) else ():
                Tracer(state.run_id, writer)("upstream_attempt", **fields)
        else:
            log.exception("run %s failed inside the gateway", state.run_id)
            # the log has the exception; the run (and so every client answer) has a sentence
            state.status, state.reason, state.error = "failed", "internal_error", INTERNAL_ERROR
        stopped: RunStoppedFields = {"status": state.status, "reason": state.reason, "turns": state.turns,
                                     "costUsd": round(state.cost_usd, 9)}
        if state.error:
            stopped["detail"] = state.error
        Tracer(state.run_id, writer)("run_stopped", **stopped)
        state.updated_at = time.time()
        await checkpoint(state)
        return Outcome(state, "stopped")

    def approvals_changed(self) -> None:
        """A call (or a limit request) started or stopped waiting for a person here: `gateway_approvals_pending`
        is recounted from the store at the next scrape (`PendingApprovals`)."""
        self.approvals.changed()


@dataclass
class _Keep:
    """What a drive's lease keeper tells the drive: whether its last renewal failed (the
    store did not answer), so that a lease found lost then is the outage's doing."""

    unrenewed: bool = False


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a background task of a run failed", exc_info=task.exception())


def _minus(a: Usage, b: Usage) -> Usage:
    return Usage(a.prompt_tokens - b.prompt_tokens, a.completion_tokens - b.completion_tokens)


def last_answer(state: RunState) -> str | None:
    """The run's final answer: its last assistant message, once it completed."""
    if state.status != "completed":
        return None
    last = next((m for m in reversed(state.messages) if m.get("role") == "assistant"), None)
    return str(last.get("content") or "") if last else None


class _MetricsListener:
    """Trace events of one run -> Prometheus (labels: team, policy, model; never the run id)."""

    def __init__(self, metrics: Metrics, state: RunState, policy: Policy) -> None:
        self.metrics = metrics
        self.state = state
        self.policy = policy.name

    def __call__(self, event: Event) -> None:
        m, s = self.metrics, self.state
        if event["type"] == "tool_result":
            m.on_tool(self.policy, str(event.get("toolName")), "ok" if event.get("ok") else "error",
                      float(event.get("ms") or 0) / 1000)
        elif event["type"] == "tool_deduped":
            m.on_tool(self.policy, str(event.get("toolName")), "deduped")
        elif event["type"] == "tool_denied":
            m.on_tool(self.policy, str(event.get("toolName")), "denied")
        elif event["type"] in ("limit_reached", "limit_granted", "limit_rejected") and event["runId"] == s.run_id:
            m.on_limit_lines(self.policy, (event,))
        elif event["type"] == "run_stopped" and event["runId"] == s.run_id:
            m.on_run_stopped(s.team, self.policy, str(event.get("status")), str(event.get("reason")),
                             int(event.get("turns") or 0), float(event.get("costUsd") or 0.0))
