"""`build_app(config)`: the gateway as an aiohttp application.

Routes: POST /v1/chat/completions, GET /v1/models and /v1/models/{model}, GET /metrics (`metrics_route`: maybe
with a token, maybe on its own address), GET /livez, /readyz and /healthz (`probes`), the web console under /console/ (`console.setup`), the scripted provider at
/scripted/v1 (only when a `kind: scripted` upstream without `base_url` uses this mount,
and only for callers with a gateway key: a team's, or the random one this process makes
at start for its own upstream calls), plus what the optional modules add:
`gateway.server.chat.server_side.setup(app)` (server-side runs: sets `app[HARNESS]`, adds
the runs API; `gateway.server.responses.endpoint`: the Responses API). Resources that live on the event
loop (HTTP session, governor, upstreams) come with `cleanup_ctx`; the store is opened
when the app is built (so a bad `store:` section fails before listening) and closed by it,
its calls timed (`gateway_store_seconds`). With `telemetry` on, the app has its `Tracing`
(`ctx.TRACING`) and the tracing middleware outside the gateway's own; without it, neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.config.settings import SCRIPTED_PREFIX, Config, ConfigError, ConfigErrors
from gateway.config.upstreams import require_upstreams
from gateway.config.webhooks import require_secrets
from gateway.mcp.hub import McpHub
from gateway.policy.errors import PolicySetError
from gateway.policy.registry import PolicyRegistry
from gateway.providers.scripted import scripted_app
from gateway.providers.transport import new_session
from gateway.server import console, embeddings, mcp_servers, openapi, probes, process_health, reload_watch
from gateway.server.models import get_model, list_models
from gateway.server import context as ctx
from gateway.server.api import admin
from gateway.server.api import keys as admin_keys
from gateway.server.api import spend
from gateway.server.api import metrics as metrics_route
from gateway.server.api import runs as runs_api
from gateway.server.chat import endpoint as chat
from gateway.server.http.auth import SYNC_S, KeyRing
from gateway.server.http.middleware import gateway_middleware
from gateway.server.http.readiness import Readiness
from gateway.server.http.sse import STREAMS_END, end_streams
from gateway.server.metrics import Metrics
from gateway.server.notify import delivery as notify_delivery
from gateway.server.reload import configure_metrics, team_check
from gateway.server.responses import endpoint as responses
from gateway.server.runs import rate_limits, retention, runtime
from gateway.server.runs.booking import keep_booking
from gateway.server.runs.fair_share import FairShare
from gateway.server.runs.governor import Governor
from gateway.server.runs.run_cache import RunCache
from gateway.server.store_check import check_store
from gateway.store import Store, StoreConfigError, StoreError, open_store
from gateway.store.health import Condition
from gateway.store.timed import timed
from gateway.store.spool import Spool
from gateway.tokens import get_counter

if TYPE_CHECKING:
    from gateway.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

def load_policies(config: Config, mcp: McpHub | None = None) -> PolicyRegistry:
    """Load `policies_dir` (MCP tools discovered through `mcp`) and check every team's
    policies exist (the rule a reload checks too: `reload.team_check`); ConfigError otherwise."""
    if not config.policies_dir.is_dir():
        problem = "is not a folder" if config.policies_dir.exists() else "does not exist"
        raise ConfigError(str(config.path), "policies_dir", f"{config.policies_dir} {problem}")
    registry = PolicyRegistry(config.policies_dir, mcp)
    staged = registry.stage()
    if staged.errors:
        raise ConfigError(str(config.path), "policies_dir", f"{config.policies_dir}: {PolicySetError(staged.errors)}")
    missing = [ConfigError(str(config.path), e.field, e.problem) for e in team_check(config)(staged.policies)]
    if missing:
        raise ConfigErrors(missing)
    registry.commit(staged)
    return registry


def open_configured_store(config: Config) -> Store:
    """The config's store, opened; ConfigError (one line naming `store`) when it cannot be."""
    try:
        return open_store(config.store.options)
    except StoreConfigError as exc:  # its message starts with the field (store.url: ...)
        raise ConfigError(str(config.path), "", str(exc)) from None
    except StoreError as exc:
        raise ConfigError(str(config.path), "store", str(exc)) from None


