"""GET /metrics: what it answers, who may read it, and on which address.

By default /metrics is open on the gateway's own address, as a Prometheus target usually
is. The config's `metrics:` section can close it: `token_env` makes every scrape carry
`Authorization: Bearer <token>` (else 401 in the OpenAI shape), and `listen` moves it to
a second listener of the same process (e.g. an address only the monitoring network
reaches), so the main address, which clients reach, no longer serves it at all.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.server import context as ctx
from gateway.server.http.errors import ApiError, Unauthorized, from_http_exception
from gateway.server.http import request_headers
from gateway.server.http.listener import listen_sockets

METRICS_APP: web.AppKey[web.Application] = web.AppKey("metrics_main_app", web.Application)
"""In the separate listener's app: the gateway app whose metrics it serves."""


def setup(app: web.Application) -> None:
    """Serve /metrics on the main app, or on the config's `metrics.listen` address instead."""
    if app[ctx.LIVE].config.metrics.listen is None:
        app.router.add_get("/metrics", metrics)
    else:
        app.cleanup_ctx.append(_separate_listener)


def _authorize(app: web.Application, request: web.Request) -> None:
    config = app[ctx.LIVE].config.metrics
    if config.token is None:
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    want = hashlib.sha256(config.token.encode()).digest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), want):
        raise Unauthorized(f"/metrics needs the metrics token: send 'Authorization: Bearer <the value of "
                           f"{config.token_env}>' (metrics.token_env in the config)")


async def _exposition(app: web.Application, request: web.Request) -> web.Response:
    """The metrics, in OpenMetrics (with run-id exemplars) for a scraper that asks for it
    (Prometheus does), else Prometheus text. Team ledger gauges are read at scrape time
    (shared by replicas), and so are the calls waiting for a decision (`PendingApprovals`)."""
    _authorize(app, request)
    registry = app[ctx.METRICS]
    governor = app[ctx.GOVERNOR]
    for team in app[ctx.LIVE].config.teams:
        spent, reserved = await app[ctx.STORE].team_spend(team.name, governor.period(team))
        remaining = None if team.budget_usd is None else team.budget_usd - spent - reserved
        registry.set_team_budget(team.name, spent, remaining)
    await app[ctx.DRIVER].approvals.refresh()
    body, content_type = registry.exposition(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type, "Vary": "Accept"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics on the gateway's own address."""
    return await _exposition(request.app, request)


async def _separate_metrics(request: web.Request) -> web.Response:
    return await _exposition(request.app[METRICS_APP], request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The separate listener answers its errors in the OpenAI shape too."""
    try:
        request_headers.check(request.raw_headers)
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc).response()


async def _separate_listener(app: web.Application) -> AsyncIterator[None]:
    """The second listener. A port in use is a `StartError` (one line, exit 2); the workers
    of `--workers N` each listen on it with SO_REUSEPORT, as on the main port (any of them
    answers for all, docs/metrics.md)."""
    host, port = app[ctx.LIVE].config.metrics.listen or ("127.0.0.1", 0)
    sockets = listen_sockets(host, port, reuse_port=app.get(ctx.WORKER) is not None, setting="metrics.listen")
    listener = web.Application(middlewares=[_errors])
    listener[METRICS_APP] = app
    listener.router.add_get("/metrics", _separate_metrics)
    runner = web.AppRunner(listener, access_log=None)
    try:
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        yield
    finally:
        await runner.cleanup()
        for sock in sockets:
            sock.close()
