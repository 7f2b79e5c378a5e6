"""What a gateway checks of its store before it serves (docs/stores.md, "What Redis must keep").

On Redis, the ledger, the reservations in flight, the leases of runs being driven and the
webhook outbox are keys like any other: a server that may evict keys when it is full
(`maxmemory-policy` other than `noeviction`; the `volatile-*` ones too, since leases and
the records of expired reservations carry a TTL) can drop them silently, and budgets are
then passed, runs driven twice, spend never booked. So at start:

- an evicting policy is refused (`StartError`: one line, exit 2) unless the config says
  `store.allow_eviction: true` (then one warning line);
- `appendonly no` is one warning line: a Redis restart loses what was booked since its
  last snapshot;
- a server that refuses `CONFIG GET` (managed offerings often do) cannot be checked: one
  warning line naming what to make sure of, and the gateway starts; so does one that is
  unreachable at start (the store's outage rules apply then).
"""

from __future__ import annotations

import logging

from gateway.config.settings import StoreConfig
from gateway.server.http.listener import StartError
from gateway.store import Store, StoreError
from gateway.store.redis import RedisStore
from gateway.store.timed import unwrapped

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"


async def check_store(store: Store, config: StoreConfig) -> None:
    """Refuse to start on a Redis that may evict the gateway's keys (see the module docstring);
    connect to PostgreSQL and migrate its schema (a database that cannot be reached is one
    warning line and the gateway starts; a schema it cannot migrate stops the start)."""
    store = unwrapped(store)  # the kind of store behind the timing (`gateway.store.timed`)
    start = getattr(store, "start", None)
    if callable(start):
        try:
            await start()
        except StoreError as exc:
            if "cannot connect" not in str(exc):
                raise StartError(f"store: {exc}") from None
            log.warning("store: cannot reach the database at start (%s); calls are 503 until it answers", exc)
        return
    if not isinstance(store, RedisStore):
        return
    try:
        settings = await store.server_settings("maxmemory-policy", "appendonly")
    except StoreError as exc:
        log.warning("store: cannot check the Redis server's maxmemory-policy at start (%s); it must be %s "
                    "(docs/stores.md)", exc, SAFE_POLICY)
        return
    if settings is None:
        log.warning("store: the Redis server refuses CONFIG GET, so its maxmemory-policy cannot be checked; make "
                    "sure it is %s and that it persists writes (appendonly yes): docs/stores.md", SAFE_POLICY)
        return
    policy = settings.get("maxmemory-policy", SAFE_POLICY)
    if policy != SAFE_POLICY:
        if not config.allow_eviction:
            raise StartError(f"store: the Redis server's maxmemory-policy is {policy}: when full it may evict the "
                             f"ledger, reservations and leases (budgets passed, runs driven twice); set it to "
                             f"{SAFE_POLICY}, or store.allow_eviction: true to accept that (docs/stores.md)")
        log.warning("store: the Redis server's maxmemory-policy is %s and store.allow_eviction is true: keys the "
                    "ledger needs may be evicted when it is full", policy)
    if settings.get("appendonly") == "no":
        log.warning("store: the Redis server has appendonly no: a Redis restart loses what was booked since its "
                    "last snapshot (docs/stores.md)")
