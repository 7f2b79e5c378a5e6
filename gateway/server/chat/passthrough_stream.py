"""A streamed pass-through call: upstream SSE events go to the client as they arrive.

Each event is forwarded with the bytes the upstream sent (tool_calls deltas included);
it is parsed once on the way to rebuild the reply for the transcript and to find the
usage. The upstream is always asked for `stream_options.include_usage`; the usage-only
chunk is dropped if the client did not ask for it. Without usage, both sides are counted
with o200k_base. The turn is booked before `data: [DONE]`, preceded by an SSE comment
`: run {...}` with the run's figures (OpenAI clients skip comments).

A stream the upstream cuts (or that stalls past the timeout) is charged for what was
received and ends with an OpenAI-shaped `data: {"error": ...}` event, without [DONE];
nothing received: nothing is charged. A client that goes away stops the upstream call at
once (`http.leaving`: its connection is closed, the admission's slot and reservation
freed) and is charged the prompt its upstream was sent plus what was received.
A turn the store cannot take once the stream is open is spooled (booked when the store is
back) and the stream ends as usual; a refusal about the run itself (deleted, changed
elsewhere) ends it with that error event instead of [DONE].

What the client is sent is the outlet's business (`stream_events`): `ChatOutlet` passes
the upstream's bytes on; the Responses API's outlet translates them (the governance is
the same).

An upstream with `tool_repair` has the tool calls of its streams repaired before the turn
is booked (`stream_repair`): the events that may need it are held and the repaired reply's
rest is sent in their place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import orjson
from aiohttp import web

from gateway.config.upstreams import Endpoint
from gateway.providers.errors import UpstreamError
from gateway.providers.failover import RoutedCall
from gateway.providers.repair import Repair
from gateway.server import context as ctx
from gateway.server.chat.stream_events import ChatOutlet, Reassembly
from gateway.server.chat.stream_repair import StreamRepair
from gateway.server.http.errors import ApiError, ClientLeft, from_store_error, upstream_failed
from gateway.server.http.headers import run_headers
from gateway.server.http.leaving import gone, upstream_wait
from gateway.server.http.sse import SSE_HEADERS
from gateway.server.runs.booking import Booked, book_turn
from gateway.server.runs.forwarding import Body, open_stream
from gateway.server.runs.governor import Admission
from gateway.server.runs.keying import Call
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)


async def stream_through(request: web.Request, call: Call, adm: Admission, routed: RoutedCall, body: Body,
                         client_headers: Mapping[str, str], outlet: ChatOutlet | None = None,
                         got: Reassembly | None = None, endpoint: Endpoint = "chat") -> web.StreamResponse:
    """Forward a streamed call; see the module docstring for what happens on failures.
    `got` reads the upstream's events (a subclass reads another wire), `endpoint` is the
    upstream API they are asked of (chat, or responses for a native Responses upstream). The client's response starts with the upstream's first event: until
    then a failure is retried on the route (`RoutedCall.stream`), never after."""
    out = outlet or ChatOutlet(call.chat.include_usage)
    app = request.app
    metrics = app[ctx.METRICS]
    started = time.perf_counter()
    got = got or Reassembly()
    repair: StreamRepair | None = None
    response: web.StreamResponse | None = None
    failure: UpstreamError | None = None
    client_gone = False
    upstream_name = call.route.upstream
    try:
        with upstream_wait(request):
            async with open_stream(routed, body, client_headers, endpoint) as opened:
                upstream_name = opened.answer.upstream.name
                repair = StreamRepair.of(opened.answer.upstream, call.chat.tools, call.chat.n)
                metrics.on_ttft(upstream_name, call.chat.model, time.perf_counter() - started)
                start_headers = run_headers(call.run)
                start_headers["X-Run-Status"] = "running"
                response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **start_headers})
                await response.prepare(request)
                head = out.start()
                if head:
                    await response.write(head)
                async for event in opened.events():
                    kind = got.feed(event)
                    if kind == "done":
                        break
                    if kind == "malformed":  # never passed on: the client's parser would choke on it
                        failure = UpstreamError("upstream_malformed", f"upstream '{upstream_name}' sent a "
                                                f"chunk that is not JSON: {event[:80]!r}", upstream_name, 200)
                        opened.outcome = "malformed"
                        break
                    data = repair.pass_on(kind, event, got, out) if repair is not None else out.event(kind, event, got.last)
                    try:
                        if data:
                            await response.write(data)
                    except (ConnectionError, RuntimeError):
                        client_gone = True
                        break
                    if kind == "error" and (repair is None or repair.parse_error is None):  # not dropped by the repair
                        failure = UpstreamError("upstream_error", f"upstream '{upstream_name}' sent an error "
                                                "in the stream", upstream_name, 200)
                        opened.outcome = "malformed"
                        break
    except ClientLeft:  # the upstream call was stopped: book what it was sent and what came back
        if response is None:
            await charge_received(request, call, adm, got, "client_disconnected", routed, left=True)
            raise
        client_gone = True
    except UpstreamError as exc:
        if response is None:  # nothing sent yet: an ordinary error answer (the admission releases)
            raise
        failure = exc
    except BaseException:  # cancelled: a shutdown
        left = gone(request)
        await charge_received(request, call, adm, got, "client_disconnected" if left else "cancelled", routed,
                              left=left)
        raise
    seconds = time.perf_counter() - started
    request[ctx.UPSTREAM_SECONDS] = seconds
    metrics.on_upstream(upstream_name, call.chat.model, seconds)
    assert response is not None
    if repair is not None and failure is None and not client_gone:
        repair.repair(got)
    finish = got.finish or ("client_disconnected" if client_gone else "cut" if failure else "stop")
    unbooked: ApiError | None = None
    try:
        booked = await charge_received(request, call, adm, got, finish, routed,
                                       repair.repairs if repair is not None else (), left=client_gone)
    except StoreError as exc:  # the stream is open: it ends with the store's error, not a cut
        log.warning("run %s: the streamed turn could not be saved: %s", call.run.run_id, exc)
        booked, unbooked = None, from_store_error(exc)
    if client_gone:
        return response
    try:
        if repair is not None:
            await response.write(repair.tail(out))
        if unbooked is not None:
            request[ctx.ERROR_CODE] = unbooked.code or unbooked.type
            await response.write(b"data: " + orjson.dumps(unbooked.body()) + b"\n\n")
        elif failure is not None:
            if failure.upstream_status is None:  # it answered 200, then failed mid-stream
                failure.upstream_status = 200
            error = upstream_failed(failure)
            request[ctx.ERROR_CODE] = error.code or error.type  # the stream's 200 ended in this error
            await response.write(out.failed(error.body()))
        else:
            summary = booked.run.summary() if booked is not None else call.run.summary()
            await response.write(await out.end(booked, got, finish, summary))
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return response


async def charge_received(request: web.Request, call: Call, adm: Admission, got: Reassembly,
                          finish: str, routed: RoutedCall, repairs: Sequence[Repair] = (), *,
                          left: bool = False) -> Booked | None:
    """Book what was received as the turn (counted if the upstream gave no usage), or
    release the call when nothing can be charged. A call whose client `left` while an
    upstream had its request is charged at least that request's prompt (counted with
    o200k_base), received or not: the upstream was sent it (docs/limits.md)."""
    if got.chunks == 0 and got.usage is None and not (left and routed.sent_to is not None):
        await request.app[ctx.GOVERNOR].release(adm)
        return None
    return await book_turn(request, call, adm, reported=got.usage, message=got.message(), finish=finish,
                           routed=routed, repairs=repairs, others=got.others())
