"""A reload on one replica reloads every replica that shares its store.

A reload that served its files (`gateway.server.reload`) because of a SIGHUP or a
POST /v1/admin/reload is announced in the store (`announce`: `Store.announce_reload`, which
counts it, a generation, and names its origin; on PostgreSQL it NOTIFYs `<schema>_reload`
in the same transaction). Every process watches that count in the background (`background`,
a cleanup context): it waits for the notification or its poll (`signals.changed`, at most
`RELOAD_POLL_S`), reads the mark, and when the count moved past what it has seen it reloads
its own files (`by` "another replica"), logged as any reload and recorded in the audit log
(`config.reloaded`, `details.by`). Such a reload is never announced again: no storms, no loops.

- A process takes the count at its start as seen (it has just read its files). One whose
  store is down at start takes it at the first read that works.
- Its own announcement is not reloaded again: the mark names the origin of the latest one,
  and a latest announcement of its own origin was a reload this server made after every
  announcement counted before it (its files were read then), however far the count moved
  since this process last looked (two reloads of its own within a poll move it by two). The workers of one
  `--workers N` server share their origin (`workers.shared_origin`): the supervisor's
  fan-out already reloads them all, so their watchers skip it alike. A replica's reload
  reaches each worker of another server through its own watcher, once; only worker 0
  records it in the audit log (one reload, one record, as for a SIGHUP).
- A notification lost (the listening connection dropped) costs one poll period; SQLite and
  Redis have no notifications: their watchers poll. One cheap read per period per process,
  in the background: no call pays for any of it.
- The store down: the watcher logs once when it cannot read the mark and once when it can
  again, and keeps trying; it never stops the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from gateway.store import signals
from gateway.store.base import ReloadMark
from gateway.server import context as ctx
from gateway.server.reload import record_reload, reload
from gateway.server.workers import shared_origin

log = logging.getLogger("gateway")

RELOAD_POLL_S: Final = 1.0
"""How often a process reads the reload mark when no notification wakes it sooner."""
BY_REPLICA: Final = "another replica"
"""`by` of a reload made because another replica announced one (the log, the audit record)."""


@dataclass
class ReloadWatch:
    """What this process knows of the reloads announced in its store."""

    origin: str = field(default_factory=lambda: shared_origin() or "process-" + secrets.token_hex(8))
    """The name its announcements carry: its server's (the workers of one supervisor share it)."""
    seen: int | None = None
    """The last generation this process reloaded for, announced, or started after (None: not read yet)."""
    reloads: int = 0
    """Reloads made for another replica's announcement (tests read it)."""


WATCH: Final = web.AppKey("reload_watch", ReloadWatch)


def setup(app: web.Application) -> None:
    """Watch the store's reload mark while `app` runs (`background`)."""
    app[WATCH] = ReloadWatch()
    app.cleanup_ctx.append(background)


async def announce(app: web.Application) -> ReloadMark | None:
    """After a reload that served its files by a SIGHUP or POST /v1/admin/reload: tell every
    replica sharing the store. The store down: logged, the others are then not told (None)."""
    try:
        return await app[ctx.STORE].announce_reload(app[WATCH].origin)
    except Exception as exc:  # noqa: BLE001 - the reload itself served: the others are reloaded by hand
        log.warning("reload: could not tell the other replicas sharing the store (reload each of them): %s", exc)
        return None


def _moved(watch: ReloadWatch, mark: ReloadMark) -> bool:
    """Take `mark` as seen; True when it is a reload this process has not made (see the module docstring)."""
    seen, watch.seen = watch.seen, mark.generation
    if seen is None or mark.generation <= seen:  # the first read, nothing new, or a store emptied since
        return False
    return mark.origin != watch.origin


async def _reload_for_replica(app: web.Application, watch: ReloadWatch) -> None:
    watch.reloads += 1
    done = await reload(app, by=BY_REPLICA)  # logs what it served, or why it kept the old files
    if done.ok and app.get(ctx.WORKER, 0) == 0:
        await record_reload(app, done, None, by=BY_REPLICA)


class _Reading:
    """Logs a change of whether the mark can be read, once per change."""

    def __init__(self) -> None:
        self.failing = False

    async def mark(self, app: web.Application) -> ReloadMark | None:
        try:
            mark = await app[ctx.STORE].reload_mark()
        except Exception as exc:  # noqa: BLE001 - the store is away: try again at the next poll
            if not self.failing:
                log.warning("reload watch: cannot read the store's reload mark, another replica's reload is "
                            "missed until it can (trying every %.0f s): %s", RELOAD_POLL_S, exc)
            self.failing = True
            return None
        if self.failing:
            log.warning("reload watch: the store's reload mark can be read again")
        self.failing = False
        return mark


async def _watch(app: web.Application, watch: ReloadWatch, reading: _Reading) -> None:
    store = app[ctx.STORE]
    while True:
        await signals.changed(store, "reload", "", RELOAD_POLL_S)
        mark = await reading.mark(app)
        if mark is None or not _moved(watch, mark):
            continue
        try:
            await _reload_for_replica(app, watch)
        except Exception:  # noqa: BLE001 - never stop watching (the audit record may fail with the store)
            log.exception("reload watch: the reload for another replica failed")


async def background(app: web.Application) -> AsyncIterator[None]:
    """Take the mark at start as seen (before serving), then watch it until the app stops."""
    watch, reading = app[WATCH], _Reading()
    mark = await reading.mark(app)
    if mark is not None:
        _moved(watch, mark)
    task = asyncio.ensure_future(_watch(app, watch, reading))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
