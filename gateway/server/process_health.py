"""What a process samples of its own health between scrapes (docs/metrics.md, "Process health").

`sample(app)`, a background task of every process (`cleanup_ctx`): the event loop's lag
(how late a timer due now runs: a loop blocked by a slow call, a long sync tool, a GC
pause), measured every `LAG_EVERY_S` and reported as the most over the last `LAG_WINDOW_S`;
the connections to the upstreams in use and idle, every second; in multiprocess mode, the
worker's GC file (`process_metrics.publish_gc`). A timer every quarter second: nothing
measurable per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from gateway.server import context as ctx
from gateway.server.process_metrics import GC_FILE_S, forget_worker, publish_gc

log = logging.getLogger(__name__)

LAG_EVERY_S: Final = 0.25
LAG_WINDOW_S: Final = 5.0
CONNECTIONS_EVERY_S: Final = 1.0


async def sample(app: web.Application) -> AsyncIterator[None]:
    """`cleanup_ctx`: the sampling task of this process (see the module docstring)."""
    task = asyncio.ensure_future(_sample_forever(app))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        folder = app[ctx.METRICS].multiprocess_dir
        if folder is not None:
            forget_worker(folder, os.getpid())


async def _sample_forever(app: web.Application) -> None:
    metrics = app[ctx.METRICS]
    folder = metrics.multiprocess_dir
    loop = asyncio.get_running_loop()
    lags: deque[float] = deque(maxlen=int(LAG_WINDOW_S / LAG_EVERY_S))
    next_connections = next_gc = 0.0
    while True:
        asked = loop.time()
        await asyncio.sleep(LAG_EVERY_S)
        lags.append(max(0.0, loop.time() - asked - LAG_EVERY_S))
        try:
            metrics.set_loop_lag(max(lags))
            now = time.monotonic()
            if now >= next_connections:
                next_connections = now + CONNECTIONS_EVERY_S
                upstreams = app.get(ctx.UPSTREAMS)
                if upstreams is not None:
                    metrics.set_upstream_connections(*upstreams.sessions.connections())
            if folder is not None and now >= next_gc:
                next_gc = now + GC_FILE_S
                publish_gc(folder)
        except Exception:  # a metric must never take the process down
            log.exception("sampling the process's health failed")
