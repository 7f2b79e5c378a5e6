"""Governed pass-through: a call of a policy without tools, forwarded to its upstream.

The run's turn cap and budget and the team's budget are checked (and reserved) before
anything is forwarded, the upstream's answer goes back as it came (plus the `run` object
and the X-Run-* headers), and the turn is booked on the run before the client sees the
end of the answer. Chat completions and the Responses API both come through `governed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, TypeVar

from aiohttp import web

from gateway.harness.state import RunState
from gateway.providers.reply import ParsedReply, response_model
from gateway.providers.failover import RoutedCall
from gateway.providers.upstream import UpstreamReply
from gateway.server import context as ctx
from gateway.server.chat.passthrough_stream import charge_received, stream_through
from gateway.server.chat.stream_events import Reassembly
from gateway.server.http.errors import (
    ClientLeft,
    Conflict,
    LimitApprovalPending,
    LimitExceeded,
)
from gateway.server.http.leaving import upstream_wait
from gateway.server.runs import limit_requests
from gateway.server.runs.booking import Booked, book_turn, refuse
from gateway.server.runs.fair_share import Share
from gateway.server.runs.forwarding import Body, complete_chat, routed_call, trace_unbooked
from gateway.server.runs.governor import Admission, Ask
from gateway.server.runs.keying import Call, join_created
from gateway.server.runs.rate_limits import keep as keep_rate_clocks
from gateway.server.runs.replies import with_run
from gateway.server.runs.run_spans import chat_outcome
from gateway.store.errors import RunExists

T = TypeVar("T")


def _check_open(request: web.Request, call: Call) -> None:
    run = call.run
    if limit_requests.waits_on_limit(run) is not None:
        raise limit_requests.pending_refusal(request.app, run, call.policy)
    if run.status == "failed":
        raise Conflict(f"run {run.public_id} failed ({run.error or run.reason}); start a new run", code="run_failed")
    if run.status == "interrupted" and run.interruption is not None and run.interruption.type == "cancelled":
        raise Conflict(f"run {run.public_id} was cancelled ({run.interruption.reason or 'no reason'}); resume it "
                       f"with POST /v1/runs/{run.public_id}/resume to go on", code="run_cancelled")


async def _reload(request: web.Request, call: Call, stored: RunState | None = None) -> None:
    """Go on with the stored run instead of `call.run` (a cached copy that may be out of date,
    a new run that a concurrent first call stored first, or a blind call's run, `stored`
    as its admission found it), and check that it takes calls."""
    try:
        await join_created(request.app[ctx.STORE], request.app[ctx.POLICIES], call, stored,
                           request.headers.get("X-Policy") or None)
    finally:
        request[ctx.RUN] = call.run
    _check_open(request, call)


ASK_ATTEMPTS = 3
"""Admissions of one call refused at a limit that asks, whose run's limits were raised
meanwhile (a grant between its load and its refusal): each is judged again on the stored run."""


async def admit(request: web.Request, call: Call) -> Admission:
    """Admit the call (turn slot, budget holds), or refuse it with 429 (the run takes the
    refusal's status, or, at a limit that asks a person, records the request: 429
    `limit_approval_pending`) or 409 `run_busy` before anything is forwarded. A call that
    started from a cached run is judged again on the stored run when its admission refuses,
    or finds the stored revision different (the admission is then given back first)."""
    again = False
    for attempt in range(ASK_ATTEMPTS):
        try:
            if again:
                await _reload(request, call)
            adm = await _admit_once(request, call)
        except LimitExceeded as exc:
            if not call.stored:  # refused before the store step that would have stored the new run
                with contextlib.suppress(RunExists):
                    await request.app[ctx.STORE].create_run(call.run)
            call.stored = True
            answer = await limit_requests.ask_passthrough(request.app, call, exc)
            if answer is None:  # the run's limits were raised meanwhile: judge it again
                again = True
                continue
            raise await refuse(request, call, answer) from None
        call.stored = True
        return adm
    raise Conflict(f"run {call.run.public_id}'s limits changed while this call was judged; retry", code="run_contended",
                   headers={"x-should-retry": "true", "retry-after": "1"})


async def _admit_once(request: web.Request, call: Call) -> Admission:
    chat = call.chat
    ask = Ask(call.route.price, chat.messages, chat.tools, chat.max_tokens, chat.n, chat.model, call.user)
    app = request.app
    governor = app[ctx.GOVERNOR]

    async def admit_turn(create: bool = False) -> Admission:
        return await governor.admit_turn(call.run, call.team, ask, create=create,
                                         fit=limit_requests.asks_budget(call.policy, call.run))

    try:
        adm = await admit_turn(create=not call.stored)
    except RunExists as exc:  # stored already (a blind call's run, or a concurrent first call's)
        await _reload(request, call, exc.stored)
        adm = await admit_turn()
    except LimitExceeded:
        if not call.cached:
            raise
        await _reload(request, call)  # a refusal judged on a cached copy (e.g. older limits) is not final
        adm = await admit_turn()
    if call.cached and adm.run_revision != call.run.revision:
        app[ctx.RUN_CACHE].stale += 1
        await governor.release(adm)
        await _reload(request, call)
        adm = await admit_turn()
    return adm


@contextlib.asynccontextmanager
async def governed(request: web.Request, call: Call) -> AsyncIterator[tuple[Admission, RoutedCall]]:
    """The frame of every pass-through call (chat or Responses): the run must take calls, the
    call is admitted (its holds booked or released on every exit, `Admission` being a
    context manager) and counted active; yields the admission and the routed call that
    forwards it (its attempts traced with the turn, or on their own when none was booked).
    The gateway's own work for it is done in its team's share (`runs.fair_share`): a slot
    held until it is forwarded (taken by the endpoint, else here) and again for the booking.
    With tracing on, the frame is the call's `chat {model}` span (`ctx.CHAT_SPAN`)."""
    share = request.get(ctx.SHARE)
    own = share is None  # the endpoint made none (the Responses API): this call's, from here
    if share is None:
        share = request[ctx.SHARE] = Share(request.app[ctx.FAIR_SHARE], call.team.name)
    try:
        await share.take()
        async with _traced(request, call, share) as pair:
            yield pair
    finally:
        if own:
            share.close()
        else:
            share.give_back()


