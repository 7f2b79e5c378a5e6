"""`POST /v1/embeddings`: routed like a chat call and paid from the budgets.

The call goes over the model's route (`runs.forwarding.routed_call`): its deployments, the
model name each is asked for (`deployments[].model`), retries and fallbacks, as for chat.
It is admitted by the governor like a server-side model call (`admit_call`: a hold on the
team's budget for the input tokens, strict clamps when strict) and, with an `X-Run-Id`,
against the run's budget; it is not a turn (turn caps count model turns). The actual cost,
at the `price_in` of the deployment that answered, is booked on the team's ledger and, with
a run, on the run (its cost and usage, the call's `upstream_attempt` lines and an
`embeddings` one) in one store step: the upstream's `usage.prompt_tokens`, checked by the
rule every booking follows (`replies.checked_usage`: a count beyond belief is booked at the
gateway's own, with a `usage_clamped` line and metric), or the gateway's count when it
reports none. The upstream's body goes back as it came (plus the `run` object). A client
that leaves before the answer stops the upstream call; its input, counted, is booked at the
price of the deployment that had it. When the run's step fails, the spend is booked on the
ledgers all the same (`booking.book_alone`: spooled while the store cannot take it); the
call answers the store's error and the run's cost does not include it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.harness.state import Message, RunState
from gateway.harness.trace import Tracer, usage_clamped
from gateway.harness.usage import Price
from gateway.providers.errors import UpstreamError
from gateway.providers.upstream import Upstream, UpstreamReply
from gateway.server import context as ctx
from gateway.server.http.chat_request import ChatRequest
from gateway.server.http.errors import (
    ClientLeft,
    InvalidField,
    InvalidJSON,
    LimitExceeded,
    NotFound,
)
from gateway.server.http.headers import run_headers
from gateway.server.http.leaving import upstream_wait
from gateway.server.http.validation import kind as _kind
from gateway.server.http.scope import call_user, require_model
from gateway.server.http.validation import read_body
from gateway.server.runs.booking import append_trace_file, book_alone, refuse
from gateway.server.runs.forwarding import attempt_events, routed_call, trace_unbooked
from gateway.server.runs.governor import Admission, Ask
from gateway.server.runs.keying import Call, commit_run, resolve_call, run_id_from
from gateway.server.runs.rate_limits import keep as keep_rate_clocks
from gateway.server.runs.replies import CheckedUsage, checked_usage, embeddings_usage_of, with_run
from gateway.store.base import Event

FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})




def parse_embeddings(raw: bytes) -> tuple[dict[str, Any], str, list[Message], int | None]:
    """(body, model, the inputs as messages for the reservation's count, their exact token
    count when given as token arrays); refuses with a 400 naming the field."""
    try:
        body = orjson.loads(raw) if raw.strip() else None
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidJSON(f"expected a JSON object with model and input, got {_kind(body)}")
    for name in body:
        if name not in FIELDS:
            raise InvalidField(name, f"{name} is not supported by this gateway's embeddings", "unsupported_field")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", f"model must be a non-empty string, got {_kind(model)}",
                           "missing_field" if model is None else "invalid_type")
    value = body.get("input")
    items = [value] if isinstance(value, str) or (isinstance(value, list) and value
                                                  and all(isinstance(t, int) for t in value)) else value
    if not isinstance(items, list) or not items:
        raise InvalidField("input", "input must be a string, an array of strings or an array of token arrays",
                           "missing_field" if value is None else "invalid_type")
    messages: list[Message] = []
    tokens: int | None = 0
    for i, item in enumerate(items):
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
            tokens = None
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            # " a" is one o200k_base token: the reservation counts a token array at its length
            messages.append({"role": "user", "content": " a" * len(item)})
            tokens = None if tokens is None else tokens + len(item)
        else:
            where = "input" if items is not value else f"input[{i}]"
            raise InvalidField(where, f"{where} must be a string or an array of integer tokens", "invalid_type")
    return body, model, messages, tokens


async def create_embeddings(request: web.Request) -> web.Response:
    """Authenticate, key to the run (if X-Run-Id), admit, forward, book."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    raw = await read_body(request, app[ctx.LIVE].config.server.max_body_bytes)
    body, model, messages, token_count = parse_embeddings(raw)
    request[ctx.MODEL] = model
    route = app[ctx.LIVE].config.route(model)
    if route is None:
        raise NotFound(f"model '{model}' is not routed by this gateway (see GET /v1/models)", code="model_not_found",
                       param="model")
    require_model(team, model)
    user = call_user(team, body, request.headers)
    price = Price(route.price.input_per_million, 0.0)  # the hold covers whichever deployment answers
    call: Call | None = None
    if run_id_from(request.headers) is not None:
        chat = ChatRequest(raw, body, model, messages, None, False, False, None, "max_tokens")
        call = await resolve_call(app[ctx.STORE], app[ctx.POLICIES], team, request.headers, chat, route, user=user)
        request[ctx.RUN] = call.run
    governor = app[ctx.GOVERNOR]
    ask = Ask(price, messages, None, 1, model=model, user=user, policy="" if call is None else call.policy.name)
    try:
        adm = await _admit(app, call, team, ask)
    except LimitExceeded as exc:
        raise (await refuse(request, call, exc) if call is not None else exc) from None
    async with adm:
        keep_rate_clocks(request, adm.rate_headers)
        routed = routed_call(app, route, model)
        metrics = app[ctx.METRICS]

        async def send(upstream: Upstream, asked: str) -> UpstreamReply:
            sent = raw if asked == model else orjson.dumps({**body, "model": asked})
            return await upstream.embed(sent, upstream.headers(request.headers), asked)

        reply: UpstreamReply | None = None
        try:
            with upstream_wait(request):
                reply, answer = await routed.complete(send)
        except ClientLeft:  # the upstream call was stopped: an input it was sent is booked
            if routed.sent_to is None:
                raise
            answer = routed.sent_to
        except UpstreamError:
            if call is not None:
                await asyncio.shield(trace_unbooked(app, routed, call.run.run_id))
            raise
        upstream = answer.upstream
        price = Price(answer.price.input_per_million, 0.0)  # booked at the price of the deployment that answered
        if reply is not None:
            request[ctx.UPSTREAM_SECONDS] = reply.seconds
            metrics.on_upstream(upstream.name, model, reply.seconds)
        reported = embeddings_usage_of(reply.data.get("usage")) if reply is not None else None
        checked = checked_usage(reported, counter=app[ctx.COUNTER],
                                messages=messages, tools=None, replies=None, body_bytes=len(raw),
                                allowed_completion=0, n=1, counted_prompt=token_count)
        metrics.on_usage_clamped(upstream.name, checked.clamped)
        spent = checked.usage
        cost = price.cost(spent)
        metrics.on_spend(team.name, model, spent, cost)
        if call is None:
            await governor.settle(adm, cost, spent.total_tokens)
        else:
            routed.traced = True
            call.run = await _book_on_run(app, call.run, adm, checked, cost, model, upstream.name,
                                          attempt_events(call.run.run_id, routed.attempts))
            request[ctx.RUN] = call.run
        if reply is None:
            raise ClientLeft()
        if call is None:
            return web.Response(body=reply.raw, content_type="application/json")
        run = call.run
        headers = run_headers(run, await governor.team_remaining(team))
        return web.Response(body=with_run(reply.raw, run.summary()), content_type="application/json", headers=headers)


