"""A client that leaves stops the upstream work done for it.

aiohttp tells a handler nothing when its client closes the connection (its handler
cancellation is off, rightly: most handlers must finish what they began, a booking above
all). A handler opts in around the part of a call that only waits for its upstream:
inside `upstream_wait(request)`, the loss of the connection (the listener's
`JsonErrorHandler.connection_lost` calls `client_left`) cancels the handler's await, which
stops the upstream call (its connection is closed, not drained), and the block raises
`ClientLeft` in place of the cancellation. The caller then books what the call used and
frees what it held, at once. Outside such a block a lost client changes nothing.

Arming costs one entry in the request's dict: no task, no timer, no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from gateway.server.http.errors import ClientLeft


@dataclass
class _Watch:
    task: asyncio.Task[object]
    armed: bool = True
    fired: bool = False


WATCH: Final = web.RequestKey("client_watch", _Watch)


def gone(request: web.BaseRequest) -> bool:
    """The client's connection is closed (or closing) already."""
    transport = request.transport
    return transport is None or transport.is_closing()


@contextlib.contextmanager
def upstream_wait(request: web.Request) -> Iterator[None]:
    """Wait for an upstream inside this block: if the client leaves meanwhile, the await in
    progress is cancelled and the block raises `ClientLeft` (a client gone before the
    block is entered raises it at once)."""
    if gone(request):
        raise ClientLeft()
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(task)
    request[WATCH] = watch
    taken = False  # the cancellation `client_left` asked for was taken back
    try:
        yield
    except asyncio.CancelledError:
        if not watch.fired:
            raise
        taken = True
        if task.uncancel() > 0:  # cancelled for another reason too (a shutdown): that one wins
            raise
        raise ClientLeft() from None
    finally:
        watch.armed = False
        if watch.fired and not taken:  # the awaited call swallowed the cancel and ended: take it back
            task.uncancel()


def client_left(request: web.BaseRequest) -> None:
    """The client's connection is lost: stop the upstream wait its handler is in, if any
    (called by the listener; a request in no such block is left alone)."""
    watch = request.get(WATCH)
    if watch is not None and watch.armed and not watch.fired:
        watch.fired = True
        watch.task.cancel("client left")
