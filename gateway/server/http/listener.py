"""The HTTP listener: aiohttp's server, with the errors of its own HTTP parser in the OpenAI shape.

aiohttp refuses a request it cannot parse (a header line over 8 KB, more than 128
headers, a malformed request line) before any route or middleware runs, and answers it
with a plain-text 400 that quotes the offending bytes. Here that answer is the gateway's
error shape instead: 431 `headers_too_large` for oversized or too many headers, 400
`invalid_body` for a Content-Encoding it cannot read, 400 `invalid_http_request` for
anything else the parser refuses, and a bare 500 (no traceback) for a failure outside
the middleware.

aiohttp has no option for the class of its per-connection `RequestHandler`, so
`GatewayRunner` gives the `Server` it builds a subclass whose connections use
`JsonErrorHandler` (which also reports a lost connection to `leaving`, so a call waiting
for its upstream stops when its client goes); `run(app, sockets)` is `web.run_app` with
that runner, and says on stderr, once stopped, how long the graceful stop took and how
many requests it let finish (a worker of `--workers N` hands that number to its supervisor
instead, which says it once for all of them).

The listening sockets are bound first (`listen_sockets`), before the app is built or
started: a port in use is one line (`StartError`, exit 2) before anything else happens.
That matters beyond the message: a second gateway started on the port of a running one
has the same owner name in the store, and starting it would give back the running one's
reservations and leases.

Slow and idle clients (`Connections`, from `server.*` in the config) are bounded here too,
since aiohttp itself only closes a connection that sent nothing after its keep-alive timer
(3630 s by default):

- a request's head (request line and headers) must be complete `header_timeout_s` after
  its first byte, or after the connection opened for its first request: else 408
  `header_timeout` (nothing at all sent: the connection is just closed);
- its body must be complete `body_timeout_s` after its head: else the handler reading it
  gets `BodyTimedOut` (answered 408 `body_timeout`, `validation.read_body`);
- a keep-alive connection with no request for `idle_timeout_s` is closed (aiohttp's
  keep-alive timer);
- past `max_connections` open connections, a new one is answered 503
  `too_many_connections` (`retry-after: 1`) to its first request and closed, with a head
  timeout of at most `REFUSED_HEAD_S`.

None of these runs while a request is being handled: a long stream or an
`events?follow=1` answer is never cut by them. Costs: one timer per connection (its head)
and one per request whose body did not come with its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong, PayloadEncodingError
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.config.settings import SCRIPTED_PREFIX, ServerConfig
from gateway.server.http.errors import ApiError, InternalError, Overloaded, RequestTimeout
from gateway.server.http.leaving import client_left

log = logging.getLogger(__name__)

LoopKind = Literal["auto", "uvloop", "asyncio"]
HEADERS_TOO_LARGE = 431
TOO_MANY_HEADERS = "Too many headers received"


def parser_error(status: int, exc: BaseException | None) -> ApiError:
    """The answer to a request aiohttp refused before routing it (or failed outside the middleware)."""
    if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and TOO_MANY_HEADERS in exc.message):
        return ApiError("the request's head is too large: the request line and each header may hold at most "
                        "8190 bytes, and a request at most 128 headers", status=HEADERS_TOO_LARGE,
                        type="invalid_request_error", code="headers_too_large")
    if isinstance(exc, PayloadEncodingError):
        return ApiError("the request body could not be read: its Content-Encoding is not one this gateway reads "
                        "(gzip, deflate) or does not match its bytes, or its Transfer-Encoding is broken",
                        status=400, type="invalid_request_error", code="invalid_body")
    if 400 <= status < 500:
        return ApiError("the request is not valid HTTP/1.1 (its request line or headers could not be parsed)",
                        status=status, type="invalid_request_error", code="invalid_http_request")
    return InternalError("the gateway failed on this request; see its log")


class StartError(Exception):
    """The gateway cannot start (a port in use, an address it cannot listen on): the message
    is the one line the operator reads; `gateway serve` exits 2 on it, before serving."""


def port_problem(exc: OSError, host: str, port: int, setting: str) -> StartError:
    """The line for a socket that could not be bound to (host, port), naming the `setting`
    that chose the address."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if isinstance(exc, socket.gaierror):
        return StartError(f"cannot listen on {where}: the host is unknown ({exc.strerror}); see {setting}")
    if exc.errno == errno.EADDRINUSE:
        return StartError(f"port {port} is in use: another process listens on {where}; stop it or choose "
                          f"another port ({setting})")
    return StartError(f"cannot listen on {where}: {exc.strerror or exc}; see {setting}")


