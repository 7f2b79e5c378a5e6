"""`POST /v1/chat/completions`: authenticate, key the call to its run, govern, forward.

A policy with tools hands the call to the server-side harness (`app[HARNESS]`); a policy
without tools is governed pass-through: the run's turn cap and budget and the team's
budget are checked (and reserved) before anything is forwarded, the upstream's answer
goes back as it came (plus the `run` object and the X-Run-* headers), and the turn is
booked on the run before the client sees the end of the answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from aiohttp import web

from gateway.providers.reply import ParsedReply
from gateway.providers.upstream import Upstream, UpstreamReply
from gateway.server import context as ctx
from gateway.server.budget import Admission, Ask
from gateway.server.chat_request import parse_chat_request
from gateway.server.errors import BadRequest, Conflict, LimitExceeded, NotFound, PayloadTooLarge
from gateway.server.passthrough_stream import stream_through
from gateway.server.replies import with_run
from gateway.server.runs import Call, resolve_call
from gateway.server.turns import Booked, book_turn, refuse


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """The route handler: every refusal here happens before the store is touched."""
    app = request.app
    team = app[ctx.KEYRING].authenticate(request)
    chat = parse_chat_request(await read_body(request, app[ctx.CONFIG].server.max_body_bytes))
    route = app[ctx.CONFIG].route(chat.model)
    if route is None:
        raise NotFound(f"model '{chat.model}' is not routed by this gateway (see GET /v1/models)",
                       code="model_not_found", param="model")
    call = await resolve_call(app[ctx.STORE], app[ctx.POLICIES], team, request.headers, chat, route)
    request[ctx.RUN] = call.run
    if call.policy.server_side:
        return await app[ctx.HARNESS](request, call)
    return await pass_through(request, call)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` (declared or actual size)."""
    size = request.content_length
    if size is not None and size > limit:
        raise PayloadTooLarge(limit, size)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(limit) from None
    except web.RequestPayloadError:  # aiohttp's decoder refused the bytes (bad gzip, broken chunks)
        raise BadRequest("the request body could not be read: it does not match its Content-Encoding or "
                         "Transfer-Encoding, or it ended early", code="invalid_body",
                         headers={"Connection": "close"}) from None  # the rest of its bytes cannot be skipped


def _check_open(call: Call) -> None:
    run = call.run
    if run.status == "failed":
        raise Conflict(f"run {run.public_id} failed ({run.error or run.reason}); start a new run", code="run_failed")
    if run.status == "interrupted" and run.interruption is not None and run.interruption.type == "cancelled":
        raise Conflict(f"run {run.public_id} was cancelled ({run.interruption.reason or 'no reason'}); resume it "
                       f"with POST /v1/runs/{run.public_id}/resume to go on", code="run_cancelled")


async def admit(request: web.Request, call: Call) -> Admission:
    """Admit the call (turn slot, budget holds), or refuse it with 429 (the run takes the
    refusal's status) or 409 `run_busy` before anything is forwarded."""
    chat = call.chat
    ask = Ask(call.route.price, chat.messages, chat.tools, chat.max_tokens, chat.n)
    try:
        return await request.app[ctx.GOVERNOR].admit_turn(call.run, call.team, ask)
    except LimitExceeded as exc:
        raise await refuse(request, call, exc) from None


@contextlib.asynccontextmanager
async def governed(request: web.Request, call: Call) -> AsyncIterator[tuple[Admission, Upstream]]:
    """The frame of every pass-through call (chat or Responses): the run must take calls, the
    call is admitted (its holds booked or released on every exit, `Admission` being a
    context manager) and counted active; yields the admission and the upstream to forward to."""
    _check_open(call)
    metrics = request.app[ctx.METRICS]
    async with await admit(request, call) as adm:
        metrics.run_active(1)
        try:
            yield adm, request.app[ctx.UPSTREAMS][call.route.upstream]
        finally:
            metrics.run_active(-1)


async def pass_through(request: web.Request, call: Call) -> web.StreamResponse:
    """Governed pass-through of one chat call (streamed or not)."""
    async with governed(request, call) as (adm, upstream):
        body = call.chat.upstream_body(max_tokens=adm.max_tokens, force_usage=True)
        headers = upstream.headers(request.headers)
        if call.chat.stream:
            return await stream_through(request, call, adm, upstream, body, headers)
        reply, parsed, booked = await complete_and_book(request, call, adm, upstream, body, headers)
        return web.Response(body=with_run(reply.raw, booked.run.summary()), content_type="application/json",
                            headers=booked.headers())


async def complete_and_book(request: web.Request, call: Call, adm: Admission, upstream: Upstream, body: bytes,
                            headers: Mapping[str, str]) -> tuple[UpstreamReply, ParsedReply, Booked]:
    """A non-streamed pass-through turn: forward, parse (502 `upstream_malformed`, released
    like any upstream failure), time it and book it."""
    reply = await upstream.complete(body, headers)
    parsed = upstream.parse(reply)
    request[ctx.UPSTREAM_SECONDS] = reply.seconds
    request.app[ctx.METRICS].on_upstream(upstream.name, call.chat.model, reply.seconds)
    booked = await book_turn(request, call, adm, reported=parsed.usage, message=parsed.message,
                             finish=parsed.finish_reason, repairs=reply.repairs)
    return reply, parsed, booked
