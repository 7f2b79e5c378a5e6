"""The one middleware: errors in the OpenAI shape, request counts and the gateway's overhead.

Every request's headers are checked first (`request_headers.check`: UTF-8 text, else 400
or 401), so no handler meets an undecodable one. Any `ApiError` becomes its JSON answer (with the run's headers when a run is known);
aiohttp's own errors (unknown route, wrong method, body too big) get the same shape; an
unexpected exception is logged and answered 500 without details; a store failure is a
503 `store_unavailable` (`errors.from_store_error`), and fails the store's health (logged
once until it recovers, `ctx.STORE_HEALTH`). `requests_total` is
labelled by route template (never the raw path, so run ids stay out of labels), and
`overhead_seconds` is the handler's time minus the time spent waiting on the upstream.
The scripted provider mounted at /scripted/v1 is an upstream that happens to live in this
process: its requests (mostly the gateway's own upstream calls) are not counted as gateway
traffic. Metrics recorded while a request is served carry its run's id as an exemplar.
The first request also tells the app its own address (for the scripted mount) when
`serve` did not.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.config.settings import SCRIPTED_PREFIX
from gateway.providers.errors import UpstreamError
from gateway.server import context as ctx
from gateway.server.http.errors import (
    ApiError,
    InternalError,
    LimitExceeded,
    StoreUnavailable,
    from_http_exception,
    from_store_error,
    upstream_failed,
)
from gateway.server.http import request_headers
from gateway.server.http.headers import run_headers
from gateway.server.metrics import end_exemplar_run, exemplar_run
from gateway.store.errors import SpoolNotReady, StoreError

log = logging.getLogger(__name__)


def route_label(request: web.Request) -> str:
    """The route template that matched (`/v1/runs/{id}`), or "unmatched"."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _run_id(request: web.Request) -> str | None:
    run = request.get(ctx.RUN)
    return run.public_id if run is not None else None


def is_scripted_mount(path: str) -> bool:
    """A path of the scripted provider's mount (an upstream that lives in this process)."""
    return path.startswith(SCRIPTED_PREFIX) and (len(path) == len(SCRIPTED_PREFIX) or path[len(SCRIPTED_PREFIX)] == "/")


def _error_response(request: web.Request, exc: ApiError) -> web.Response:
    if isinstance(exc, LimitExceeded):  # the operator's choice (server.refusal_status), for clients that retry 429s
        exc.status = request.config_dict[ctx.LIVE].config.server.refusal_status
    run = request.get(ctx.RUN)
    extra = None
    if run is not None and "X-Run-Id" not in exc.headers:
        extra = run_headers(run)
    request[ctx.ERROR_CODE] = exc.code or exc.type  # the access log's and the trace's
    return exc.response(extra)


def served_routes(app: web.Application) -> str:
    """What this gateway serves, as `METHOD /path` items (for the 404 of any other path)."""
    seen: dict[str, list[str]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method in ("HEAD", "*") or is_scripted_mount(path) or not path:
            continue
        seen.setdefault(path, []).append(route.method)
    return ", ".join(f"{'|'.join(methods)} {path}" for path, methods in seen.items())


@web.middleware
async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    upstreams = request.config_dict[ctx.UPSTREAMS]
    if upstreams.self_url is None:
        upstreams.learn_self_url(request)
    exemplars = exemplar_run(partial(_run_id, request))
    try:
        request_headers.check(request.raw_headers)
        response = await handler(request)
    except ApiError as exc:
        response = _error_response(request, exc)
    except UpstreamError as exc:
        response = _error_response(request, upstream_failed(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = from_http_exception(exc)
        if exc.status == 404:
            error.message = f"no route for {request.method} {request.path}; this gateway serves {served_routes(request.app)}"
        response = _error_response(request, error)
    except StoreError as exc:
        error = from_store_error(exc)
        if isinstance(error, StoreUnavailable) and not isinstance(exc, SpoolNotReady):  # logged once until it recovers
            request.config_dict[ctx.STORE_HEALTH].fail(f"{exc} (on {request.method} {request.path})")
        response = _error_response(request, error)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        response = _error_response(request, InternalError("the gateway failed on this request; see its log"))
    finally:
        end_exemplar_run(exemplars)
    metrics = request.config_dict[ctx.METRICS]
    if not is_scripted_mount(request.path):
        metrics.on_request(route_label(request), response.status)
    upstream = request.get(ctx.UPSTREAM_SECONDS)
    if upstream is not None:
        metrics.on_overhead(time.perf_counter() - started - upstream)
    return response
