"""Retention: finished runs, their events, closed ledgers and the trace file, pruned as they age.

`apply(store, config)` is one pass (what `gateway prune` runs); `background(app)` is the
cleanup context that runs a pass at start and then every `retention.interval_s`, and sets
up the trace file's rotation (`gateway.store.tracefile`). Every replica prunes: the
deletes are idempotent, so two passes at once only do the work twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from gateway.config.settings import Config, ConfigError, RetentionConfig, load_config
from gateway.server import context as ctx
from gateway.store import Store, StoreError, open_store, tracefile
from gateway.store.base import spend_day

log = logging.getLogger(__name__)

DAY_S = 86_400.0
MB = 1024 * 1024


@dataclass(frozen=True)
class Pruned:
    """What one pass deleted."""

    runs: int = 0
    events_of: int = 0
    ledgers: int = 0
    responses: int = 0
    notices: int = 0
    sessions: int = 0
    spend_days: int = 0
    audit: int = 0

    def __str__(self) -> str:
        return (f"{self.runs} finished run(s), the events of {self.events_of} more, {self.ledgers} closed ledger "
                f"figure(s), {self.responses} stored response(s), {self.notices} sent or abandoned notice(s), "
                f"{self.sessions} ended console session(s), {self.spend_days} day(s) of spend, {self.audit} audit "
                "record(s)")

    def any(self) -> bool:
        return any(self.__dict__.values())


async def apply(store: Store, retention: RetentionConfig, now: float | None = None) -> Pruned:
    """One pass: what the config's ages say is due, deleted now. Raises StoreError."""
    now = time.time() if now is None else now
    runs = events = ledgers = responses = notices = 0
    if retention.runs_days is not None:
        runs = await store.prune_runs(now - retention.runs_days * DAY_S)
        responses = await store.prune_responses(now - retention.runs_days * DAY_S)  # as old as the runs they continue
    if retention.events_days is not None:
        events = await store.prune_runs(now - retention.events_days * DAY_S, events_only=True)
    if retention.ledger_days is not None:
        ledgers = await store.prune_ledgers(now - retention.ledger_days * DAY_S)
    if retention.outbox_days is not None:
        notices = await store.prune_outbox(now - retention.outbox_days * DAY_S)
    sessions = await store.prune_sessions(now)
    spend = audit = 0
    if retention.spend_days is not None:
        spend = await store.prune_spend(spend_day(now - retention.spend_days * DAY_S))
    if retention.audit_days is not None:
        audit = await store.prune_audit(now - retention.audit_days * DAY_S)
    return Pruned(runs, events, ledgers, responses, notices, sessions, spend, audit)


def configure_trace_file(config: Config) -> None:
    """Rotate the config's trace file as `retention` says (no trace file: nothing to do)."""
    if config.trace_file is None:
        return
    limit = config.retention.trace_file_max_mb
    tracefile.configure(config.trace_file, None if limit is None else max(1, int(limit * MB)),
                        config.retention.trace_file_keep)


async def _loop(store: Store, retention: RetentionConfig, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            pruned = await apply(store, retention)
            if pruned.any():
                log.info("retention pruned %s", pruned)
        except StoreError as exc:
            log.warning("retention pass failed, next in %.0fs: %s", retention.interval_s, exc)
        except Exception:  # a bug must not end retention for the life of the process
            log.exception("retention pass failed")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(retention.interval_s):
                await stop.wait()


async def background(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: trace file rotation, and a retention pass now and every interval."""
    config = app[ctx.LIVE].config
    configure_trace_file(config)
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(_loop(app[ctx.STORE], config.retention, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=5.0)


def prune_command(args: argparse.Namespace) -> int:
    """`gateway prune [--config]`: one retention pass now; prints what it deleted."""
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"gateway: config error: {line}", file=sys.stderr)
        return 2

    async def once() -> Pruned:
        store = open_store(config.store.options)
        try:
            return await apply(store, config.retention)
        finally:
            await store.close()

    try:
        pruned = asyncio.run(once())
    except StoreError as exc:
        print(f"gateway: prune failed: {exc}", file=sys.stderr)
        return 1
    rotated = ""
    if config.trace_file is not None and config.retention.trace_file_max_mb is not None:
        configure_trace_file(config)
        if config.trace_file.exists() and config.trace_file.stat().st_size >= config.retention.trace_file_max_mb * MB:
            tracefile.rotate(config.trace_file, config.retention.trace_file_keep)
            rotated = f"; rotated {config.trace_file}"
    print(f"pruned {pruned}{rotated}")
    return 0
