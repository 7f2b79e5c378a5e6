"""A client that leaves stops the upstream work done for it.

aiohttp tells a handler nothing when its client closes the connection (its handler
cancellation is off, rightly: most handlers must finish what they began, a booking above
all). A handler opts in around the part of a call that only waits for its upstream:
inside `upstream_wait(request)`, the loss of the connection (the listener's
`JsonErrorHandler.connection_lost` calls `client_left`) cancels the handler's await, which
stops the upstream call (its connection is closed, not drained), and the block raises
`ClientLeft` in place of the cancellation. The caller then books what the call used and
frees what it held, at once. Outside such a block a lost client changes nothing.

Arming costs one entry in the request's dict, removed when the block ends: no task, no
timer, no polling.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Final

from aiohttp import web

from gateway.server.http.errors import ClientLeft


class upstream_wait:  # noqa: N801  (used as a function: `with upstream_wait(request):`)
    """Wait for an upstream inside this block: if the client leaves meanwhile, the await in
    progress is cancelled and the block raises `ClientLeft` (a client gone before the
    block is entered raises it at once). A class, not a generator: it is on every call."""

    __slots__ = ("request", "task", "armed", "fired")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.task: asyncio.Task[object] | None = None
        self.armed = False
        self.fired = False

    def __enter__(self) -> None:
        if gone(self.request):
            raise ClientLeft()
        self.task = asyncio.current_task()
        self.armed = True
        self.request[WATCH] = self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.armed = False
        # The request no longer names this watch, and the watch lets go of its task (which
        # ends holding its response, which holds the request): either would be a cycle
        # keeping the request, its body of megabytes too, until a cyclic collection, which
        # an idle process never runs.
        if self.request.get(WATCH) is self:
            del self.request[WATCH]
        task, self.task = self.task, None
        if not self.fired:
            return
        assert task is not None
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            if task.uncancel() > 0:  # cancelled for another reason too (a shutdown): that one wins
                return
            raise ClientLeft() from None
        task.uncancel()  # the awaited call swallowed the cancel and ended: take it back


WATCH: Final = web.RequestKey("client_watch", upstream_wait)


def gone(request: web.BaseRequest) -> bool:
    """The client's connection is closed (or closing) already."""
    transport = request.transport
    return transport is None or transport.is_closing()


def client_left(request: web.BaseRequest) -> None:
    """The client's connection is lost: stop the upstream wait its handler is in, if any
    (called by the listener; a request in no such block is left alone)."""
    watch = request.get(WATCH)
    if watch is not None and watch.armed and not watch.fired and watch.task is not None:
        watch.fired = True
        watch.task.cancel("client left")
