"""The access log's side in the server: aiohttp's access-log hook, fed what a request learnt.

aiohttp calls an access logger once per request, after the answer's last byte (or the
client's going), with the response and the time it took: `access_logger(log)` is such a
class, given to the runner by `listener.run`. It reads what the request learnt on its way
(`ctx.RUN`, `auth.AUTHENTICATED`, `ctx.MODEL`, `ctx.TRACE_ID`, `ctx.ERROR_CODE`) and hands
one line's fields to `gateway.telemetry.access_log.AccessLog`. Left out: the routes the
config excludes (probes and scrapes by default) and the scripted mount (its requests are
the gateway's own upstream calls).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_request import BaseRequest

from gateway.server import context as ctx
from gateway.server.http.auth import AUTHENTICATED
from gateway.server.http.middleware import is_scripted_mount, route_label
from gateway.telemetry.access_log import AccessLog, iso_time


def fields(request: BaseRequest, response: web.StreamResponse, seconds: float, route: str) -> dict[str, Any]:
    """One line's fields (`gateway.telemetry.access_log.FIELDS`)."""
    run = request.get(ctx.RUN)
    team = request.get(AUTHENTICATED)
    caller = team.caller if team is not None else None
    return {
        "time": iso_time(time.time() - seconds), "method": request.method, "route": route,
        "status": response.status, "duration_ms": round(seconds * 1000, 3), "bytes": response.body_length,
        "team": team.name if team is not None else (run.team if run is not None else None),
        "key_id": caller.key_id if caller is not None else None,
        "run_id": run.public_id if run is not None else None,
        "model": request.get(ctx.MODEL) or (run.model if run is not None else None),
        "turns": run.turns if run is not None else None,
        "cost_usd": round(run.cost_usd, 9) if run is not None else None,
        "trace_id": request.get(ctx.TRACE_ID), "error_code": request.get(ctx.ERROR_CODE),
    }


def access_logger(sink: AccessLog) -> type[AbstractAccessLogger]:
    """An aiohttp access-logger class writing to `sink` (aiohttp makes one per connection)."""

    class GatewayAccessLogger(AbstractAccessLogger):
        def log(self, request: BaseRequest, response: web.StreamResponse, time: float) -> None:
            try:
                route = route_label(request)  # type: ignore[arg-type]
            except (AssertionError, AttributeError):  # refused by the HTTP parser before routing
                route = "unmatched"
            if route in sink.excluded or is_scripted_mount(request.path):
                return
            sink.write(fields(request, response, time, route))

    return GatewayAccessLogger
