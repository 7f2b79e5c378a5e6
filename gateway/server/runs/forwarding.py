"""A governed call's way to its upstream: the routed call (`gateway.providers.failover`) with
this app's router, metrics and trace.

Every attempt is counted in `gateway_upstream_attempts_total{upstream, outcome}` as it ends
and written as an `upstream_attempt` line in the run's trace: with the turn it produced
(`book_turn`, one store step), or on their own when no turn was booked (every attempt
failed) by `trace_unbooked`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager

from aiohttp import web

from gateway.config.settings import ModelRoute
from gateway.config.upstreams import Endpoint
from gateway.harness.trace import Tracer
from gateway.providers.failover import Attempt, Opened, RoutedCall
from gateway.providers.reply import ParsedReply
from gateway.providers.upstream import Upstream, UpstreamReply
from gateway.server import context as ctx
from gateway.store.base import Event
from gateway.store.tracefile import append as append_trace_file
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

Body = Callable[[str], bytes]
"""The request body asking for a model name (a deployment or fallback may rename the model)."""


def routed_call(app: web.Application, route: ModelRoute, model: str) -> RoutedCall:
    """A call of `model` over `route`, its attempts counted in this app's metrics."""
    metrics = app[ctx.METRICS]
    return app[ctx.UPSTREAMS].call(route, model, lambda a: metrics.on_attempt(a.upstream, a.outcome))


def attempt_events(run_id: str, attempts: Iterable[Attempt]) -> list[Event]:
    """The `upstream_attempt` trace lines of a call's attempts."""
    line = Tracer(run_id)
    return [line("upstream_attempt", **a.fields()) for a in attempts]


async def trace_unbooked(app: web.Application, routed: RoutedCall, run_id: str) -> None:
    """Write the call's attempts to the run's trace if no booked turn carried them (every
    attempt failed); a store failure here is logged, never raised over the upstream's error."""
    if routed.traced or not routed.attempts:
        return
    routed.traced = True
    lines = attempt_events(run_id, routed.attempts)
    try:
        await app[ctx.STORE].append_events(run_id, lines)
    except StoreError as exc:
        log.warning("run %s: its failed upstream attempts could not be traced: %s", run_id, exc)
        return
    append_trace_file(app[ctx.LIVE].config.trace_file, lines)


async def complete_chat(routed: RoutedCall, body: Body,
                        client_headers: Mapping[str, str] | None) -> tuple[UpstreamReply, ParsedReply, Upstream]:
    """A non-streamed chat completion over the routed call, parsed (a malformed reply is that
    attempt's outcome)."""
    async def send(upstream: Upstream, model: str) -> tuple[UpstreamReply, ParsedReply]:
        reply = await upstream.complete(body(model), upstream.headers(client_headers), model)
        return reply, upstream.parse(reply)

    (reply, parsed), answer = await routed.complete(send)
    return reply, parsed, answer.upstream


async def respond(routed: RoutedCall, body: Body, client_headers: Mapping[str, str]) -> tuple[UpstreamReply, Upstream]:
    """A non-streamed Responses call to upstreams that speak it natively."""
    async def send(upstream: Upstream, model: str) -> UpstreamReply:
        return await upstream.respond(body(model), upstream.headers(client_headers), model)

    reply, answer = await routed.complete(send)
    return reply, answer.upstream


def open_stream(routed: RoutedCall, body: Body, client_headers: Mapping[str, str],
                endpoint: Endpoint) -> AbstractAsyncContextManager[Opened]:
    """A streamed call over the routed call (retried until its first event, never after)."""
    return routed.stream(lambda upstream, model: upstream.stream(body(model), upstream.headers(client_headers),
                                                                 endpoint, model))
