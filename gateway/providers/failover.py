"""One call over a route plan: attempts, retries with backoff, fallbacks, the total deadline.

`RoutedCall.complete` (a non-streamed answer) and `RoutedCall.stream` (an SSE answer) make
attempts until one answers, a failure that is not worth another attempt happens (a 4xx, a
malformed answer), the attempt cap (1 + `retries`) is reached or the route's deadline passes;
then the last failure is raised. Retried: connection failures, timeouts before the first
byte, 429 and 5xx (`routing.RETRYABLE`). A stream is retried only until its first event
arrives: nothing reaches the client before that, and nothing is ever retried after.

Before another attempt on a deployment already tried in this call, the call backs off
(`BACKOFF_BASE_S` doubling, jittered, at most `BACKOFF_MAX_S`) and waits out the upstream's
`retry-after`; a wait longer than `MAX_WAIT_S` or past the deadline ends the call instead.
A move to another deployment or fallback does not wait.

Every attempt is recorded (`Attempt`, in `attempts` and through `on_attempt`) and updates the
deployment's health in the shared `Router`. With an `AttemptTracer` (telemetry on), each
attempt is also a span, current while the attempt runs: the upstream is sent its `traceparent`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from gateway.harness.trace import UpstreamAttemptFields
from gateway.harness.usage import Price
from gateway.providers.routing import RETRYABLE, Deployment, Outcome, Pick, RoutePlan, Router
from gateway.providers.errors import UpstreamError
from gateway.providers.upstream import Upstream, UpstreamStream

__all__ = ["Answer", "Attempt", "AttemptEnd", "AttemptTracer", "Opened", "RoutedCall", "outcome_of"]

BACKOFF_BASE_S = 0.1
BACKOFF_MAX_S = 2.0
MAX_WAIT_S = 10.0
"""The longest a call waits before another attempt (a `retry-after`, a cooling deployment)."""

R = TypeVar("R")


def outcome_of(exc: UpstreamError) -> Outcome:
    """The attempt outcome an upstream failure stands for."""
    code, status = exc.code, exc.upstream_status
    if code == "upstream_status":
        if status == 429:
            return "rate_limited"
        return "server_error" if status is not None and status >= 500 else "denied"
    return {"upstream_unreachable": "unreachable", "upstream_timeout": "timeout", "upstream_rejected": "rejected",
            "content_filter": "rejected", "upstream_cut": "cut",
            "upstream_misconfigured": "misconfigured"}.get(code or "", "malformed")  # type: ignore[return-value]


@dataclass(frozen=True)
class Attempt:
    """One attempt of a call: where it went and how it ended."""

    number: int
    upstream: str
    model: str
    outcome: Outcome
    seconds: float
    status: int | None = None
    retry_after_s: float | None = None
    fallback: bool = False
    probe: bool = False

    def fields(self) -> UpstreamAttemptFields:
        """The fields of its `upstream_attempt` trace event (docs/trace-events.md)."""
        return {"attempt": self.number, "upstream": self.upstream, "model": self.model, "outcome": self.outcome,
                "status": self.status, "seconds": round(self.seconds, 6), "retryAfterS": self.retry_after_s,
                "fallback": self.fallback, "probe": self.probe}


@dataclass(frozen=True)
class Answer:
    """Who answered: the deployment (its price is what the turn costs), its upstream client
    and the model name it was asked for."""

    deployment: Deployment
    upstream: Upstream
    model: str

    @property
    def price(self) -> Price:
        return self.deployment.price


@dataclass
class Opened:
    """A stream that produced its first event: the rest follow from `events`. The caller sets
    `outcome` when it ends the stream for a reason of the upstream's (a malformed chunk)."""

    answer: Answer
    first: bytes
    rest: AsyncIterator[bytes]
    outcome: Outcome = "ok"

    async def events(self) -> AsyncIterator[bytes]:
        yield self.first
        async for event in self.rest:
            yield event


AttemptSink = Callable[[Attempt], None]
AttemptEnd = Callable[[Attempt | None], None]
"""Ends an attempt's span: with how it went, or None when the caller gave it up."""


class AttemptTracer(Protocol):
    """Told as each attempt starts (`gateway.telemetry.tracing.Tracing` makes it a span)."""

    def begin(self, number: int, upstream: Upstream, model: str, fallback: bool, probe: bool) -> AttemptEnd: ...

