"""Group commit for the SQLite store: the writes of one event-loop turn share one transaction.

Under load, the calls being served reach their store writes (a reservation, a turn's
commit) in bursts, often ten or more in one turn of the event loop. Each in a transaction
of its own costs a BEGIN IMMEDIATE (file locks), a COMMIT, and the pages it touched
written to the WAL, although the ledger row and the reservations page are the same for
all of them. `WriteBatch` runs the steps queued during one loop turn in one transaction
(scheduled with `call_soon`, so it runs at the start of the next turn). A step may refuse
(StaleRun, RunNotFound, RunExists: the `refusals` the store names) only before it has
written anything, so a refused step is simply left out and its caller gets the refusal;
the others commit together. Any other error undoes the whole transaction and fails every
step (a savepoint per step would cost two more statements each). Every caller hears back
only after the COMMIT has returned, so each write is as durable before its caller goes on
as it was alone.

A step whose caller was cancelled before the batch ran is skipped if it asked for that
(a reservation nobody waits for any more); others run anyway (a turn's commit books
money that was spent).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Step = Callable[[sqlite3.Connection], T]
"""A write: runs inside an open transaction on the store's connection, returns its result;
raises one of the batch's refusals only before it has written anything."""


@dataclass
class _Queued(Generic[T]):
    step: Step[T]
    future: asyncio.Future[T]
    skip_if_cancelled: bool


class WriteBatch:
    """Queues steps and runs each loop turn's queue in one transaction."""

    def __init__(self, db: Callable[[], sqlite3.Connection], translate: Callable[[Exception], Exception],
                 refusals: tuple[type[Exception], ...]) -> None:
        self._db = db
        self._translate = translate
        self._refusals = refusals
        self._queue: list[_Queued[Any]] | None = None
        self.transactions = 0
        """Batches committed so far."""
        self.steps = 0
        """Steps committed in them."""

    @property
    def pending(self) -> bool:
        """Whether steps wait for the next loop turn (later writes must join them, to keep order)."""
        return self._queue is not None

    def submit(self, step: Step[T], *, skip_if_cancelled: bool) -> asyncio.Future[T]:
        """Queue `step` for this loop turn's batch; the future resolves after its COMMIT."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._queue is None:
            self._queue = []
            loop.call_soon(self._flush)
        self._queue.append(_Queued(step, future, skip_if_cancelled))
        return future

    def _flush(self) -> None:
        queue, self._queue = self._queue or [], None
        todo = [q for q in queue if not (q.skip_if_cancelled and q.future.cancelled())]
        if not todo:
            return
        outcomes: list[tuple[bool, Any]] = []
        try:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                for q in todo:
                    try:
                        outcomes.append((True, q.step(db)))
                    except self._refusals as exc:  # raised before the step wrote anything
                        outcomes.append((False, exc))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except Exception as exc:  # noqa: BLE001 - nothing was written: every step fails
            error = self._translate(exc)
            for q in todo:
                if not q.future.done():
                    q.future.set_exception(error)
            return
        self.transactions += 1
        self.steps += len(todo)
        for q, (ok, value) in zip(todo, outcomes, strict=True):
            if q.future.done():  # its caller was cancelled: the step ran all the same
                continue
            if ok:
                q.future.set_result(value)
            else:
                q.future.set_exception(value)
