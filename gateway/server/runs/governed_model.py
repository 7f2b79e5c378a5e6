"""`UpstreamModel`: the harness `Model` over the upstream client, governed like a pass-through call.

Server-side runs ask it for each turn. Every call is admitted by the governor first (team
reservation; in strict mode `max_tokens` clamped to what the run's remaining budget,
`ModelRequest.budget_remaining_usd`, and the team's can pay for), then settled with the
actual cost, or released if the upstream fails. Raises `LimitExceeded` (429 kinds) when
the budget refuses the call and `UpstreamError` when the upstream fails. A rate-limit
refusal is waited out, `defaults.rate_limit_wait_s` in all per turn; past that it is
raised (`RateLimited`) and the run stops, interrupted and resumable (driver).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.config.settings import Config, ModelRoute, TeamConfig
from gateway.harness.model import LimitReached, ModelReply, ModelRequest
from gateway.harness.state import RunState, public_run_id
from gateway.providers.errors import UpstreamError
from gateway.providers.failover import RoutedCall
from gateway.providers.reply import response_model
from gateway.server import context as ctx
from gateway.server.http.errors import ApiError, LimitExceeded, NotFound
from gateway.server.metrics import Metrics
from gateway.server.runs import rate_limits
from gateway.server.runs.forwarding import complete_chat
from gateway.server.runs.governor import Admission, Ask, Governor
from gateway.server.runs.run_spans import chat_outcome
from gateway.server.runs.replies import checked_usage
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.telemetry.tracing import ChatSpan, Tracing


class UpstreamModel:
    """One run's model: the policy is fixed, the model name comes per request, and the team
    and budget mode are those of the config served when each turn starts (`for_run`)."""

    def __init__(self, *, config: Config, upstreams: ctx.Upstreams, governor: Governor, metrics: Metrics,
                 counter: TokenCounter, team: TeamConfig, policy: str, strict: bool) -> None:
        self.config = config
        self.upstreams = upstreams
        self.governor = governor
        self.metrics = metrics
        self.counter = counter
        self.team = team
        self.policy = policy
        self.strict = strict
        self.user: str | None = None
        """The user its turns are held to and spent by (the run's, `RunState.user`)."""
        self.tracing: Tracing | None = None
        """Each turn a `chat {model}` span (tracing on)."""
        self._live: ctx.Live | None = None  # the config served now (`for_run`), and how to read the run's team in it
        self._governing: Callable[[], tuple[Config, TeamConfig, bool]] | None = None

    @classmethod
    def for_run(cls, app: web.Application, state: RunState) -> UpstreamModel:
        """The model of a run served by `app` (its team and budget mode from config and policy).
        A reload during the drive applies from the next turn on (the turn in flight keeps the
        config it started with), as it does for the next pass-through call."""
        config, team, strict = _governing(app, state)
        model = cls(config=config, upstreams=app[ctx.UPSTREAMS], governor=app[ctx.GOVERNOR], metrics=app[ctx.METRICS],
                    counter=app[ctx.COUNTER], team=team, policy=state.policy, strict=strict)
        model.user = state.user
        model.tracing = app.get(ctx.TRACING)
        model._live, model._governing = app[ctx.LIVE], lambda: _governing(app, state)
        return model

    def _follow_reload(self) -> None:
        """A config reload since the last turn: the team and mode as the new config has them
        (409 `team_not_found` when it has no such team any more)."""
        if self._live is not None and self._governing is not None and self._live.config is not self.config:
            self.config, self.team, self.strict = self._governing()

    def route(self, model: str) -> ModelRoute:
        route = self.config.route(model)
        if route is None:
            raise NotFound(f"model '{model}' is not routed by this gateway", code="model_not_found", param="model")
        return route

    def body(self, request: ModelRequest, max_tokens: int | None, model: str | None = None) -> bytes:
        body: dict[str, Any] = {**request.extra, "model": model or request.model, "messages": request.messages}
        if request.tools:
            body["tools"] = request.tools
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.pop("stream", None)
        return orjson.dumps(body)

    async def complete(self, request: ModelRequest) -> ModelReply:
        """One turn over the route's deployments and fallbacks (held at the dearest of them,
        booked at the price of the one that answered). An `UpstreamError` carries the trace
        fields of the failed attempts (`attempts`), which the driver writes. With tracing on,
        the turn is a `chat {model}` span: its attempts nest under it.

        Once admitted, the call is never abandoned: stopped (a Stop, a lost lease, the run's
        deadline), it returns at once, but goes on in the background and books its answer on
        the team's ledger when it comes (or releases its hold if the upstream fails), since
        the upstream is paid for an answer whether or not anyone reads it. The run, which
        stopped without that answer, does not count it."""
        self._follow_reload()
        if self.tracing is None:
            return await self._complete(request, None)
        span = self.tracing.chat(request.model, run_id=public_run_id(request.run_id), team=self.team.name,
                                 policy=self.policy, messages=request.messages)
        with chat_outcome(span):
            return await self._complete(request, span)

    async def _complete(self, request: ModelRequest, span: ChatSpan | None) -> ModelReply:
        route = self.route(request.model)
        metrics = self.metrics
        routed = self.upstreams.call(route, request.model, lambda a: metrics.on_attempt(a.upstream, a.outcome))
        ask = Ask(route.price, request.messages, request.tools or None, request.max_tokens, model=request.model,
                  user=self.user, policy=self.policy)
        asked = time.perf_counter()
        try:
            admission = await rate_limits.waiting(
                lambda: self.governor.admit_call(request.run_id, self.team, self.strict, ask,
                                                 request.budget_remaining_usd, fit=request.fit_budget),
                self.config.defaults.rate_limit_wait_s)
        except LimitExceeded as exc:
            if request.fit_budget and exc.kind == "budget_exceeded":  # the run's own budget: it asks a person
                raise LimitReached(exc.message) from None
            raise
        call = asyncio.ensure_future(self._forward(request, admission, routed, span, asked))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self.governor.finish_in_background(call, request.run_id)
            raise

    async def _forward(self, request: ModelRequest, admission: Admission, routed: RoutedCall,
                       span: ChatSpan | None, asked: float) -> ModelReply:
        """The admitted call: forwarded, its usage checked, its cost booked (and, tracing on,
        told to its span; one the run gave up has ended: the rest of the call is not in it)."""
        async with admission as adm:
            if span is not None and span.recording:
                span.admitted(time.perf_counter() - asked, adm.max_tokens or request.max_tokens)
            max_tokens = adm.max_tokens or request.max_tokens
            sent: list[bytes] = []  # the body of each attempt: the last one is what was answered

            def body_for(model: str) -> bytes:
                sent.append(self.body(request, max_tokens, model))
                return sent[-1]

            try:  # a malformed reply is an UpstreamError: nothing to pay for
                reply, parsed, upstream = await complete_chat(routed, body_for, None)
            except UpstreamError as exc:
                exc.attempts = [a.fields() for a in routed.attempts]
                raise
            message = parsed.message
            checked = checked_usage(parsed.usage, counter=self.counter, messages=request.messages,
                                    tools=request.tools or None, replies=[message], body_bytes=len(sent[-1]),
                                    allowed_completion=adm.allowed_completion, n=1, counted_prompt=adm.prompt_tokens)
            self.metrics.on_usage_clamped(upstream.name, checked.clamped)
            usage = checked.usage
            assert routed.answer is not None
            cost = routed.answer.price.cost(usage)
            settling = time.perf_counter()
            await self.governor.settle(adm, cost, usage.total_tokens)
            if span is not None:
                span.booked(usage=usage, cost_usd=cost, finish=parsed.finish_reason, upstream=upstream,
                            deployment=routed.answer.model, response_model=response_model(reply.data),
                            seconds=time.perf_counter() - settling)
                span.output(message)
        self.metrics.on_upstream(upstream.name, request.model, reply.seconds)
        self.metrics.on_tool_call_repairs(upstream.name, reply.repairs)
        self.metrics.on_turn(self.team.name, self.policy, request.model, usage, cost)
        return ModelReply(message, usage, parsed.finish_reason, reported=checked.reported, upstream=upstream.name,
                          cost_usd=cost, attempts=tuple(a.fields() for a in routed.attempts),
                          repairs=tuple(r.to_json() for r in reply.repairs))


def _governing(app: web.Application, state: RunState) -> tuple[Config, TeamConfig, bool]:
    """The config served now, the run's team in it (seen through the key that started the run,
    while that key may still be used) and whether its turns are held in strict mode."""
    config = app[ctx.LIVE].config
    team = config.team(state.team)
    if team is None:
        raise ApiError(f"run {state.public_id} belongs to team '{state.team}', which the config no longer has",
                       status=409, type="conflict_error", code="team_not_found")
    strict = team.budget_mode == "strict" or state.limits.budget_mode == "strict"
    # The key that started the run, while it may still be used (its budget and rate limits
    # hold every turn, wherever the run is driven); else the team alone.
    view = app[ctx.KEYRING].view_by_id(state.key_id) if state.key_id else None
    if view is not None and view.name == team.name:
        team = view
    return config, team, strict