_ANSWERED: frozenset[str] = frozenset({"upstream_malformed", "upstream_cut", "upstream_error"})
"""Failures of an upstream that did answer: a glob route's failure names the route for the others."""


@dataclass
class RoutedCall:
    """One call routed over `plan` for the model name the client asked for."""

    plan: RoutePlan
    model: str
    router: Router
    upstream_for: Callable[[str], Upstream]
    on_attempt: AttemptSink = lambda attempt: None
    clock: Callable[[], float] = time.monotonic
    attempts: list[Attempt] = field(default_factory=list)
    answer: Answer | None = None  # who answered, once one did
    abandoned: Answer | None = None  # who was being asked when the caller gave the call up (its client left)
    traced: bool = False  # set by whoever wrote the attempts into the run's trace
    tracer: AttemptTracer | None = None
    route: str | None = None
    """The glob of the route that matched the model (None: a route by name), named by the
    failure that ends the call, so a typo'd model sent to a catch-all says so."""
    _tried: list[Deployment] = field(default_factory=list)
    _started: float | None = None
    _span_end: AttemptEnd | None = None  # the span of the attempt in progress (telemetry on)

    @property
    def api(self) -> str:
        """The API every upstream of the plan speaks (config checks they agree)."""
        return self.upstream_for(self.plan.groups[0].deployments[0].upstream).config.api

    def _left(self) -> float | None:
        if self.plan.deadline_s is None or self._started is None:
            return None
        return self._started + self.plan.deadline_s - self.clock()

    def _ended(self, exc: UpstreamError) -> UpstreamError:
        """The failure that ends the call before any answer, naming the glob route that sent
        the model where it failed (`route '*' (model 'gpt-4o-mni') -> upstream 'local' is ...`)
        when the name may be the reason: the upstream could not be reached or refused the call
        (a reply that came but was broken is the upstream's, whatever the name)."""
        if (self.route is not None and exc.code not in _ANSWERED
                and not exc.message.startswith("route '")):
            exc.message = f"route '{self.route}' (model '{self.model}') -> {exc.message}"
            exc.args = (exc.message,)
        return exc

    async def _next(self, last: UpstreamError | None) -> Pick:
        """The next attempt's pick, once its wait is over; raises `last` when the call must end."""
        if self._started is None:
            self._started = self.clock()
        elif len(self.attempts) > self.plan.retries:
            assert last is not None
            raise self._ended(last)
        pick = self.router.pick(self.plan, self.model, self._tried, self.clock())
        wait = pick.wait_s
        if pick.deployment in self._tried:
            wait = max(wait, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (len(self.attempts) - 1))
                       * (0.5 + random.random() / 2))
        left = self._left()
        if wait > MAX_WAIT_S or (left is not None and wait >= left):
            self.router.abandoned(pick)
            if last is not None:
                raise self._ended(last)
            raise self._ended(UpstreamError("upstream_unavailable", f"every deployment of model '{self.model}' is "
                                            f"cooling down after failures (the first is back in {wait:.1f}s)",
                                            pick.deployment.upstream, None, retry_after_s=wait))
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except BaseException:
                self.router.abandoned(pick)
                raise
        return pick

    def _timeout_for(self, upstream: Upstream, stream: bool) -> tuple[float | None, str, float | None]:
        """How long this attempt may take before the first byte (streams) or in all, and what
        to call it if it does not (`Upstream.timeout`'s words and seconds)."""
        left = self._left()
        first = upstream.config.first_byte_timeout_s if stream else None
        if left is not None and (first is None or left < first):
            return max(0.0, left), "the route's deadline", self.plan.deadline_s
        if first is not None:
            return first, "no first event", first
        return None, "the route's deadline", self.plan.deadline_s

    def _record(self, pick: Pick, outcome: Outcome, started: float, exc: UpstreamError | None = None) -> None:
        now = self.clock()
        retry_after = exc.retry_after_s if exc is not None else None
        self.router.finished(pick.deployment, outcome, self.plan.breaker, now, retry_after)
        attempt = Attempt(len(self.attempts) + 1, pick.deployment.upstream, pick.model, outcome, now - started,
                          exc.upstream_status if exc is not None else 200, retry_after, pick.group > 0, pick.probe)
        self.attempts.append(attempt)
        self._tried.append(pick.deployment)
        self.on_attempt(attempt)
        self._end_span(attempt)

    def _end_span(self, attempt: Attempt | None) -> None:
        end, self._span_end = self._span_end, None
        if end is not None:
            end(attempt)

    @property
    def sent_to(self) -> Answer | None:
        """Who answered, else who had the request when the call was abandoned mid-attempt
        (its price is what the prompt the upstream was sent costs); None: nobody has it."""
        return self.answer or self.abandoned

    def _released(self, pick: Pick) -> None:
        """An attempt the caller abandoned (cancelled): neither a success nor a failure."""
        self.abandoned = Answer(pick.deployment, self.upstream_for(pick.deployment.upstream), pick.model)
        health = self.router.health(pick.deployment)
        health.in_flight = max(0, health.in_flight - 1)
        health.probing = False
        self._end_span(None)

    async def _begin(self, last: UpstreamError | None,
                     stream: bool) -> tuple[Pick, Upstream, float | None, tuple[str, float | None], float]:
        """The next attempt, started: its pick, upstream, time limit, the words of its timeout
        if it passes, and when it started."""
        pick = await self._next(last)
        upstream = self.upstream_for(pick.deployment.upstream)
        limit, what, seconds = self._timeout_for(upstream, stream)
        self.router.started(pick.deployment)
        if self.tracer is not None:
            self._span_end = self.tracer.begin(len(self.attempts) + 1, upstream, pick.model, pick.group > 0,
                                               pick.probe)
        return pick, upstream, limit, (what, seconds), self.clock()

    async def complete(self, send: Callable[[Upstream, str], Awaitable[R]]) -> tuple[R, Answer]:
        """`send(upstream, model)` until one answers; the answer and who gave it."""
        last: UpstreamError | None = None
        while True:
            pick, upstream, limit, late, started = await self._begin(last, stream=False)
            try:
                async with asyncio.timeout(limit):
                    result = await send(upstream, pick.model)
            except UpstreamError as exc:
                last = exc
            except TimeoutError:
                last = upstream.timeout(*late)
            except BaseException:
                self._released(pick)
                raise
            else:
                self._record(pick, "ok", started)
                self.answer = Answer(pick.deployment, upstream, pick.model)
                return result, self.answer
            outcome = outcome_of(last)
            self._record(pick, outcome, started, last)
            if outcome not in RETRYABLE:
                raise self._ended(last)

    @asynccontextmanager
    async def stream(self, open_stream: Callable[[Upstream, str], AbstractAsyncContextManager[UpstreamStream]]
                     ) -> AsyncIterator[Opened]:
        """Open `open_stream(upstream, model)` until one yields a first event; that stream is
        never retried. Its attempt is recorded when the block ends (an `UpstreamError` out of
        it, a cut, is the attempt's outcome)."""
        last: UpstreamError | None = None
        while True:
            pick, upstream, limit, late, started = await self._begin(last, stream=True)
            stack = AsyncExitStack()
            first: bytes | None = None
            try:
                async with asyncio.timeout(limit):
                    opened = await stack.enter_async_context(open_stream(upstream, pick.model))
                    rest = opened.events()
                    first = await anext(rest, None)
                if first is None:
                    raise UpstreamError("upstream_cut", f"upstream '{upstream.name}' ended the stream before "
                                        "its first event", upstream.name, 200)
                break
            except UpstreamError as exc:
                last = exc
            except TimeoutError:
                last = upstream.timeout(*late)
            except BaseException:
                await stack.aclose()
                self._released(pick)
                raise
            await stack.aclose()
            outcome = outcome_of(last)
            self._record(pick, outcome, started, last)
            if outcome not in RETRYABLE:
                raise self._ended(last)
        self.answer = Answer(pick.deployment, upstream, pick.model)
        result = Opened(self.answer, first, rest)
        failure: UpstreamError | None = None
        try:
            async with stack:
                yield result
        except UpstreamError as exc:
            failure = exc
            raise
        finally:
            self._record(pick, outcome_of(failure) if failure is not None else result.outcome, started, failure)
