"""Stopping a run from outside the request that drives it.

Locally, every run this process drives has a `CancelScope` in `ActiveRuns`: the cancel
route presses it and the loop, the model call and the running tool all stop within
milliseconds. A run driven by another replica cannot be reached that way, so the
request is written into the run's trace (`cancel_requested`), which every replica
shares; the driving replica polls its own run's trace and presses its own scope.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from gateway.harness.execute import CancelScope
from gateway.harness.state import public_run_id
from gateway.harness.trace import CancelRequestedEvent, EventSink, Tracer
from gateway.store.base import Store
from gateway.store.errors import StoreError
from gateway.store.signals import changed, poll_period

log = logging.getLogger(__name__)

CANCEL_REQUESTED: Final = "cancel_requested"
"""Trace event kind of a Stop pressed on a run (by the API or by a client that went away)."""
CLIENT_DISCONNECTED = "client disconnected"
"""The interruption reason of a run whose client went away mid-run."""


class RunBusy(Exception):
    """The run is already being driven (here or by another replica)."""

    def __init__(self, run_id: str, where: str) -> None:
        super().__init__(f"run {public_run_id(run_id)} is already being driven {where}; wait for it to stop or cancel it")
        self.run_id = run_id


def cancel_event(run_id: str, reason: str, by: str) -> CancelRequestedEvent:
    """The trace line recording that someone pressed Stop (its `ts` is when)."""
    return Tracer(run_id)(CANCEL_REQUESTED, reason=reason, by=by)


@dataclass
class _Driving:
    scope: CancelScope
    stopped: asyncio.Event
    trace: EventSink


class ActiveRuns:
    """The runs this process is driving right now, each with its Stop button and trace."""

    def __init__(self) -> None:
        self._runs: dict[str, _Driving] = {}

    @contextmanager
    def claim(self, run_id: str, trace: EventSink) -> Iterator[CancelScope]:
        """Hold the run's scope while driving it; a second claim of the same run is `RunBusy`."""
        if run_id in self._runs:
            raise RunBusy(run_id, "by this gateway")
        driving = _Driving(CancelScope(), asyncio.Event(), trace)
        self._runs[run_id] = driving
        try:
            yield driving.scope
        finally:
            del self._runs[run_id]
            driving.stopped.set()

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._runs))

    def cancel(self, run_id: str, reason: str, by: str) -> bool:
        """Press Stop on a run driven here (traced as `cancel_requested`); False if not here."""
        driving = self._runs.get(run_id)
        if driving is None:
            return False
        if not driving.scope.cancelled:
            driving.trace(cancel_event(run_id, reason, by))
            driving.scope.cancel(reason)
        return True

    async def wait_stopped(self, run_id: str, timeout_s: float) -> bool:
        """Wait until the run is no longer driven here; False on timeout."""
        driving = self._runs.get(run_id)
        if driving is None:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await driving.stopped.wait()
        except TimeoutError:
            return False
        return True

    def cancel_all(self, reason: str) -> None:
        """Stop everything (the process is shutting down): runs are saved as interrupted."""
        for run_id in list(self._runs):
            self.cancel(run_id, reason, "gateway")


async def watch_remote_cancel(store: Store, run_id: str, scope: CancelScope, after: int, interval_s: float,
                              stop: asyncio.Event | None = None, deadline_s: float = 5.0) -> None:
    """Poll the run's trace for a `cancel_requested` line newer than `after`; press `scope`.

    Runs until `stop` is set (the driver sets it when the run stops), until it pressed Stop,
    or until cancelled; a store that fails or does not answer within `deadline_s` is polled
    again (the lease keeper decides when the store has been gone too long to keep driving).
    `stop` is what ends it reliably: a task cancelled while redis-py awaits a reply can lose
    the cancellation (redis/redis-py#2028), and the driver never waits on this task anyway.
    """
    stop = stop or asyncio.Event()
    failing = False
    period = poll_period(store, interval_s)
    while not scope.cancelled and not stop.is_set():
        try:
            async with asyncio.timeout(deadline_s):
                batch = await store.events(run_id, after)
            failing = False
        except (StoreError, TimeoutError) as exc:
            if not failing:  # once per outage, not once per poll
                log.warning("run %s: reading cancel requests failed, retrying: %s", run_id, exc)
            failing, batch = True, []
        for seq, event in batch:
            after = seq
            if event.get("type") == CANCEL_REQUESTED:
                scope.cancel(str(event.get("reason") or "cancelled"))
                return
        if stop.is_set():
            return
        # The polling period of a cross-replica signal, cut short by stop or by the store's
        # notification of the run (PostgreSQL: then it polls only as a fallback).
        await changed(store, "run", run_id, period, stop)
