"""One client session per MCP server per gateway process, on a thread of its own.

The sessions live on a private event loop in a daemon thread, started at first use.
That lets policy loading (synchronous: startup, SIGHUP, `gateway policy check`) discover
tools with `discover()`, while runs on the gateway's loop call tools with `await call()`;
both go through the same session. A session starts at its first use and stays up; when
its server dies, the calls in flight fail with a sentence saying so, and the next use
starts it again, no sooner than a backoff that doubles with each failure in a row.
`close()` (the app's cleanup context) stops every server.

Cancelling `call()` (a Stop, a timeout) returns at once; the session's task is cancelled
on the private loop, which sends the MCP `notifications/cancelled` (or, on the 2026
streamable HTTP wire, aborts the request) to the server.

Trace context: a call runs on the hub's loop in a copy of its caller's context (as
`run_coroutine_threadsafe` does), so the SDK puts the caller's span in the request's
`_meta.traceparent` (SEP-414); with `propagate` (tracing on), each HTTP request to a server
over streamable HTTP also carries it as its `traceparent` header.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from gateway.mcp.config import McpServerConfig, McpToolInfo
from gateway.mcp.content import flatten

if TYPE_CHECKING:
    from mcp import Client

# The MCP SDK is imported where a session starts or fails, not at module load: importing it
# takes most of a second, which every gateway start and every CLI call would otherwise pay,
# with or without an MCP server in its policies.

log = logging.getLogger(__name__)

T = TypeVar("T")
State = Literal["idle", "starting", "up", "down", "stopped"]
Propagate = Callable[[MutableMapping[str, str]], None]
"""Adds the current trace context to outgoing headers (`traceparent`)."""

START_TIMEOUT_S = 30.0
"""How long a server may take to start and answer the handshake."""
DISCOVER_TIMEOUT_S = 30.0
"""How long `tools/list` (all pages) may take at policy load."""
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 10.0
MAX_TOOLS = 1000
"""More tools than this on one server is refused: a model cannot use them, and a server
that lists them without end must not hang a policy load."""
MAX_PROGRESS_LABEL = 200
CLIENT_NAME, CLIENT_VERSION = "gateway", "0.1.0"

class McpUnavailable(Exception):
    """The server could not be reached, or died during the call (the message says which)."""

@dataclass(frozen=True)
class CallResult:
    """A `tools/call` answer: the text the model reads, and whether the server flagged an error."""

    text: str
    is_error: bool = False

@dataclass(frozen=True)
class ServerHealth:
    """How one server's session is doing (for `gateway policy check` and the metrics)."""

    name: str
    where: str
    transport: str
    state: State
    starts: int
    failures: int
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.state == "up"

def _reason(exc: BaseException) -> str:
    """A short sentence for an exception (the first leaf of a group), never a traceback."""
    from mcp.shared.exceptions import MCPError

    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        return exc.message
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text[:300] or "no reason given"

def find_program(command: str, path: str | None = None) -> str:
    """Where a stdio server's program is: a command with a `/` as written (relative to the
    server's `cwd`); a bare name on `path` (the server's PATH: its `env`'s, else the
    gateway's), then next to the gateway's own interpreter (`sys.executable`'s folder,
    where pip put the servers installed with the gateway, e.g. a venv's `bin`, which a
    gateway started as `.venv/bin/gateway` does not have on its PATH)."""
    if os.sep in command or (os.altsep and os.altsep in command):
        return command
    search = path if path is not None else os.environ.get("PATH", os.defpath)
    found = shutil.which(command, path=search)
    if found is not None:
        return found
    beside = os.path.dirname(sys.executable)  # not resolved: a venv's python is a link out of the venv
    found = shutil.which(command, path=beside) if beside else None
    if found is not None:
        return found
    raise McpUnavailable(f"program '{command}' not found: looked on PATH ({search or 'empty'}) and next to the "
                         f"gateway's interpreter ({beside or 'unknown'})")


def _closed(client: Client) -> bool:
    """Whether the session's transport has already closed (its server died while idle).

    The SDK has no public flag for this; its dispatcher keeps one. Without it, the next call
    would fail once before the restart instead of starting the server again first."""
    dispatcher = getattr(client.session, "_dispatcher", None)
    return bool(getattr(dispatcher, "_closed", False))

def _progress_label(progress: float, total: float | None, message: str | None) -> str:
    if message:
        label = message
    elif total:
        label = f"{progress:g}/{total:g}"
    else:
        label = f"{progress:g}"
    return " ".join(label.split())[:MAX_PROGRESS_LABEL]  # one line: it may end up in an SSE comment


