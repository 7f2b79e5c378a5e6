"""The typed keys under which the app keeps its resources, and the per-request keys.

Handlers reach everything through `request.app[KEY]` (no module globals). Resources that
need the event loop (store, HTTP session, governor, upstreams) are set by the app's
`cleanup_ctx` at startup and closed at shutdown.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Final

import aiohttp
from aiohttp import web

from gateway.config.settings import SCRIPTED_PREFIX, Config, ModelRoute, UpstreamConfig
from gateway.harness.state import RunState
from gateway.mcp.hub import McpHub
from gateway.policy.registry import PolicyRegistry
from gateway.providers.discovery import TIMEOUT_S as DISCOVERY_TIMEOUT_S
from gateway.providers.discovery import ModelDiscovery
from gateway.providers.failover import AttemptSink, RoutedCall
from gateway.providers.routing import Router
from gateway.providers.transport import Sessions
from gateway.providers.upstream import Upstream
from gateway.server.http.auth import KeyRing
from gateway.server.http.readiness import Readiness
from gateway.server.metrics import Metrics
from gateway.server.runs.driver import RunDriver
from gateway.server.runs.fair_share import FairShare, Share
from gateway.server.runs.governor import Governor
from gateway.server.runs.run_cache import RunCache
from gateway.store.base import Store
from gateway.store.health import Condition
from gateway.store.spool import Spool
from gateway.tokens import TokenCounter

if TYPE_CHECKING:  # the `otel` extra may not be installed: imported only when tracing is on
    from gateway.telemetry.tracing import ChatSpan, Tracing  # noqa: F401  (named in string annotations)

"""What serves a call whose policy runs the loop server-side (gateway.server.chat.server_side)."""


def uses_mount(upstream: UpstreamConfig) -> bool:
    """A `scripted` upstream without a `base_url` is this process's own /scripted/v1 mount
    (one with a `base_url` is a scripted provider elsewhere, which never gets our secret)."""
    return upstream.kind == "scripted" and upstream.base_url is None


class Live:
    """The config this process serves now. A reload (`gateway.server.reload`) replaces
    `config` whole, in one step on the event loop; a call keeps the objects it read from it
    (its team, its route), so it finishes under the config it started with."""

    __slots__ = ("config", "reloading")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reloading = asyncio.Lock()  # one reload at a time (a SIGHUP and an admin call may come together)


class Upstreams:
    """The configured upstreams by name, their sessions, their model lists and the router; a
    `scripted` one is this server's own mount, whose address is known once the server
    listens (set by `serve`, or learnt from the first request).

    Everything about reaching the upstreams is made here, from the config alone; a config
    reload gives it the new config (`configure`)."""

    def __init__(self, config: Config, session: aiohttp.ClientSession, scripted_key: str | None = None,
                 tracing: Tracing | None = None) -> None:
        """`session`: the app's shared session (its owner closes it), used by every upstream
        without `tls` or a proxy; `scripted_key`: what this process's calls to its own
        scripted mount authenticate with; `tracing`: each attempt a span, its `traceparent`
        sent. A TLS file that cannot be used is a ConfigError."""
        self.self_url: str | None = None
        self._scripted_key = scripted_key
        self.sessions = Sessions(session)
        self.tracing = tracing
        self._propagate = tracing.inject if tracing is not None else None
        self._by_name: dict[str, Upstream] = {}
        self.router = Router()  # every deployment's health in this process (cooldowns, calls in flight)
        self.discovery = ModelDiscovery(self._list_models)
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Serve `config`'s upstreams (at start, and on a config reload, `gateway.server.reload`).
        An upstream whose settings did not change keeps its object (its session, what its model
        list said); calls already routed keep the upstreams they started with, so the session
        of a changed or removed one (with `tls` or a proxy) is closed once its last call ended;
        the health of deployments no route names any more is forgotten. A TLS file that cannot
        be used is a ConfigError (nothing changed)."""
        old = self._by_name
        by_name: dict[str, Upstream] = {}
        for name, u in config.upstreams.items():
            if name in old and old[name].config == u:
                by_name[name] = old[name]
                continue
            way = self.sessions.for_upstream(u)
            by_name[name] = Upstream(u, way.session, self._scripted_base,
                                     self._scripted_key if uses_mount(u) else None, way.proxy, way.proxy_headers,
                                     self._propagate)
        self._by_name = by_name
        gone = [up for name, up in old.items() if by_name.get(name) is not up]
        for up in gone:
            up.retire(functools.partial(self.sessions.retire, up.session))
        self.discovery.forget(up.name for up in gone)
        self.router.keep({d for route in config.models for g in route.plan.groups for d in g.deployments})

    async def _list_models(self, name: str) -> list[str]:
        upstream = self._by_name[name]
        return await upstream.list_models(min(DISCOVERY_TIMEOUT_S, upstream.config.timeout_s))

    async def close(self) -> None:
        """Close what this set of upstreams opened (not the shared session)."""
        await self.discovery.close()
        await self.sessions.close()

    def _scripted_base(self) -> str | None:
        return self.self_url + SCRIPTED_PREFIX if self.self_url else None

    def __getitem__(self, name: str) -> Upstream:
        return self._by_name[name]

    def call(self, route: ModelRoute, model: str, on_attempt: AttemptSink) -> RoutedCall:
        """One call of `model` over `route`'s deployments and fallbacks (`gateway.providers.failover`),
        to the upstreams served now (a reload meanwhile does not change them under it)."""
        return RoutedCall(route.plan, model, self.router, self._by_name.__getitem__, on_attempt,
                          route=route.match if route.is_glob else None, tracer=self.tracing)

    def learn_self_url(self, request: web.Request) -> None:
        """Take this server's address from the socket a request arrived on."""
        if self.self_url is not None or request.transport is None:
            return
        sock = request.transport.get_extra_info("sockname")
        if not sock:
            return
        host, port = str(sock[0]), int(sock[1])
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        self.self_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