async def _admit(app: web.Application, call: Call | None, team: TeamConfig, ask: Ask) -> Admission:
    governor = app[ctx.GOVERNOR]
    if call is None:
        return await governor.admit_call("", team, team.budget_mode == "strict", ask, None)
    run = call.run
    limits = run.limits
    strict = limits.budget_mode == "strict" or team.budget_mode == "strict"
    left = None if limits.max_budget_usd is None else limits.max_budget_usd - run.cost_usd
    if left is not None and left <= 0:
        raise LimitExceeded("budget_exceeded", f"run {run.public_id} spent ${run.cost_usd:.6f} of its "
                                               f"${limits.max_budget_usd:.6f} budget; nothing was forwarded")
    return await governor.admit_call(run.run_id, team, strict, ask, left)


async def _book_on_run(app: web.Application, run: RunState, adm: Admission, checked: CheckedUsage, cost: float,
                       model: str, upstream: str, attempts: list[Event]) -> RunState:
    """The cost on the run and the team's ledger, and the trace lines (the call's upstream
    attempts, a `usage_clamped` line when the usage was not believed, then `embeddings`), in
    one store step."""
    spent = checked.usage

    def change(state: RunState) -> None:
        state.usage = state.usage + spent
        state.cost_usd += cost

    def trace(state: RunState) -> list[Event]:
        line = Tracer(state.run_id)
        lines: list[Event] = [*attempts]
        if checked.reported is not None:
            lines.append(line("usage_clamped", **usage_clamped(upstream, checked.reported, spent)))
        lines.append(line("embeddings", model=model, prompt_tokens=spent.prompt_tokens,
                          costUsd=round(state.cost_usd, 9)))
        return lines

    governor = app[ctx.GOVERNOR]
    booking = governor.booking(adm, cost, spent.total_tokens)
    apply: Callable[[RunState], None] = change
    try:
        async with governor.run_lock(run.run_id):
            state, events, _ = await commit_run(app[ctx.STORE], run.copy(), apply, trace, booking)
    except BaseException as exc:
        if booking is not None:  # the run could not take it: the ledgers still must (spooled if the store is down)
            await book_alone(governor, booking, exc)
        raise
    append_trace_file(app[ctx.LIVE].config.trace_file, events)
    return state
