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

import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.config.settings import Config, ModelRoute, TeamConfig
from gateway.harness.model import LimitReached, ModelReply, ModelRequest
from gateway.harness.state import RunState, public_run_id
from gateway.providers.errors import UpstreamError
from gateway.providers.reply import response_model
from gateway.server import context as ctx
from gateway.server.http.errors import ApiError, LimitExceeded, NotFound
from gateway.server.metrics import Metrics
from gateway.server.runs import rate_limits
from gateway.server.runs.forwarding import complete_chat
from gateway.server.runs.run_spans import chat_outcome
from gateway.server.runs.governor import Ask, Governor
from gateway.server.runs.replies import checked_usage
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.telemetry.tracing import ChatSpan, Tracing


class UpstreamModel:
    """One run's model: the team, policy and mode are fixed; the model name comes per request."""

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

    @classmethod
    def for_run(cls, app: web.Application, state: RunState) -> UpstreamModel:
        """The model of a run served by `app` (its team and budget mode from config and policy)."""
        config = app[ctx.CONFIG]
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
        model = cls(config=config, upstreams=app[ctx.UPSTREAMS], governor=app[ctx.GOVERNOR], metrics=app[ctx.METRICS],
                    counter=app[ctx.COUNTER], team=team, policy=state.policy, strict=strict)
        model.user = state.user
        model.tracing = app.get(ctx.TRACING)
        return model

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
        the turn is a `chat {model}` span: its attempts nest under it."""
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
        async with admission as adm:
            if span is not None:
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
