"""Any `Store`, its calls timed: `timed(store, observe)` (the `gateway_store_seconds{op}` metric).

The wrapper is made once, when the app opens its store: each coroutine method of the
`Store` protocol (`OPERATIONS`) becomes an attribute of the wrapper that awaits the store's
own and tells `observe(op, seconds)`, whether it returned or raised; anything else (a
store kind's own attributes) is the store's, reached through, read or set. So it works for every store
kind, present and future, with no method written out twice; `inner` is the store itself.
Its cost: one coroutine frame and two clock reads per store call.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

from gateway.store.base import Store

Observe = Callable[[str, float], None]

OPERATIONS: Final = tuple(sorted(name for name, member in vars(Store).items()
                                 if inspect.iscoroutinefunction(member) and name != "close"))
"""The operations timed: every coroutine method of the Store protocol but `close`."""


def _timed(op: str, method: Callable[..., Awaitable[Any]], observe: Observe) -> Callable[..., Awaitable[Any]]:
    clock = time.perf_counter

    async def call(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return await method(*args, **kwargs)
        finally:
            observe(op, clock() - started)

    return call


class TimedStore:
    """`inner`, each Store operation timed (see the module docstring)."""

    def __init__(self, inner: Store, observe: Observe) -> None:
        self.inner = inner
        for op in OPERATIONS:
            setattr(self, op, _timed(op, getattr(inner, op), observe))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # What the app sets on its store (`notice_rule`, the webhooks' rule) is the store's own.
        if name == "inner" or name in OPERATIONS:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)


def timed(store: Store, observe: Observe) -> Store:
    """`store` with its calls timed (a store already timed is returned as it is)."""
    if isinstance(store, TimedStore):
        return store
    return cast(Store, TimedStore(store, observe))


def unwrapped(store: Store) -> Store:
    """The store behind a timed one (for checks of a store's kind)."""
    return store.inner if isinstance(store, TimedStore) else store
