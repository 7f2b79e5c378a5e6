"""The SERVER span of each request (tracing on): the outermost middleware.

Added to the app only when `telemetry` is on, so a gateway without tracing runs the
middleware chain it always ran. The span is a child of the client's `traceparent` when it
sent one (the client's trace id is kept), and current while the request is served: the
runs, model turns, tools and upstream attempts below it are its descendants. Not traced:
the scripted mount (its requests are the gateway's own upstream attempts, already spans)
and the probes and scrapes (`UNTRACED`), which would outnumber every other trace.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.server import context as ctx
from gateway.server.http.middleware import is_scripted_mount, route_label

UNTRACED: Final = frozenset({"/healthz", "/livez", "/readyz", "/metrics"})


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    route = route_label(request)
    if route in UNTRACED or is_scripted_mount(request.path):
        return await handler(request)
    span = request.config_dict[ctx.TRACING].server(request.method, route, request.path, request.headers,
                                                   request.scheme, request.remote)
    ids = span.ids
    if ids is not None:
        request[ctx.TRACE_ID] = ids[0]
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # a redirect (the middleware below answers every error)
        span.finish(exc.status, None)
        raise
    except BaseException:
        span.finish(500, "internal_error")
        raise
    span.finish(response.status, request.get(ctx.ERROR_CODE))
    return response