LIVE: Final = web.AppKey("live", Live)
"""The config served now (`Live.config`): read it where a call starts, never keep it across calls."""
POLICIES: Final = web.AppKey("policies", PolicyRegistry)
METRICS: Final = web.AppKey("metrics", Metrics)
COUNTER: Final = web.AppKey("counter", TokenCounter)
KEYRING: Final = web.AppKey("keyring", KeyRing)
STORE: Final = web.AppKey[Store]("store")
SESSION: Final = web.AppKey("session", aiohttp.ClientSession)
GOVERNOR: Final = web.AppKey("governor", Governor)
UPSTREAMS: Final = web.AppKey("upstreams", Upstreams)
DRIVER: Final = web.AppKey("driver", RunDriver)
SELF_URL: Final = web.AppKey("self_url", str)
WORKER: Final = web.AppKey("worker", int)
"""This process's index among `gateway serve --workers N`'s; absent when it serves alone."""
SPOOL: Final = web.AppKey("spool", Spool)
STORE_HEALTH: Final = web.AppKey("store_health", Condition)
"""Whether the store takes this process's writes: failing from the first that fails (logged
once), ok from the first that succeeds (`runs.booking`)."""
FAIR_SHARE: Final = web.AppKey("fair_share", FairShare)
"""Slots of the process's own work (admissions, bookings), shared fairly between teams
(`runs.fair_share`)."""
READINESS: Final = web.AppKey("readiness", Readiness)
"""The named checks of GET /readyz (`gateway.server.http.readiness`, `gateway.server.probes`)."""
RUN_CACHE: Final = web.AppKey("run_cache", RunCache)
"""The runs this process booked last, parsed (`runs.run_cache`): a call of one skips its load."""
MCP: Final = web.AppKey("mcp", McpHub)
"""The process's MCP sessions: one per server, shared by every policy version that names it."""
SCRIPTED_KEY: Final = web.AppKey("scripted_key", str)
"""A random secret made at start: the key of the gateway's own calls to its scripted mount."""
TRACING: Final = web.AppKey["Tracing"]("tracing")
"""The process's OpenTelemetry tracing (`gateway.telemetry.tracing`); absent while `telemetry` is off."""

# Per request: the run as last known (error responses carry its headers) and the time
# spent waiting on the upstream (the overhead metric subtracts it).
RUN: Final = web.RequestKey("run", RunState)
SHARE: Final = web.RequestKey("share", Share)
"""A pass-through call's hold on its team's share of the process's own work (`runs.fair_share`)."""
UPSTREAM_SECONDS: Final = web.RequestKey("upstream_seconds", float)
# What the access log and the traces learn of a request on its way (`telemetry`).
CHAT_SPAN: Final = web.RequestKey["ChatSpan"]("chat_span")
"""A pass-through call's `chat {model}` span (tracing on): booking records the turn on it."""
TRACE_ID: Final = web.RequestKey("trace_id", str)
"""The trace id of the request's span (tracing on, sampled)."""
MODEL: Final = web.RequestKey("model", str)
"""The model a chat, Responses or embeddings call asked for."""
ERROR_CODE: Final = web.RequestKey("error_code", str)
"""The `error.code` the request was answered with, if it failed."""