@contextlib.asynccontextmanager
async def _traced(request: web.Request, call: Call, share: Share) -> AsyncIterator[tuple[Admission, RoutedCall]]:
    tracing = request.app.get(ctx.TRACING)
    if tracing is None:
        async with _governed(request, call, share) as framed:
            yield framed
        return
    chat = call.chat
    span = tracing.chat(chat.model, run_id=call.run.public_id, team=call.team.name, policy=call.policy.name,
                        stream=chat.stream, messages=chat.messages)
    request[ctx.CHAT_SPAN] = span
    with chat_outcome(span):
        async with _governed(request, call, share) as framed:
            yield framed


@contextlib.asynccontextmanager
async def _governed(request: web.Request, call: Call, share: Share) -> AsyncIterator[tuple[Admission, RoutedCall]]:
    try:
        try:
            _check_open(request, call)
        except (Conflict, LimitApprovalPending):
            if not call.cached:
                raise
            await _reload(request, call)  # the cached run may be out of date: the stored one decides
    except LimitApprovalPending as exc:
        raise await refuse(request, call, exc) from None
    metrics = request.app[ctx.METRICS]
    span = request.get(ctx.CHAT_SPAN)
    asked = time.perf_counter()
    async with await admit(request, call) as adm:
        if span is not None:
            span.admitted(time.perf_counter() - asked, adm.max_tokens)
        keep_rate_clocks(request, adm.rate_headers)
        metrics.run_active(1)
        routed = routed_call(request.app, call.route, call.chat.model)
        share.give_back()  # no slot while the upstream works: taken again for the booking
        try:
            yield adm, routed
        finally:
            metrics.run_active(-1)
            await asyncio.shield(trace_unbooked(request.app, routed, call.run.run_id))


def chat_body(call: Call, adm: Admission) -> Body:
    """The chat body to forward, for the model name a deployment is asked for."""
    return lambda model: call.chat.upstream_body(max_tokens=adm.max_tokens, force_usage=True, model=model)


async def pass_through(request: web.Request, call: Call) -> web.StreamResponse:
    """Governed pass-through of one chat call (streamed or not)."""
    async with governed(request, call) as (adm, routed):
        if call.chat.stream:
            return await stream_through(request, call, adm, routed, chat_body(call, adm), request.headers)
        reply, parsed, booked = await complete_and_book(request, call, adm, routed, chat_body(call, adm),
                                                        request.headers)
        return web.Response(body=with_run(reply.raw, booked.run.summary()), content_type="application/json",
                            headers=booked.headers())


async def awaiting_upstream(request: web.Request, call: Call, adm: Admission, routed: RoutedCall,
                            answer: Coroutine[Any, Any, T]) -> T:
    """`answer`, the upstream's non-streamed reply; a client that leaves first stops it
    (`http.leaving`): the prompt the upstream was sent is booked, the rest of the call's
    holds are freed, and `ClientLeft` is raised."""
    try:
        with upstream_wait(request):
            return await answer
    except ClientLeft:
        answer.close()  # never started if the client had gone already
        await charge_received(request, call, adm, Reassembly(), "client_disconnected", routed, left=True)
        raise


async def complete_and_book(request: web.Request, call: Call, adm: Admission, routed: RoutedCall, body: Body,
                            client_headers: Mapping[str, str]) -> tuple[UpstreamReply, ParsedReply, Booked]:
    """A non-streamed pass-through turn: forward (with retries and fallbacks), parse (502
    `upstream_malformed`, released like any upstream failure), time it and book it."""
    reply, parsed, upstream = await awaiting_upstream(request, call, adm, routed,
                                                      complete_chat(routed, body, client_headers))
    request[ctx.UPSTREAM_SECONDS] = reply.seconds
    request.app[ctx.METRICS].on_upstream(upstream.name, call.chat.model, reply.seconds)
    booked = await book_turn(request, call, adm, reported=parsed.usage, message=parsed.message,
                             finish=parsed.finish_reason, routed=routed, repairs=reply.repairs,
                             others=parsed.others, response_model=response_model(reply.data))
    return reply, parsed, booked