async def _resources(app: web.Application) -> AsyncIterator[None]:
    config = app[ctx.LIVE].config
    store = app[ctx.STORE]
    await check_store(store, config.store)  # before anything of it is used: a StartError ends the start
    session = new_session()
    app[ctx.SESSION] = session
    owner = process_owner(app.get(ctx.SELF_URL), app.get(ctx.WORKER))
    spool = app[ctx.SPOOL]
    spool.open()  # its reserve, before anything is admitted (admission waits for it: /readyz says so)
    governor = Governor(store, app[ctx.COUNTER], config.defaults, owner=owner, ttl_s=config.server.lease_ttl_s,
                        spool=spool)
    app[ctx.GOVERNOR] = governor
    upstreams = ctx.Upstreams(config, session, app.get(ctx.SCRIPTED_KEY), app.get(ctx.TRACING))
    upstreams.self_url = app.get(ctx.SELF_URL)
    app[ctx.UPSTREAMS] = upstreams
    try:
        await governor.start()
    except StoreError as exc:  # the store may be back later: its holds then expire on their own
        log.warning("cannot release this gateway's earlier reservations: %s", exc)
    keyring = app[ctx.KEYRING]
    try:
        await keyring.sync()  # every key the store has, before the first call
    except StoreError as exc:
        log.warning("cannot read the store's keys yet (retried every %.2f s): %s", SYNC_S, exc)
    keeper = asyncio.ensure_future(governor.keep_alive())
    giver = asyncio.ensure_future(governor.give_back_idle())
    replayer = asyncio.ensure_future(keep_booking(app))
    syncer = asyncio.ensure_future(keyring.keep_synced())
    toucher = asyncio.ensure_future(keyring.keep_touching())
    try:
        yield
    finally:
        await keyring.flush_used()
        for task in (keeper, giver, replayer, syncer, toucher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await governor.give_back(0.0)  # what it took ahead of calls it will not serve
        await app[ctx.UPSTREAMS].close()  # the sessions of upstreams with tls or a proxy
        await session.close()
        await store.close()


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    """The exporter's last spans are sent at shutdown (on a thread: it may wait for the collector)."""
    yield
    tracing = app.get(ctx.TRACING)
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)


def start_tracing(config: Config, worker: int | None) -> Tracing | None:
    """The process's tracing when `telemetry` is on (it needs the `otel` extra: a ConfigError
    naming `telemetry.otlp_endpoint` says so when it is not installed)."""
    if not config.telemetry.enabled:
        return None
    try:
        from gateway.telemetry.tracing import Tracing
    except ImportError as exc:
        raise ConfigError(str(config.path), "telemetry.otlp_endpoint",
                          f"tracing needs the OpenTelemetry packages ({exc.name} is not installed): "
                          "pip install 'gateway[otel]'") from None
    return Tracing.start(config.telemetry, worker)


def process_owner(self_url: str | None, worker: int | None = None) -> str:
    """Who holds this process's leases and reservations: the same name after a restart at
    the same address (and worker index, `--workers`), so it takes back its own at once;
    never shared by two live processes."""
    host = socket.gethostname()
    if not self_url:
        return f"{host}/pid{os.getpid()}-{os.urandom(4).hex()}"
    return f"{host}/{self_url}" if worker is None else f"{host}/{self_url}/worker{worker}"


def _scripted_guard(keyring: KeyRing, own_key: str) -> Middleware:
    """The scripted mount's key check: this process's own key, or any team's (401 otherwise)."""
    own = hashlib.sha256(own_key.encode()).digest()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(key.strip().encode()).digest(), own)):
            await keyring.authenticate(request)  # a team key, or 401 naming what is wrong
        return await handler(request)

    return guard