class _Connection:
    """The session of one server, on the hub's loop."""

    def __init__(self, config: McpServerConfig, changed: Callable[[], None], propagate: Propagate | None) -> None:
        self.config = config
        self._changed = changed
        self._propagate = propagate  # the hub's watchers: health moved (up, down, stopped, a start)
        self.state: State = "idle"
        self.error: str | None = None
        self.starts = 0
        self.failures = 0
        self._in_a_row = 0
        self._retry_at = 0.0
        self._client: Client | None = None
        self._stop: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def health(self) -> ServerHealth:
        c = self.config
        return ServerHealth(c.name, c.where, c.transport, self.state, self.starts, self.failures, self.error)

    async def client(self) -> Client:
        """The live session, started (again) if need be."""
        async with self._lock:
            if self._client is not None and _closed(self._client):
                self._died("its connection closed", self._client)
            if self._client is not None:
                return self._client
            if self.state == "stopped":
                raise McpUnavailable(f"the MCP server '{self.config.name}' is stopped (the gateway is shutting down)")
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            return await self._start()

    async def _start(self) -> Client:
        self.state = "starting"
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        self._stop = stop
        self._runner = asyncio.ensure_future(self._run(ready, stop))
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                return await asyncio.shield(ready)
        except TimeoutError:
            stop.set()
            self._failed(f"it did not answer the handshake within {START_TIMEOUT_S:g} s")
        except McpUnavailable as exc:
            self._failed(str(exc))
        raise McpUnavailable(f"the MCP server '{self.config.name}' could not be started: {self.error}")

    async def _run(self, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Own the session for its whole life: the SDK's transports must be entered and left
        by the same task."""
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client  # the SDK's own defaults (timeouts)
        from mcp_types import Implementation

        c = self.config
        try:
            async with contextlib.AsyncExitStack() as stack:
                if c.url is not None:
                    http = await stack.enter_async_context(create_mcp_http_client(headers=c.headers()))
                    propagate = self._propagate
                    if propagate is not None:  # sent in the context of the call that sends (the SDK keeps it)
                        async def traced(request: Any) -> None:
                            propagate(request.headers)

                        http.event_hooks["request"].append(traced)
                    target: Any = streamable_http_client(c.url, http_client=http)
                else:
                    target = StdioServerParameters(command=find_program(c.command[0], dict(c.env).get("PATH")),
                                                   args=list(c.command[1:]), env=dict(c.env) or None, cwd=c.cwd)
                client = await stack.enter_async_context(Client(target, cache=None, client_info=Implementation(name=CLIENT_NAME, version=CLIENT_VERSION)))
                self._client = client
                self.state, self.error = "up", None
                self.starts += 1
                self._changed()
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except Exception as exc:
            if not ready.done():  # our own sentences whole (a program not found names where it looked)
                ready.set_exception(exc if isinstance(exc, McpUnavailable) else McpUnavailable(_reason(exc)))
            else:
                log.warning("MCP server '%s' session ended: %s", c.name, _reason(exc))
        finally:
            if self._stop is stop:
                self._client = None
                if self.state == "up":  # the session ended by itself (its transport failed while idle)
                    self._failed("its session ended")

    def _failed(self, reason: str) -> None:
        self._client = None
        self.state, self.error = "down", reason
        self.failures += 1
        self._in_a_row += 1
        self._retry_at = time.monotonic() + min(BACKOFF_FIRST_S * 2 ** (self._in_a_row - 1), BACKOFF_MAX_S)
        self._changed()

    def _died(self, reason: str, client: Client) -> None:
        """The server of `client` went away: tear its session down; the next use starts it
        again. A failure seen late, on a session already replaced, changes nothing."""
        if client is not self._client:
            return
        if self._stop is not None:
            self._stop.set()
        if self.state == "up":
            log.warning("MCP server '%s' died (%s); it is restarted at its next use", self.config.name, reason)
            self._failed(f"it died ({reason})")

    async def list_tools(self) -> list[McpToolInfo]:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        client = await self.client()
        tools: list[McpToolInfo] = []
        cursor: str | None = None
        try:
            while True:
                page = await client.list_tools(cursor=cursor)
                for t in page.tools:
                    a = t.annotations
                    tools.append(McpToolInfo(
                        name=t.name, description=t.description or t.title or "", input_schema=dict(t.input_schema),
                        read_only_hint=a.read_only_hint if a is not None else None,
                        destructive_hint=a.destructive_hint if a is not None else None))
                if len(tools) > MAX_TOOLS:
                    raise McpUnavailable(f"the MCP server '{self.config.name}' lists more than {MAX_TOOLS} tools")
                cursor = page.next_cursor
                if not cursor:
                    return tools
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                self._died(exc.message, client)
            raise McpUnavailable(f"the MCP server '{self.config.name}' did not list its tools: {exc.message}") from None

    async def call(self, named: McpServerConfig, tool: str, args: Mapping[str, Any],
                   on_progress: Callable[[str], None]) -> CallResult:
        """`tools/call`; `named` is the caller's entry for this server (its name and result cap:
        policies sharing the session may name and cap it differently)."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        client = await self.client()

        async def report(progress: float, total: float | None, message: str | None) -> None:
            on_progress(_progress_label(progress, total, message))

        try:
            result = await client.call_tool(tool, dict(args), progress_callback=report)
        except MCPError as exc:
            if exc.code != CONNECTION_CLOSED:  # the server refused the call: the model may fix it
                return CallResult(f"the MCP server refused the call: {exc.message}", is_error=True)
            self._died(exc.message, client)
            raise McpUnavailable(f"the MCP server '{named.name}' stopped while running {tool}; "
                                 f"the call's outcome is unknown. The server is restarted for the next call.") from None
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the transport failed (a refused connection, a broken pipe)
            self._died(_reason(exc), client)
            raise McpUnavailable(f"the MCP server '{named.name}' could not run {tool}: {_reason(exc)}") from None
        self._in_a_row = 0
        return CallResult(flatten(result.content, result.structured_content, named.max_result_chars),
                          is_error=bool(result.is_error))

    async def probe(self, timeout_s: float) -> None:
        """Is the server there now: `ping` a live session (one that does not answer in time is
        torn down), or start a session that is down (within its backoff). Never raises."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        client = self._client
        try:
            async with asyncio.timeout(timeout_s):
                if client is None or _closed(client):
                    if self.state != "stopped":
                        await self.client()
                    return
                await client.send_ping()
        except (McpUnavailable, TimeoutError):
            if client is not None and self._client is client:
                self._died("it did not answer a ping", client)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED and client is not None:
                self._died(exc.message, client)
            # any other answer (a server without `ping`: "method not found") is an answer: it is there
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the transport failed (a refused connection)
            if client is not None:
                self._died(_reason(exc), client)

    async def stop(self) -> None:
        self.state = "stopped"
        self._changed()
        if self._stop is not None:
            self._stop.set()
        if self._runner is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._runner, timeout=10)

class McpHub:
    """The MCP sessions of one gateway process (servers with the same transport settings
    share one session, whichever policies name them)."""

    def __init__(self, propagate: Propagate | None = None) -> None:
        """`propagate`: adds the calling span's `traceparent` to HTTP servers' requests (tracing on)."""
        self._propagate = propagate
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._connections: dict[tuple[Any, ...], _Connection] = {}
        self._closed = False
        self._watchers: list[Callable[[], None]] = []

    def watch(self, changed: Callable[[], None]) -> None:
        """Call `changed()` whenever a server's health moves or a server is first asked
        about (from the hub's thread or the asker's, never holding the hub's lock: it may
        read `health()`)."""
        self._watchers.append(changed)

    def _changed(self) -> None:
        for changed in self._watchers:
            try:
                changed()
            except Exception:  # a watcher's failure must not take a session down
                log.exception("an MCP health watcher failed")

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._guard:
            if self._closed:
                raise McpUnavailable("the gateway is shutting down; MCP servers are stopped")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="mcp-hub", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _connection(self, config: McpServerConfig) -> _Connection:
        with self._guard:
            conn = self._connections.get(config.key)
            if conn is not None:
                return conn
            conn = self._connections[config.key] = _Connection(config, self._changed, self._propagate)
        self._changed()
        return conn

    def _submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._ensure_loop())

    def start_soon(self, config: McpServerConfig) -> None:
        """Start the server's session in the background (a later `discover` finds it ready):
        a policy load starts all its servers at once instead of one after the other."""
        future = self._submit(self._connection(config).client())
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # the error is in its health

    def discover(self, config: McpServerConfig, timeout_s: float = DISCOVER_TIMEOUT_S) -> list[McpToolInfo]:
        """The server's tools (`tools/list`, every page), starting its session if need be.

        Blocks; never call it from the hub's own thread. Raises `McpUnavailable`."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("McpHub.discover blocks: it cannot run on the hub's own loop")
        future = self._submit(self._connection(config).list_tools())
        try:
            return future.result(START_TIMEOUT_S + timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise McpUnavailable(f"the MCP server '{config.name}' did not list its tools within "
                                 f"{START_TIMEOUT_S + timeout_s:g} s") from None

    async def call(self, config: McpServerConfig, tool: str, args: Mapping[str, Any],
                   progress: Callable[[str], None] = lambda label: None) -> CallResult:
        """`tools/call` on the server, from any event loop; `progress` is called on the caller's loop.

        Cancelling it returns at once and cancels the call on the server."""
        caller = asyncio.get_running_loop()

        def on_progress(label: str) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                caller.call_soon_threadsafe(progress, label)

        future = self._submit(self._connection(config).call(config, tool, args, on_progress))
        return await asyncio.wrap_future(future)

    async def probe(self, config: McpServerConfig, timeout_s: float = 1.0) -> ServerHealth:
        """The server's health after asking it now (`ping`, or a start if it is down), from any event loop."""
        conn = self._connection(config)
        await asyncio.wrap_future(self._submit(conn.probe(timeout_s)))
        return conn.health()

    def health(self) -> list[ServerHealth]:
        """Every server this process has been asked about, in the order it was first asked."""
        with self._guard:
            return [c.health() for c in self._connections.values()]

    def health_of(self, config: McpServerConfig) -> ServerHealth:
        return self._connection(config).health()

    async def aclose(self) -> None:
        """`close()` from an event loop (without blocking it)."""
        await asyncio.to_thread(self.close)

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop every server and the hub's thread; later uses fail with `McpUnavailable`."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            connections = list(self._connections.values())
        if loop is None or thread is None:
            return

        async def stop_all() -> None:
            await asyncio.gather(*(c.stop() for c in connections), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("MCP servers did not all stop in time: %s", _reason(exc))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
