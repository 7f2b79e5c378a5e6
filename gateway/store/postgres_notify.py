"""Wake-ups across replicas on PostgreSQL: LISTEN/NOTIFY, with polling as the fallback.

The PostgreSQL store NOTIFYs in the same transaction as the write that matters to another
replica (a run's `cancel_requested` or `approval_decided` line: channel `<schema>_run`,
payload the run id; a key written: `<schema>_keys`; a notice added to the outbox:
`<schema>_outbox`; a reload announced: `<schema>_reload`), so a notification is sent only
once the write is visible. `Listener` holds one connection of its own that LISTENs to them
and wakes whoever waits (`wait`).

A notification is a hint, never the truth: a waiter always waits at most its polling
period and then reads the store anyway, so a notification lost (the listening connection
dropped, the database restarted) costs one polling period, never a missed cancel or key.
While its connection is down the listener tries again every `RECONNECT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

log = logging.getLogger(__name__)

TOPICS: Final = ("run", "keys", "outbox", "reload")
RECONNECT_S: Final = 1.0


class Listener:
    """One LISTEN connection per store, opened on the first `wait`."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], schema: str) -> None:
        self._connect = connect
        self._prefix = schema + "_"
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.received = 0
        """Notifications received so far (tests and metrics read it)."""

    def _start(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.ensure_future(self._keep())

    async def wait(self, topic: str, key: str, timeout_s: float) -> bool:
        """Wait for a notification on `topic` (for `key`: a run id, or '') for at most
        `timeout_s`; True if one came. The caller reads the store either way."""
        self._start()
        event = self._events.setdefault((topic, key), asyncio.Event())
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            if not event.is_set() and self._events.get((topic, key)) is event:
                del self._events[(topic, key)]

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        self.received += 1
        topic = channel[len(self._prefix):] if channel.startswith(self._prefix) else channel
        for key in {payload, ""}:
            event = self._events.pop((topic, key), None)
            if event is not None:
                event.set()

    async def _keep(self) -> None:
        while not self._closed:
            conn = None
            try:
                conn = await self._connect()
                for topic in TOPICS:
                    await conn.add_listener(self._prefix + topic, self._on_notify)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c: lost.set())
                await lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the database is away: poll meanwhile, try again
                log.debug("store: LISTEN connection failed (polling meanwhile): %s", exc)
            finally:
                if conn is not None:
                    conn.terminate()
            await asyncio.sleep(RECONNECT_S)

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
