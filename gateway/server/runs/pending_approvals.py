"""`gateway_approvals_pending{team}`: read from the store when scraped, the same on every replica.

The calls waiting for a person live in the shared store, and any replica may pause a run,
record a decision or sweep an expiry; a gauge each process kept from what it saw itself
went stale on the others (a replica kept reporting a call decided elsewhere). So the
gauge is not kept: a scrape recounts it from the store (the interrupted runs, at most
`SCAN`, newest first, whose call is undecided), at most once per `CACHE_S`, so several
scrapes (one per replica, per worker, per Prometheus) do not each rescan. A change made
by this process (`changed`) drops the cached count, so its own next scrape is exact; the
other replicas' are at most `CACHE_S` behind. Every configured team is reported, at 0
when nothing waits.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Final

from gateway.server.metrics import Metrics
from gateway.store.base import Store

CACHE_S: Final = 1.0
SCAN: Final = 10_000


class PendingApprovals:
    """The team gauge of calls waiting for a decision, recounted from the store on demand."""

    def __init__(self, store: Store, metrics: Metrics | None, teams: Callable[[], Iterable[str]] = tuple,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.metrics = metrics
        self.teams = teams
        self.clock = clock
        self._read_at: float | None = None
        self._changes = 0
        self._shown: set[str] = set()
        self._lock = asyncio.Lock()

    def changed(self) -> None:
        """This process paused, decided, expired or cancelled a call: recount at the next scrape."""
        self._read_at = None
        self._changes += 1

    async def refresh(self) -> dict[str, int]:
        """Set the gauge from the store (unless it was read less than `CACHE_S` ago); the
        counts by team. Raises StoreError if the store fails."""
        async with self._lock:  # scrapes arriving together read the store once
            read_at = self._read_at
            if read_at is not None and self.clock() - read_at < CACHE_S:
                return {}
            started, changes = self.clock(), self._changes
            runs = await self.store.list_runs(status="interrupted", limit=SCAN)
            counts = Counter(run.team for run in runs if run.waits_for_decision)
            if self.metrics is not None:
                for team in {*self.teams(), *counts, *self._shown}:
                    self.metrics.set_approvals_pending(team, counts.get(team, 0))
            self._shown |= set(counts)
            if changes == self._changes:  # else a change came in meanwhile: read again next time
                self._read_at = started
            return dict(counts)
