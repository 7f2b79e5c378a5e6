"""What the upstreams with `discover_models: true` serve, as their model lists say.

`GET /v1/models` lists what a glob route can reach by asking its upstream
(`Upstream.list_models`: `GET {base_url}/models`). The answers are kept per upstream for
`TTL_S`; one refresh at a time per upstream is shared by every caller that needs it (a
burst of listings asks the upstream once). A failed refresh is logged and leaves the last
good list in use (or none), and is not tried again for `RETRY_S`: a listing never fails,
and never waits long, because an upstream cannot answer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from gateway.providers.errors import UpstreamError

__all__ = ["ModelDiscovery"]

log = logging.getLogger(__name__)

TTL_S = 60.0
"""How long one upstream's list is used before it is asked again."""
RETRY_S = 10.0
"""How long after a failed refresh the upstream is left alone (the last good list is used)."""
TIMEOUT_S = 5.0
"""The longest one refresh may take (at most the upstream's `timeout_s`)."""


@dataclass(frozen=True)
class _Known:
    names: tuple[str, ...] | None  # in the upstream's order; None: never listed successfully
    until: float  # when to ask again


class ModelDiscovery:
    """The model lists of upstreams, each fetched by `fetch(upstream)` and kept a while."""

    def __init__(self, fetch: Callable[[str], Awaitable[list[str]]], clock: Callable[[], float] = time.monotonic,
                 ttl_s: float = TTL_S, retry_s: float = RETRY_S) -> None:
        self._fetch = fetch
        self._clock = clock
        self._ttl_s = ttl_s
        self._retry_s = retry_s
        self._known: dict[str, _Known] = {}
        self._refreshing: dict[str, asyncio.Task[tuple[str, ...] | None]] = {}

    async def names(self, upstream: str) -> tuple[str, ...] | None:
        """What `upstream` serves, as it last said (None: it never said)."""
        known = self._known.get(upstream)
        if known is not None and self._clock() < known.until:
            return known.names
        task = self._refreshing.get(upstream)
        if task is None:
            task = self._refreshing[upstream] = asyncio.ensure_future(self._refresh(upstream, known))
        return await asyncio.shield(task)  # a caller that goes away does not cancel the others' refresh

    async def _refresh(self, upstream: str, known: _Known | None) -> tuple[str, ...] | None:
        try:
            listed = await self._fetch(upstream)
        except UpstreamError as exc:
            log.warning("cannot list the models of upstream '%s' (GET /v1/models goes on without them): %s",
                        upstream, exc.message)
            names = known.names if known is not None else None
            self._known[upstream] = _Known(names, self._clock() + self._retry_s)
            return names
        finally:
            self._refreshing.pop(upstream, None)
        names = tuple(listed)
        self._known[upstream] = _Known(names, self._clock() + self._ttl_s)
        return names

    def forget(self, upstreams: Iterable[str]) -> None:
        """Drop what these upstreams said (a config reload changed or removed them): the next
        listing asks them again."""
        for upstream in upstreams:
            self._known.pop(upstream, None)

    async def close(self) -> None:
        """Stop the refreshes under way (at shutdown: their sessions are closing)."""
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
