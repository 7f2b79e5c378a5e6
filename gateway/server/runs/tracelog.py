"""A run's trace on its way to the store: buffered, in order, written with every save.

The loop emits trace lines synchronously (`options.on_event`); the store is async. The
writer keeps the lines in order, hands each one at once to in-process listeners (metrics,
the SSE progress of the request), and writes them to the store (and the optional trace
file) in the background and, at the latest, in the same store step as the run's next
checkpoint (`commit`), so the saved trace never lags the saved state. A line that
announces a state someone acts on (`ANNOUNCING`: a person decides after
`approval_required`, a client resumes after `run_stopped`) is never written ahead of that
state: the background writer stops before it, and the checkpoint writes it with the state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from gateway.harness.state import RunState
from gateway.store import tracefile
from gateway.store.audit import AuditEntry
from gateway.store.base import Event, Lease, Store
from gateway.store.errors import LeaseLost

log = logging.getLogger(__name__)

Listener = Callable[[Event], None]

ANNOUNCING: Final = frozenset({"approval_required", "limit_reached", "run_stopped"})
"""Trace lines that readers act on at once (decide, resume): written only with the run's
state that they announce, never before it."""


class TraceWriter:
    """The `on_event` sink of one driven run."""

    def __init__(self, store: Store, run_id: str, *, trace_file: Path | None = None,
                 listeners: Sequence[Listener] = (), lease: Lease | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.trace_file = trace_file
        self.listeners = list(listeners)
        """Hear each line as it is made (the request's progress)."""
        self.written: list[Listener] = []
        """Hear each line once it is stored (the run's metrics)."""
        self.lease = lease
        """The lease every write is made under (None: none, e.g. a run nobody drives)."""
        self._buffer: list[Event] = []
        self._audit: list[AuditEntry] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def __call__(self, event: Event) -> None:
        self._buffer.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a broken listener (metrics, a gone client) must not stop the run
                log.exception("trace listener failed on %s", event.get("type"))
        self._wake.set()

    def start(self) -> None:
        """Write lines in the background as they come (progress reaches `follow` readers live)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._write(ahead=True)
            except LeaseLost:  # the next checkpoint raises it too, and the drive stops
                return
            except Exception:  # kept in the buffer: the next checkpoint retries and raises
                log.exception("cannot write the trace of run %s yet", self.run_id)

    async def flush(self) -> None:
        """Write every buffered line, in order; concurrent writes queue behind each other."""
        await self._write(ahead=False)

    async def commit(self, state: RunState) -> None:
        """Save `state` and every buffered line in one store step (`Store.commit_turn`)."""
        await self._write(ahead=False, state=state)

    def audit(self, entries: Sequence[AuditEntry]) -> None:
        """Audit records written with the next save of the run (`commit`): the act it records."""
        self._audit.extend(entries)

    async def _write(self, *, ahead: bool, state: RunState | None = None) -> None:
        """The buffered lines (`ahead`: only those before the first `ANNOUNCING` one), with
        `state` when given, in one store step."""
        async with self._lock:
            n = len(self._buffer)
            if ahead:
                n = next((i for i, e in enumerate(self._buffer) if e.get("type") in ANNOUNCING), n)
            if not n and state is None:
                return
            batch, self._buffer = self._buffer[:n], self._buffer[n:]
            try:
                if state is None:
                    await self.store.append_events(self.run_id, batch, lease=self.lease)
                else:
                    await self.store.commit_turn(state, batch, audit=self._audit, lease=self.lease)
                    self._audit = []
            except BaseException:
                self._buffer[:0] = batch
                raise
            if self.trace_file is not None and batch:
                _append_lines(self.trace_file, batch)
            for event in batch:
                for listener in self.written:
                    try:
                        listener(event)
                    except Exception:
                        log.exception("trace listener failed on %s", event.get("type"))

    async def close(self) -> None:
        """Stop the background writer and write what is left."""
        task, self._task = self._task, None
        self._closing = True
        self._wake.set()
        if task is not None:
            await task  # lets a flush in progress finish: cancelling it could lose its batch
        try:
            await self.flush()
        except LeaseLost:  # another process drives the run now: what is left is not its to write
            log.warning("run %s: %d trace lines of a drive that lost its lease were not written", self.run_id,
                        len(self._buffer))
            self._buffer.clear()


def _append_lines(path: Path, events: list[Event]) -> None:
    tracefile.append(path, events)


async def asked_at(store: Store, run: RunState, call_id: str) -> float | None:
    """When the run asked a person about `call_id` (a call, or a limit request): its last
    `approval_required` (or `limit_reached`) line for it, else (a trace without it) when the
    run last stopped, if it is waiting on that call; else None. What an approval's expiry
    counts from, for the runs API, the console and the recovery sweep."""
    asked = [e.get("ts") for _, e in await store.events(run.run_id)
             if e.get("type") in ("approval_required", "limit_reached") and e.get("callId") == call_id]
    if asked and isinstance(asked[-1], (int, float)):
        return float(asked[-1])
    return run.updated_at if run.interruption is not None and run.interruption.call_id == call_id else None