def build_app(config: Config, *, self_url: str | None = None, worker: int | None = None,
              scripted_key: str | None = None) -> web.Application:
    """The gateway app. `self_url` (e.g. http://127.0.0.1:8080) addresses the scripted
    mount; without it the address is learnt from the first request. `worker`: this
    process's index among `gateway serve --workers N`'s (None: the only process), which
    share one `scripted_key` (a call to the mount may land on any of them); else a random
    key of this process's own."""
    require_secrets(str(config.path), config.webhooks)  # before anything is opened
    require_upstreams(str(config.path), config.upstreams)
    tracing = start_tracing(config, worker)
    middlewares: list[Middleware] = [gateway_middleware]
    if tracing is not None:
        from gateway.server.http.tracing import tracing_middleware

        middlewares.insert(0, tracing_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app[ctx.LIVE] = ctx.Live(config)
    if tracing is not None:
        app[ctx.TRACING] = tracing
    app[ctx.MCP] = McpHub(propagate=tracing.inject if tracing is not None else None)
    try:
        app[ctx.POLICIES] = load_policies(config, app[ctx.MCP])
    except ConfigError:
        app[ctx.MCP].close()  # the servers discovery started
        raise
    app[ctx.COUNTER] = get_counter()
    app[ctx.METRICS] = Metrics()
    configure_metrics(app[ctx.METRICS], config, app[ctx.POLICIES])
    if tracing is not None:
        app[ctx.METRICS].trace_id = tracing.trace_id
    app[ctx.STORE] = timed(open_configured_store(config), app[ctx.METRICS].on_store)
    app[ctx.KEYRING] = KeyRing(config.teams, app[ctx.STORE])
    metrics = app[ctx.METRICS]
    readiness = app[ctx.READINESS] = Readiness(metrics.on_ready)
    app[ctx.STORE_HEALTH] = Condition("store", logging.getLogger("gateway.store"),
                                      lambda ok: readiness.set("store", ok))
    app[ctx.SPOOL] = Spool(config.spool_file, config.spool_reserve_bytes, lambda ok: readiness.set("spool", ok))
    probes.setup(app, readiness)
    app[ctx.RUN_CACHE] = RunCache()
    app[ctx.FAIR_SHARE] = FairShare(config.server.work_slots, metrics.on_work_wait)
    if self_url is not None:
        app[ctx.SELF_URL] = self_url.rstrip("/")
    if worker is not None:
        app[ctx.WORKER] = worker
    app.cleanup_ctx.append(_tracing)  # first in, last out: spans of the whole shutdown are sent
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(process_health.sample)
    app.cleanup_ctx.append(notify_delivery.background)  # before runs are driven: their notices need its rule
    app.cleanup_ctx.append(runtime.driver_ctx)
    app.cleanup_ctx.append(retention.background)
    reload_watch.setup(app)  # another replica's reload reloads this process too
    app[STREAMS_END] = asyncio.Event()
    app.on_shutdown.append(end_streams)
    app.on_shutdown.append(runtime.stop_runs)
    app.on_response_prepare.append(rate_limits.show)  # answers carry their x-ratelimit-* headers (keys may have limits)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    metrics_route.setup(app)
    console.setup(app)
    mcp_servers.setup(app)
    if any(ctx.uses_mount(u) for u in config.upstreams.values()):
        app[ctx.SCRIPTED_KEY] = scripted_key or secrets.token_urlsafe(32)
        app.add_subapp(SCRIPTED_PREFIX, scripted_app(guard=_scripted_guard(app[ctx.KEYRING], app[ctx.SCRIPTED_KEY])))
    return app




ROUTES: Final[tuple[tuple[str, str, Handler], ...]] = (
    ("POST", "/v1/chat/completions", chat.chat_completions),
    ("POST", "/v1/responses", responses.create_response),
    ("GET", "/v1/responses/{id}", responses.get_response),
    ("DELETE", "/v1/responses/{id}", responses.delete_response),
    ("POST", "/v1/embeddings", embeddings.create_embeddings),
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model}", get_model),
    ("GET", "/v1/runs", runs_api.list_runs),
    ("GET", "/v1/runs/{id}", runs_api.get_run),
    ("GET", "/v1/runs/{id}/events", runs_api.run_events),
    ("POST", "/v1/runs/{id}/approvals", runs_api.post_approval),
    ("POST", "/v1/runs/{id}/resume", runs_api.post_resume),
    ("POST", "/v1/runs/{id}/cancel", runs_api.post_cancel),
    ("POST", admin.RELOAD_PATH, admin.post_reload),
    ("POST", "/v1/admin/keys", admin_keys.create_key),
    ("GET", "/v1/admin/keys", admin_keys.list_keys),
    ("GET", "/v1/admin/keys/{id}", admin_keys.get_key),
    ("PATCH", "/v1/admin/keys/{id}", admin_keys.update_key),
    ("DELETE", "/v1/admin/keys/{id}", admin_keys.revoke_key),
    ("POST", "/v1/admin/keys/{id}/rotate", admin_keys.rotate_key),
    ("GET", "/v1/admin/audit", spend.get_audit),
    ("GET", "/v1/spend", spend.get_spend),
    ("GET", "/livez", probes.livez),
    ("GET", "/readyz", probes.readyz),
    ("GET", "/healthz", probes.readyz),
    ("GET", "/openapi.json", openapi.openapi_json),
)
"""Every route of the gateway app (GET /metrics and the scripted mount are added beside them, see above)."""
