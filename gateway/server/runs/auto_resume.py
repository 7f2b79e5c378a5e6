"""Runs that continue after a decision: policy option `approval: {on_decision: resume}`.

With it, the gateway resumes a server-side run itself as soon as the call (or the limit
request, `on_exceed: ask`) it waits for is decided (by a person, or by expiry; a rejected
limit request ends the run instead): the replica that recorded the decision starts a
drive in the background (`BackgroundDrives.spawn`), and the run's lease decides who
drives (another replica already holding it means this one stands down). Should the
deciding replica die before it drives, recovery on any replica finds the run decided and
undriven (still `interrupted`: a decision never makes a run `running`, only a drive
does), and resumes it (`decided_undriven`), whatever the policy's `recovery` says: a
person said yes (or no), so going on is what they asked for.

Clients waiting on such a run see it go on: `GET /v1/runs/{id}/events?follow=1` keeps
following while it waits for the decision (`continues_by_itself`), and a streamed chat
call that paused on the approval stays open and answers when the run stops
(`follow_until_stopped`). The default (`on_decision: wait`): the decided run stays
`interrupted` (`waiting_for: resume`) until `POST /v1/runs/{id}/resume` or its client's
next call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from gateway.harness.state import RunState, pending
from gateway.harness.trace import StartSetup
from gateway.policy.decl import Policy
from gateway.providers.errors import UpstreamError
from gateway.server.http.errors import ApiError, Conflict
from gateway.server.runs.cancels import RunBusy
from gateway.server.runs.continuations import resume_with
from gateway.server.runs.driver import Prepare, RunDriver
from gateway.store.base import Event, Store
from gateway.store.errors import LeaseLost, StoreError

log = logging.getLogger(__name__)

RESUMED_BY: Final = "gateway-on-decision"
"""`by` of the `run_resumed` trace line of a run resumed after a decision."""
BUSY_RETRY_S: Final = 0.1
FOLLOW_POLL_S: Final = 0.05
STATUS_CHECK_S: Final = 1.0
KEEPALIVE_S: Final = 10.0


def resumes_on_decision(policy: Policy | None) -> bool:
    """Whether runs of `policy` go on by themselves once their pending call is decided."""
    return policy is not None and policy.server_side and policy.approval.on_decision == "resume"


def waits_for_decision(run: RunState) -> bool:
    """The run is stopped on a call (or a limit request) nobody has decided yet."""
    return run.waits_for_decision


def continues_by_itself(run: RunState, policy: Policy | None) -> bool:
    """Still going, as a follower sees it: running, or stopped on a call (or a limit request)
    whose decision (still to come, or just recorded) resumes it."""
    return run.status == "running" or ((run.waits_for_decision or run.decided) and resumes_on_decision(policy))


def decided_undriven(run: RunState, policy: Policy | None) -> bool:
    """A run of an on-decision policy whose call was decided and that no drive has resumed
    yet (the deciding replica died first). A run saved `running` with a decided call still
    pending is one too: that is how gateways before 2026-12 saved a decision."""
    if not resumes_on_decision(policy):
        return False
    return run.decided or (run.status == "running" and any(str(c.get("id")) in run.decisions for c in pending(run)))


def resume_decided(by: str) -> Prepare:
    """The gateway's own resume of a decided run (`after_decision`, and recovery's
    `decided_undriven`): once, whichever replica takes the lease first. The run is read
    under the lease; one no longer waiting for this resume (driven since, cancelled,
    stopped again) is refused with 409 and left as it is."""
    resume = resume_with(None, None, by)

    def prepare(state: RunState, policy: Policy) -> StartSetup | None:
        if not decided_undriven(state, policy):
            raise Conflict(f"run {state.public_id} does not wait to go on after a decision (status {state.status})",
                           code="run_not_resumable")
        return resume(state, policy)

    return prepare


@dataclass(frozen=True)
class Spawned:
    """A background drive started for a run."""

    run_id: str
    task: asyncio.Task[None]


class BackgroundDrives:
    """Drives of runs nobody waits on an HTTP answer for (resumed after a decision, or by
    recovery); each stops at shutdown like any drive (saved as interrupted, resumable)."""

    def __init__(self, driver: RunDriver) -> None:
        self.driver = driver
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, run_id: str, prepare: Prepare, *, busy_wait_s: float = 0.0) -> Spawned:
        """Drive `run_id` in the background. While the run is busy (its lease held
        elsewhere, e.g. by a sweep that is about to let go) it is retried for `busy_wait_s`;
        after that, whoever holds it is driving it, or recovery will."""
        task = asyncio.get_running_loop().create_task(self._drive(run_id, prepare, busy_wait_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return Spawned(run_id, task)

    async def _drive(self, run_id: str, prepare: Prepare, busy_wait_s: float) -> None:
        deadline = time.monotonic() + busy_wait_s
        while True:
            try:
                await self.driver.drive(run_id, prepare=prepare, start="run_resumed")
                return
            except RunBusy:
                if time.monotonic() >= deadline:
                    return
            except LeaseLost:  # another replica took the run over; the driver said so
                return
            except (ApiError, UpstreamError, StoreError) as exc:
                log.warning("could not resume run %s in the background: %s", run_id, exc)
                return
            await asyncio.sleep(BUSY_RETRY_S)

    async def close(self) -> None:
        """Stop the drives still going (each is saved as interrupted, resumable)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)


BACKGROUND: Final = web.AppKey("background_drives", BackgroundDrives)


def after_decision(drives: BackgroundDrives, run: RunState, policy: Policy | None, prepare: Prepare) -> bool:
    """Resume `run` in the background if its policy says so and nothing is left to decide.

    `run` is the run as saved with the decision; `prepare` is the resume to apply (its
    `by` names the decision). True when a drive was started."""
    if not resumes_on_decision(policy) or not run.decided:
        return False
    drives.spawn(run.run_id, prepare, busy_wait_s=drives.driver.lease_ttl_s)
    return True


async def follow_until_stopped(store: Store, policy_of: Callable[[RunState], Policy | None], run: RunState,
                               after: int, emit: Callable[[int, Event], Awaitable[None]],
                               keepalive: Callable[[], Awaitable[None]],
                               pause: Callable[[float], Awaitable[bool]] | None = None) -> RunState:
    """Hand every trace line of `run` after sequence `after` to `emit` until it stops
    for good (not running, not waiting for a decision that resumes it); the run as saved
    then. `keepalive` is awaited when nothing happened for `KEEPALIVE_S`; `pause` waits
    between two polls and says whether to go on (False: give up, returning the run as
    last read)."""
    last_check, last_sent = 0.0, time.monotonic()
    current = run
    while True:
        batch = await store.events(run.run_id, after)
        for seq, event in batch:
            await emit(seq, event)
            after = seq
        if batch:
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent > KEEPALIVE_S:
            await keepalive()
            last_sent = time.monotonic()
        stopped = any(e.get("type") == "run_stopped" and e.get("runId") == run.run_id for _, e in batch)
        if stopped or time.monotonic() - last_check > STATUS_CHECK_S:
            last_check = time.monotonic()
            current = await store.load_run(run.run_id) or current
            if not continues_by_itself(current, policy_of(current)):
                # the trace is written before the run is saved: nothing of this stop is missing
                for seq, event in await store.events(run.run_id, after):
                    await emit(seq, event)
                return current
        # polling the shared store: works across replicas
        if pause is None:
            await asyncio.sleep(FOLLOW_POLL_S)
        elif not await pause(FOLLOW_POLL_S):
            return current