def listen_sockets(host: str, port: int, *, reuse_port: bool = False,
                   setting: str = "server.host/server.port or --host/--port") -> list[socket.socket]:
    """Listening sockets on every address `host` names (as asyncio's `create_server` binds),
    port 0 resolved to one free port for all; `StartError` when one cannot be bound."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise port_problem(exc, host, port, setting) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, as asyncio does
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the same free port on every address
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                raise port_problem(exc, host, port or int(address[1]), setting) from None
            sock.listen(128)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bound_port(sockets: Sequence[socket.socket]) -> int:
    """The port the sockets listen on (port 0 resolved)."""
    return int(sockets[0].getsockname()[1])


REFUSED_HEAD_S = 1.0
"""The head timeout of a connection refused past `max_connections`: it is answered and closed soon."""
FD_HEADROOM = 256
"""File descriptors kept beyond `max_connections` (the store, upstream connections, logs)."""

ConnectionEvent = Literal["opened", "closed", "refused", "header_timeout", "body_timeout"]


def _ignore(event: ConnectionEvent) -> None:
    return None


@dataclass
class Connections:
    """The bounds on this process's client connections (`server.*`), and how many are open."""

    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    observe: Callable[[ConnectionEvent], None] = _ignore
    """Told of each connection opened, closed, refused and timed out (the metrics)."""
    open: int = field(default=0, init=False)
    """Connections served now (refused ones not counted)."""

    @classmethod
    def of(cls, server: ServerConfig, observe: Callable[[ConnectionEvent], None] = _ignore) -> Connections:
        return cls(server.header_timeout_s, server.body_timeout_s, server.idle_timeout_s, server.max_connections,
                   observe)

    def fit_fd_limit(self) -> None:
        """Raise this process's open-file limit to hold `max_connections` (up to the hard
        limit); when it cannot, lower `max_connections` to what it holds, and say so."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.max_connections + FD_HEADROOM
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft < want:
                fit = max(1, soft - FD_HEADROOM)
                log.warning("server.max_connections %d does not fit this process's open-file limit (%d): serving "
                            "at most %d connections", self.max_connections, soft, fit)
                self.max_connections = fit


class BodyTimedOut(asyncio.TimeoutError):
    """Set on a request's body that did not arrive within `body_timeout_s` of its head.

    A TimeoutError, so aiohttp's lingering read after the answer takes it as a cue to close."""


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering parser errors in the OpenAI error shape,
    telling the request in progress when its client's connection is lost (`leaving`), and
    bounding slow and idle clients (`Connections`, see the module docstring)."""

    def __init__(self, manager: web.Server, *, connections: Connections | None = None, **kwargs: Any) -> None:
        if connections is not None:
            kwargs["keepalive_timeout"] = connections.idle_timeout_s
        super().__init__(manager, **kwargs)
        self._bounds = connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._receiving: StreamReader | None = None  # the body arriving now
        self._counted = False
        self._head_bytes = 0  # bytes of the head waited for (0: nothing sent yet)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        bounds = self._bounds
        if bounds is None:
            super().connection_made(transport)
            return
        head_s = bounds.header_timeout_s
        if bounds.open >= bounds.max_connections:
            self._request_handler = _refuse  # read its first request, answer 503, close
            head_s = min(head_s, REFUSED_HEAD_S)
            bounds.observe("refused")
        else:
            bounds.open += 1
            self._counted = True
            bounds.observe("opened")
        super().connection_made(transport)
        self._head_timer = self._loop.call_later(head_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        bounds = self._bounds
        if bounds is None:
            super().data_received(data)
            return
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:  # a head is complete
            self._head_bytes = 0
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            payload = self._messages[-1][1] if self._messages else EMPTY_PAYLOAD
            if payload is not EMPTY_PAYLOAD and not payload.is_eof():  # its body comes later
                self._receiving = payload
                if self._body_timer is not None:
                    self._body_timer.cancel()
                self._body_timer = self._loop.call_later(bounds.body_timeout_s, self._body_late, payload)
            return
        receiving = self._receiving
        if receiving is not None and not receiving.is_eof():
            return  # bytes of a body
        self._receiving = None
        if data and not self._force_close:  # bytes of a head not complete yet
            self._head_bytes += len(data)
            if self._head_timer is None:
                self._head_timer = self._loop.call_later(bounds.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self._force_close or self.transport is None:
            return
        bounds = self._bounds
        assert bounds is not None
        if self._waiter is None or self._messages:  # a request is being served: heads wait their turn
            self._head_timer = self._loop.call_later(bounds.header_timeout_s, self._head_late)
            return
        if self._head_bytes:
            bounds.observe("header_timeout")
            error = RequestTimeout(f"the request's head (request line and headers) did not arrive within "
                                   f"{bounds.header_timeout_s:g} s (server.header_timeout_s)", "header_timeout")
            self.transport.write(_raw(error))
        self.force_close()

    def _body_late(self, payload: StreamReader) -> None:
        self._body_timer = None
        if payload.is_eof():
            return
        bounds = self._bounds
        assert bounds is not None
        bounds.observe("body_timeout")
        payload.set_exception(BodyTimedOut(f"the request's body did not arrive within {bounds.body_timeout_s:g} s "
                                           "of its head (server.body_timeout_s)"))

    @property
    def handling(self) -> bool:
        """A request of this connection is being answered."""
        return self._current_request is not None

    @property
    def path(self) -> str:
        """The path of the request being answered ("" when none is)."""
        return self._current_request.path if self._current_request is not None else ""

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        self._receiving = None
        if self._counted and self._bounds is not None:
            self._counted = False
            self._bounds.open -= 1
            self._bounds.observe("closed")
        request = self._current_request
        super().connection_lost(exc)
        if request is not None:
            client_left(request)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of an answer went out already: nothing to replace it with
            raise ConnectionError("response already started, cannot send the error")
        error = parser_error(status, exc)
        if error.status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            log.info("refused a request from %s: %s", request.remote, error.message)
        response = error.response()
        response.force_close()
        return response


async def _refuse(request: BaseRequest) -> web.StreamResponse:
    response = Overloaded("this gateway process holds as many connections as it may (server.max_connections); "
                          "retry in a moment").response()
    response.force_close()
    return response


_REASONS = {408: "Request Timeout"}


def _raw(error: ApiError) -> bytes:
    """`error` as a whole HTTP/1.1 answer that closes the connection (written outside a request)."""
    body = orjson.dumps(error.body())
    return (f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors with `JsonErrorHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same class plus one method (no state of its own): the server aiohttp configured
        # (request factory, handler, limits) is kept as it is.
        server.__class__ = _JsonErrorServer
        return server


async def _serve(app: web.Application, sockets: Sequence[socket.socket],
                 ready: Callable[[], None] | None, access: type[AbstractAccessLogger] | None,
                 stopped: Callable[[int], None] | None, connections: Connections | None,
                 on_drain: Callable[[], None] | None, drain_delay_s: float) -> None:
    extra: dict[str, Any] = {} if connections is None else {"connections": connections}
    if access is not None:
        extra |= {"access_log": logging.getLogger("gateway.access"), "access_log_class": access}
    runner = GatewayRunner(app, handle_signals=True, **({"access_log": None} | extra))
    serving = False
    try:
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        serving = True
        if ready is not None:
            ready()
        while True:
            await asyncio.sleep(3600)
    finally:
        if on_drain is not None:  # before the listener closes: readiness fails first
            on_drain()
            if drain_delay_s > 0 and serving:
                await _keep_serving(drain_delay_s)
        busy = in_flight(runner)
        started = time.monotonic()
        await runner.cleanup()
        if serving and stopped is not None:
            stopped(busy)
        elif serving:
            print(f"gateway: stopped (pid {os.getpid()}) in {time.monotonic() - started:.1f} s, having drained "
                  f"{busy} request{'' if busy == 1 else 's'} in flight", file=sys.stderr, flush=True)


async def _keep_serving(seconds: float) -> None:
    """Serve on for `seconds` (`server.shutdown_delay_s`), whatever cancels the task meanwhile:
    the load balancer's probes see the process not ready, and calls still arriving are answered."""
    waiting = asyncio.ensure_future(asyncio.sleep(seconds))
    while not waiting.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(waiting)


