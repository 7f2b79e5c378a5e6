"""The runs this process booked last, kept parsed so that the next call of a run skips
loading it (a store round trip, and parsing the transcript).

A cached run is only a guess: the store may have moved on (another replica or worker
booked a turn, someone cancelled the run). A pass-through call that starts from a cached
run is admitted as usual, and the admission reports the run's stored revision in the same
store step (`Grant.run_revision`); when it differs from the cached one, the admission is
released and the call starts again from the stored run (`passthrough.admit`). So every
decision is made on the run as stored, as if it had been loaded, and the caps and budgets
stay the store's, exact across replicas.

Entries are dropped past `MAX_AGE_S` (a run pruned by retention and created again under
the same id never meets an old entry) and, oldest first, past `MAX_RUNS`.
"""

from __future__ import annotations

import time
from typing import Final

from gateway.harness.state import RunState

MAX_RUNS: Final = 1024
MAX_AGE_S: Final = 60.0


class RunCache:
    """Runs by id, as this process last stored them (a bounded LRU; copies in and out)."""

    def __init__(self, max_runs: int = MAX_RUNS, max_age_s: float = MAX_AGE_S) -> None:
        self.max_runs = max_runs
        self.max_age_s = max_age_s
        self._runs: dict[str, tuple[RunState, float]] = {}
        self.hits = 0
        self.stale = 0
        """Cached runs an admission found out of date (each cost a reload)."""

    def get(self, run_id: str) -> RunState | None:
        """A copy of the run as last put, or None (not cached, or too old)."""
        found = self._runs.pop(run_id, None)
        if found is None:
            return None
        run, at = found
        if time.monotonic() - at > self.max_age_s:
            return None
        self._runs[run_id] = found  # most recently used last
        self.hits += 1
        return run.copy()

    def put(self, run: RunState) -> None:
        """Remember `run` as the store has it now (a copy: the caller may go on changing its own)."""
        self._runs.pop(run.run_id, None)
        self._runs[run.run_id] = (run.copy(), time.monotonic())
        while len(self._runs) > self.max_runs:
            del self._runs[next(iter(self._runs))]

    def drop(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def __len__(self) -> int:
        return len(self._runs)
