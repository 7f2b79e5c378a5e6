"""Recovery: runs cut by a crash and approvals nobody decided, settled without anyone acting.

A `Sweeper` runs once when the gateway starts and then every `period_s` (half of
`server.lease_ttl_s`) on every replica:

- a server-side run still `running` whose lease is free (its process died: the lease
  expired, or it is this process's own from before a restart) and that was not saved for
  a whole lease TTL is either resumed (policy `recovery: resume`) or stopped as
  `interrupted` with reason `crashed` (the default), so its owner sees it and may resume
  it. A run that waits for its client's tool results is between calls, like any
  pass-through run: left alone. This rests on one rule: only a drive makes a server-side
  run `running`, under its lease (a decision, a grant, a cancel leave it stopped, saying
  what it waits for), so `running` with a free lease means its driver died.
- a run of an `approval: {on_decision: resume}` policy whose decided call (or granted
  limit request) was never driven (the deciding replica died) is resumed, once.
- a run waiting for a decision past its policy's `approval.expires_after_s` gets the
  expiry's rejection (as when someone decides late), traced `approval_expired` (the
  approvals gauge is recounted at the next scrape); under `on_decision: resume` the run
  then goes on (the model reads the rejection). A limit request (`on_exceed: ask`) that
  expires ends the run as the limit does (`limit_rejected`, `by: "approval-expiry"`).

Each change is made while holding the run's lease (and its `ActiveRuns` claim), and
saved with the run's revision: two replicas sweeping at once never change a run twice.
A sweep reads at most `scan` runs of each status, newest first, and only runs of the policies
it could act on (server-side ones; ones whose approvals expire or resume their runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gateway.harness.approvals import EXPIRY, ApprovalError, decide
from gateway.harness.state import Interruption, RunState, pending
from gateway.harness.trace import Tracer
from gateway.policy.approval import expired, expiry_decision
from gateway.policy.decl import Policy
from gateway.server.runs import limit_requests
from gateway.server.runs.auto_resume import (
    RESUMED_BY,
    BackgroundDrives,
    after_decision,
    decided_undriven,
    resume_decided,
    resumes_on_decision,
)
from gateway.server.runs.cancels import RunBusy
from gateway.server.runs.continuations import resume_with
from gateway.server.runs.driver import PolicyGone, Prepare, RunDriver
from gateway.server.runs.tracelog import TraceWriter, asked_at
from gateway.store.base import Lease
from gateway.store.errors import LeaseLost, StaleRun, StoreError

log = logging.getLogger(__name__)

CRASHED: Final = "crashed"
"""The reason of a run stopped by recovery: the process driving it died."""
STARTUP_SCAN: Final = 10_000
PERIODIC_SCAN: Final = 500
RECOVERED_BY: Final = "gateway-recovery"


@dataclass
class SweepReport:
    """What one sweep did, by run id."""

    interrupted: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)


class Sweeper:
    """Finds crashed runs and expired approvals in the store and settles them."""

    def __init__(self, driver: RunDriver, *, trace_file: Path | None, period_s: float) -> None:
        self.driver = driver
        self.store = driver.store
        self.trace_file = trace_file
        self.period_s = period_s
        self.drives = BackgroundDrives(driver)

    async def sweep(self, scan: int = PERIODIC_SCAN) -> SweepReport:
        """One pass over running and interrupted runs. Raises StoreError if the store fails."""
        report = SweepReport()
        # Only the runs a sweep may change are read: most `running` runs are pass-through
        # runs between calls, and parsing their transcripts would cost the event loop dearly.
        policies = self.driver.policies
        driven = policies.names_where(lambda p: p.server_side)
        for run in await self.store.list_runs(status="running", limit=scan, policies=driven):
            await self._recover(run, report)
        waiting = policies.names_where(lambda p: p.approval.expires_after_s is not None or resumes_on_decision(p))
        for run in await self.store.list_runs(status="interrupted", limit=scan, policies=waiting):
            if decided_undriven(run, self._policy(run)):
                if time.time() - run.updated_at >= self.driver.lease_ttl_s:  # else its decider is starting it
                    await self._take_over(run, report, resume_decided(RECOVERED_BY))
                continue
            await self._expire(run, report)
        return report

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Sweep every `period_s` until `stop` is set; a failing store is retried next period."""
        failing = False
        while not stop.is_set():
            try:
                report = await self.sweep()
                failing = False
                if report.interrupted or report.resumed or report.expired:
                    log.warning("recovery: interrupted %s, resumed %s, expired approvals of %s",
                                report.interrupted or "none", report.resumed or "none", report.expired or "none")
            except (StoreError, TimeoutError) as exc:
                if not failing:
                    log.warning("recovery sweep failed, retrying every %.1fs: %s", self.period_s, exc)
                failing = True
            except Exception:  # a bug must not end recovery for the life of the process
                log.exception("recovery sweep failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period_s):
                    await stop.wait()

    async def close(self) -> None:
        """Stop the resumes this sweeper started (they are saved as interrupted, resumable)."""
        await self.drives.close()

    def _policy(self, run: RunState) -> Policy | None:
        try:
            return self.driver.policy_of(run)
        except PolicyGone:
            return None

    def _orphan_candidate(self, run: RunState, policy: Policy | None) -> bool:
        if policy is None or not policy.server_side or run.run_id in self.driver.active:
            return False
        if time.time() - run.updated_at < self.driver.lease_ttl_s:
            return False  # just created or saved: its driver may be about to take the lease
        server = {t.name for t in policy.tools}
        owes_client = any((c.get("function") or {}).get("name") not in server for c in pending(run))
        return not owes_client

    async def _recover(self, run: RunState, report: SweepReport) -> None:
        policy = self._policy(run)
        if not self._orphan_candidate(run, policy):
            return
        assert policy is not None
        if policy.recovery == "resume" or decided_undriven(run, policy):
            await self._take_over(run, report)
            return
        driver = self.driver
        try:
            with driver.active.claim(run.run_id, lambda event: None):
                lease = await self.store.acquire_lease(run.run_id, driver.owner, driver.lease_ttl_s)
                if lease is None:
                    return  # driven by a live replica: nothing to do, nothing to say
                try:
                    fresh = await self.store.load_run(run.run_id)
                    if fresh is None or fresh.revision != run.revision or fresh.status != "running":
                        return
                    await self._interrupt(fresh, lease)
                    report.interrupted.append(run.run_id)
                finally:
                    await self.store.release_lease(run.run_id, driver.owner)
        except (RunBusy, StaleRun, LeaseLost):
            return

    async def _interrupt(self, run: RunState, lease: Lease) -> None:
        detail = ("the gateway process driving this run stopped (crashed or was killed) mid-run; "
                  "resume it to go on from its last saved step")
        writer = TraceWriter(self.store, run.run_id, trace_file=self.trace_file, lease=lease)
        Tracer(run.run_id, writer)("run_stopped", status="interrupted", reason=CRASHED, turns=run.turns,
                                   costUsd=round(run.cost_usd, 9), detail=detail)
        run.status, run.reason, run.interruption = "interrupted", CRASHED, Interruption("crashed", reason=detail)
        await writer.commit(run)

    async def _take_over(self, run: RunState, report: SweepReport, prepare: Prepare | None = None) -> None:
        """Resume `run` here once this process holds its lease: a run another replica drives
        (or is starting) is left alone and never reported, so the log's `resumed [...]` names
        only the runs this replica took over. The drive takes the lease on (this process's,
        still live: the same epoch)."""
        driver = self.driver
        try:
            with driver.active.claim(run.run_id, lambda event: None):
                if await self.store.acquire_lease(run.run_id, driver.owner, driver.lease_ttl_s) is None:
                    return
                self.drives.spawn(run.run_id, prepare or resume_with(None, None, RECOVERED_BY))
                report.resumed.append(run.run_id)
        except RunBusy:
            return

    async def _expire(self, run: RunState, report: SweepReport) -> None:
        waiting = run.waiting_request
        if waiting is None or waiting.call_id is None:
            return
        policy = self._policy(run)
        if policy is None or policy.approval.expires_after_s is None:
            return
        asked = await asked_at(self.store, run, waiting.call_id)  # never None: the run waits on that call
        if not expired(run.updated_at if asked is None else asked, time.time(), policy.approval):
            return
        driver = self.driver
        try:
            with driver.active.claim(run.run_id, lambda event: None):
                lease = await self.store.acquire_lease(run.run_id, driver.owner, driver.lease_ttl_s)
                if lease is None:
                    return
                try:
                    fresh = await self.store.load_run(run.run_id)
                    if fresh is None or fresh.revision != run.revision:
                        return
                    if waiting.type == "limit":  # the run ends as the limit does
                        await limit_requests.expire(self.store, fresh, policy, self.trace_file, driver.metrics,
                                                    lease=lease)
                    else:
                        await self._expire_call(fresh, waiting, policy, lease)
                    report.expired.append(run.run_id)
                finally:
                    await self.store.release_lease(run.run_id, driver.owner)
        except (RunBusy, StaleRun, LeaseLost, ApprovalError):
            return
        driver.approvals_changed()

    async def _expire_call(self, run: RunState, waiting: Interruption, policy: Policy, lease: Lease) -> None:
        """The expiry's rejection of the call `run` waits for (written under the sweep's
        `lease`); under `on_decision: resume` the run then goes on (its model reads the
        rejection)."""
        assert waiting.call_id is not None
        decision = expiry_decision(policy.approval)
        decide(run, waiting.call_id, decision)
        writer = TraceWriter(self.store, run.run_id, trace_file=self.trace_file, lease=lease)
        Tracer(run.run_id, writer)(
            "approval_expired", callId=waiting.call_id, toolName=waiting.tool_name, args=waiting.args,
            decision=decision.decision, reason=decision.reason, by=EXPIRY, expired=True)
        await writer.flush()
        await self.store.save_run(run, lease=lease)
        after_decision(self.drives, run, policy, resume_decided(RESUMED_BY))

