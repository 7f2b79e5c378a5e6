"""The threads sync python tools run on: a pool of the process's own, sized in config.

A sync tool blocks its thread for as long as it works (seconds, minutes). On asyncio's
default executor (min(32, cores + 4) threads: 6 on two cores) a few such calls would
queue every other user of that pool behind them: the other tools, a policy reload, the
DNS lookups of upstream connections. `ToolThreads` is a pool of `server.tool_threads`
threads used by tools only; a call past its size waits for a thread, and how many run and
how many wait is reported as it changes (`gauge(busy_delta, waiting_delta)`, from any
thread), so saturation shows as a metric.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

Gauge = Callable[[int, int], None]
"""Told (busy change, waiting change) as calls wait, start and end; called from any thread."""


def _ignore(busy: int, waiting: int) -> None:
    return None


class _Waiting:
    """A call's wait, ended once: by the thread that starts it or by the cancel that drops it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = True

    def end(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            was, self._waiting = self._waiting, False
            return was


class ToolThreads:
    """`size` threads for sync tools (no other work runs on them)."""

    def __init__(self, size: int, gauge: Gauge = _ignore) -> None:
        self.size = size
        self._gauge = gauge
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="gateway-tool")

    async def run(self, func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`func(*args, **kwargs)` on one of the pool's threads (with this task's context,
        as `asyncio.to_thread`); waits for a thread while all are busy."""
        call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
        waiting = _Waiting()
        self._gauge(0, 1)

        def on_thread() -> T:
            self._gauge(1, -1 if waiting.end() else 0)
            try:
                return call()
            finally:
                self._gauge(-1, 0)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, on_thread)
        finally:
            if waiting.end():  # cancelled (or shut down) before a thread took it: it never ran
                self._gauge(0, -1)

    def close(self) -> None:
        """Stop taking calls; calls running finish on their threads (nobody waits for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
