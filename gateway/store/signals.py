"""Waiting for another replica's change: a notification where the store has them, else a poll.

The PostgreSQL store tells its replicas of the writes another replica waits for (a run's
cancel or decision, a key written, a webhook notice added) with LISTEN/NOTIFY
(`postgres_notify`; the store's `signals`). The others (SQLite, Redis, memory) have none:
their waiters poll. `changed` is the one wait for both: at most `timeout_s` (the poll), less
when a notification comes. A waiter reads the store after it either way, so a notification
that never comes costs a polling period, never a missed change.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

NOTIFIED_POLL_S: Final = 1.0
"""How often a waiter on a store that notifies still reads it (a notification may be lost)."""


class Signals(Protocol):
    async def wait(self, topic: str, key: str, timeout_s: float) -> bool:
        """Until a notification of `topic` for `key` ('' : any) comes (True), or `timeout_s` (False)."""
        ...


def signals_of(store: object) -> Signals | None:
    """The store's notifications, or None (it has none: poll)."""
    found = getattr(store, "signals", None)
    return found if found is not None and hasattr(found, "wait") else None


def poll_period(store: object, interval_s: float) -> float:
    """The polling period of a waiter that polls every `interval_s` without notifications."""
    return max(interval_s, NOTIFIED_POLL_S) if signals_of(store) is not None else interval_s


async def changed(store: object, topic: str, key: str, timeout_s: float, *stops: asyncio.Event) -> None:
    """Wait `timeout_s`, less when the store notifies a change of `topic` (`key`: a run id, or
    '') or one of `stops` is set."""
    signals = signals_of(store)
    waits: list[asyncio.Future[object]] = [asyncio.ensure_future(e.wait()) for e in stops]
    if signals is not None:
        waits.append(asyncio.ensure_future(signals.wait(topic, key, timeout_s)))
    if not waits:
        await asyncio.sleep(timeout_s)
        return
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
