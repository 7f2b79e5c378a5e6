"""Rate limits of teams and keys: what the governor claims, and what clients are told.

The store checks and spends them in the admission step (`Claim.rates`, GCRA: see
`gateway.store.base.RateLimit`); this module turns a team's config into those claims, the
store's clocks into OpenAI's `x-ratelimit-*` headers, and a refusal into a 429
`rate_limit_exceeded` that SDKs retry by themselves (docs/limits.md).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

from aiohttp import web

from gateway.config.rates import RateLimits
from gateway.config.settings import TeamConfig
from gateway.server.http.errors import RateLimited
from gateway.store.base import RATE_SLACK_S, RateKind, RateLimit, RateState, TokenCharge, rate_refusal

T = TypeVar("T")
IN_FLIGHT_RETRY_S = 1.0
"""What a refusal for calls in flight asks the client to wait (no clock says when one ends)."""

SHOWN: Final = web.RequestKey("rate_limit_clocks", tuple[tuple[RateLimit, ...], tuple[RateState, ...]])
"""The rate limits of the call's admission and its clocks, shown on its answer (`show`)."""


async def show(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a governed call's answer carries its rate-limit headers."""
    shown = request.get(SHOWN)
    if shown and shown[0]:
        for name, value in headers(*shown).items():
            response.headers.setdefault(name, value)


async def waiting(admit: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """`admit()`, waiting out its rate-limit refusals as they ask, `wait_s` in all at most
    (a server-side model turn: nobody is there to retry it); past that, the refusal."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await admit()
        except RateLimited as exc:
            if exc.retry_after_s is None or loop.time() + exc.retry_after_s > deadline:
                raise
            await asyncio.sleep(exc.retry_after_s)  # the store's clocks say when the call fits


def claims(team: TeamConfig) -> tuple[RateLimit, ...]:
    """The store's rate limits for a call of `team` (its key's, then the team's)."""
    out: list[RateLimit] = []
    if team.caller is not None:
        out.append(_claim(team.caller.scope, team.caller.limits))
    if team.rate_limits is not None:
        out.append(_claim("team:" + team.name, team.rate_limits))
    return tuple(out)


def _claim(scope: str, limits: RateLimits) -> RateLimit:
    return RateLimit(scope, limits.window_s, limits.requests, limits.tokens, limits.max_in_flight)


def counts_tokens(rates: Sequence[RateLimit]) -> bool:
    return any(r.tokens is not None for r in rates)


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _left(tat: float, now: float, per_unit_s: float, window_s: float, limit: int) -> int:
    return max(0, min(limit, math.floor((window_s + RATE_SLACK_S - (max(tat, now) - now)) / per_unit_s)))


def headers(rates: Sequence[RateLimit], states: Sequence[RateState]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the tightest scope of each kind
    (reset: until the scope's bucket is full again)."""
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        best: tuple[int, int, float] | None = None
        for limit, state in zip(rates, states, strict=True):
            count = limit.requests if kind == "requests" else limit.tokens
            if count is None:
                continue
            per = limit.window_s / count
            tat = state.requests_tat if kind == "requests" else state.tokens_tat
            left = _left(tat, state.now, per, limit.window_s, count)
            if best is None or left < best[1]:
                best = (count, left, max(tat, state.now) - state.now)
        if best is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(best[0])
            out[f"x-ratelimit-remaining-{kind}"] = str(best[1])
            out[f"x-ratelimit-reset-{kind}"] = duration(best[2])
    return out


def refused(rates: Sequence[RateLimit], states: Sequence[RateState], tokens: int) -> RateLimited:
    """The 429 for a claim the store refused: the scope and kind that refused it, and how
    long until it would pass."""
    for limit, state in zip(rates, states, strict=True):
        kind = rate_refusal(limit, state, tokens)
        if kind is not None:
            return _refusal(kind, limit, state, tokens, headers(rates, states))
    # Another replica moved the clocks between the refusal and its figures: retry soon.
    return _refusal("in_flight", rates[0], states[0], tokens, headers(rates, states))


def _refusal(kind: RateKind, limit: RateLimit, state: RateState, tokens: int, shown: dict[str, str]) -> RateLimited:
    who = _who(limit.scope)
    per = "second" if limit.window_s == 1.0 else "minute" if limit.window_s == 60.0 else f"{limit.window_s:g} s"
    if kind == "in_flight":
        wait = IN_FLIGHT_RETRY_S
        what = f"{state.in_flight} calls in flight, its limit of {limit.max_in_flight} (max_in_flight)"
    elif kind == "requests":
        wait = max(state.requests_tat, state.now) + (limit.requests_s or 0.0) - state.now - limit.window_s
        what = f"its limit of {limit.requests} requests per {per}"
    else:
        wait = max(state.tokens_tat, state.now) + tokens * (limit.tokens_s or 0.0) - state.now - limit.window_s
        what = f"its limit of {limit.tokens} tokens per {per} (this call counts {tokens} tokens before its reply)"
    wait = max(wait, 0.001)
    message = (f"rate limit reached: {who} is at {what}; nothing was forwarded, retry in {duration(wait)}")
    return RateLimited(kind, message, wait, {**shown, "retry-after": str(max(1, math.ceil(wait))),
                                             "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
                                             "x-should-retry": "true"})


def too_large(rates: Sequence[RateLimit], tokens: int) -> RateLimited | None:
    """A call whose counted tokens exceed a whole window of a scope never passes: say so
    at once (not retryable) instead of asking the client to wait forever."""
    for limit in rates:
        if limit.tokens is not None and tokens > limit.tokens:
            per = "second" if limit.window_s == 1.0 else "minute" if limit.window_s == 60.0 else f"{limit.window_s:g} s"
            return RateLimited("tokens", f"request too large: it counts {tokens} tokens before its reply, more than "
                                         f"{_who(limit.scope)}'s whole limit of {limit.tokens} tokens per {per}; "
                                         "nothing was forwarded, send a shorter prompt", None,
                               {"x-should-retry": "false"})
    return None


def _who(scope: str) -> str:
    kind, _, name = scope.partition(":")
    return f"team '{name}'" if kind == "team" else "this API key"


def charges(rates: Sequence[RateLimit], counted: int, actual: int | None) -> tuple[TokenCharge, ...]:
    """What a booking reconciles: the tokens really used minus those counted at admission."""
    if actual is None or actual == counted:
        return ()
    return tuple(TokenCharge(r.scope, actual - counted, r.tokens_s) for r in rates if r.tokens_s is not None)