def in_flight(runner: web.AppRunner) -> int:
    """Requests being answered by the runner's connections now (not those of the scripted
    upstream's mount: it answers the gateway's own calls, already counted)."""
    server = runner.server
    if server is None:
        return 0
    return sum(1 for c in server.connections if isinstance(c, JsonErrorHandler) and c.handling
               and not c.path.startswith(SCRIPTED_PREFIX))


def new_loop(kind: LoopKind = "auto") -> asyncio.AbstractEventLoop:
    """uvloop's event loop when asked for or (`auto`) when installed (extra `fast`), else asyncio's."""
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise SystemExit("gateway: --loop uvloop needs uvloop installed (pip install 'gateway[fast]')") from None
        else:
            new: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return new
    return asyncio.new_event_loop()


def run(app: web.Application, sockets: Sequence[socket.socket], *, ready: Callable[[], None] | None = None,
        loop: LoopKind = "auto", access: type[AbstractAccessLogger] | None = None,
        stopped: Callable[[int], None] | None = None,
        connections: Connections | None = None, on_drain: Callable[[], None] | None = None,
        drain_delay_s: float = 0.0) -> None:
    """Serve `app` on `sockets` (`listen_sockets`) until SIGINT or SIGTERM, then shut it down
    like `web.run_app`; `ready` is called once it serves, `stopped` once it stopped serving,
    with the number of requests it drained (None: the stop line is printed); `access` is the
    access logger's class (None: no access log); `connections` bounds slow and idle clients
    (None: aiohttp's own); `on_drain` is called first thing on the way down, and the process
    serves on `drain_delay_s` more before its listener closes. A `StartError` raised while
    the app starts (its cleanup contexts: another listener's port) comes out of here as it
    was."""
    if connections is not None:
        connections.fit_fd_limit()
    loop_ = new_loop(loop)
    asyncio.set_event_loop(loop_)
    main = loop_.create_task(_serve(app, sockets, ready, access, stopped, connections, on_drain, drain_delay_s))
    try:
        loop_.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop_.run_until_complete(main)
            pending = asyncio.all_tasks(loop_)
            for task in pending:
                task.cancel()
            loop_.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop_.run_until_complete(loop_.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop_.close()
