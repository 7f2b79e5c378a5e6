"""Rate limits of teams and keys: what the governor claims, and what clients are told.

The store checks and spends them in the admission step (`Claim.rates`, GCRA: see
`gateway.store.base.RateLimit`); this module turns a team's config into those claims, the
store's clocks into OpenAI's `x-ratelimit-*` headers, and a refusal into a 429
`rate_limit_exceeded` that SDKs retry by themselves (docs/limits.md).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

from aiohttp import web
from multidict import istr

from gateway.config.rates import RateLimits
from gateway.config.settings import TeamConfig
from gateway.server.http.errors import RateLimited
from gateway.store.base import RATE_SLACK_S, RateKind, RateLimit, RateState, TokenCharge, rate_refusal

T = TypeVar("T")
IN_FLIGHT_RETRY_S = 1.0
"""What a refusal for calls in flight asks the client to wait (no clock says when one ends)."""

Pairs = tuple[tuple[str, str], ...]
"""Headers as (name, value) pairs, in order."""
SHOWN: Final = web.RequestKey("rate_limit_headers", Pairs)
"""The x-ratelimit-* headers of the call's admission, shown on its answer (`show`)."""


def keep(request: web.Request, shown: Pairs) -> None:
    """Remember a governed call's rate-limit headers (`pairs` of its admission's clocks) for
    its answer (`show`); nothing at all for a team without rate limits."""
    if shown:
        request[SHOWN] = shown


async def show(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a governed call's answer carries its rate-limit headers (those
    a refusal set already, with its own figures, stay)."""
    shown = request.get(SHOWN)
    if shown is not None:  # `keep` sets it only for a call with rate limits
        out = response.headers
        if _LIMIT_REQUESTS in out or _LIMIT_TOKENS in out:
            for name, value in shown:
                out.setdefault(name, value)
        else:
            out.extend(shown)  # one call: every answer of a limited team pays for this


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
    if team.caller is not None and team.caller.limits is not None:
        out.append(_claim(team.caller.scope, team.caller.limits))
    if team.rate_limits is not None:
        out.append(_claim("team:" + team.name, team.rate_limits))
    return tuple(out)


def _claim(scope: str, limits: RateLimits) -> RateLimit:
    return RateLimit(scope, limits.window_s, limits.requests, limits.tokens, limits.max_in_flight)


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    return _duration_ms(math.ceil(seconds * 1000))


def _duration_ms(ms: int) -> str:
    if ms < 1000:  # the usual reset of a limit far from reached
        return f"{ms}ms" if ms > 0 else "0ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def headers(rates: Sequence[RateLimit], states: Sequence[RateState]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the tightest scope of each kind
    (reset: until the scope's bucket is full again)."""
    return dict(pairs(rates, states))


_REQUEST_NAMES, _TOKEN_NAMES = (
    (istr(f"x-ratelimit-limit-{kind}"), istr(f"x-ratelimit-remaining-{kind}"), istr(f"x-ratelimit-reset-{kind}"))
    for kind in ("requests", "tokens"))
"""The headers' names (limit, remaining, reset) per kind, made once as `istr` (aiohttp's
header dicts skip folding their case)."""
_LIMIT_REQUESTS, _LIMIT_TOKENS = _REQUEST_NAMES[0], _TOKEN_NAMES[0]


Tightest = tuple[int, int, int]
"""A kind's figures on the answer: (limit, remaining, milliseconds until its bucket is full)."""


def room(per: float, ahead: float, window_s: float) -> float:
    """How many calls (or tokens) of `per` seconds each still fit on a clock `ahead` of now."""
    if ahead < 0.0:
        ahead = 0.0
    left = (window_s + RATE_SLACK_S - ahead) / per
    return left if left > 0.0 else 0.0


def _tighter(best: Tightest | None, cap: int, per: float, ahead: float, window_s: float) -> Tightest:
    """`best`, or the clock `ahead` of now (per call or token `per` seconds) if it leaves less."""
    left = math.floor(room(per, ahead, window_s))
    left = cap if left > cap else left
    return (cap, left, math.ceil(ahead * 1000) if ahead > 0.0 else 0) if best is None or left < best[1] else best


def _shown(names: tuple[istr, istr, istr], figures: Tightest) -> tuple[tuple[str, str], ...]:
    return (names[0], str(figures[0])), (names[1], str(figures[1])), (names[2], _duration_ms(figures[2]))


@functools.lru_cache(maxsize=4096)
def _made(requests: Tightest | None, tokens: Tightest | None) -> tuple[tuple[str, str], ...]:
    """The pairs that show these figures. A limit far from reached shows the same few figures
    call after call (its whole window left, reset in a millisecond or two): made once."""
    return (_shown(_REQUEST_NAMES, requests) if requests is not None else ()) + (
        _shown(_TOKEN_NAMES, tokens) if tokens is not None else ())


def pairs(rates: Sequence[RateLimit], states: Sequence[RateState]) -> Pairs:
    """`headers` as (name, value) pairs, in that order. Built for every answer of a limited
    team: one pass over the scopes for the figures, then their strings, made once (`_made`)."""
    if len(rates) == 1 and len(states) == 1:
        return one_scope(rates[0], states[0].requests_tat, states[0].tokens_tat, states[0].now)
    requests: Tightest | None = None
    tokens: Tightest | None = None
    for limit, state in zip(rates, states, strict=True):
        if limit.requests_s is not None:
            requests = _tighter(requests, limit.requests or 0, limit.requests_s, state.requests_tat - state.now,
                                limit.window_s)
        if limit.tokens_s is not None:
            tokens = _tighter(tokens, limit.tokens or 0, limit.tokens_s, state.tokens_tat - state.now, limit.window_s)
    return _made(requests, tokens)


def one_scope(limit: RateLimit, requests_tat: float, tokens_tat: float, now: float) -> Pairs:
    """`pairs` of one scope's clocks, with no loop to set up (every answer of a limited team
    that is not served a full bucket's headers makes these)."""
    requests = None if limit.requests_s is None else _tighter(None, limit.requests or 0, limit.requests_s,
                                                              requests_tat - now, limit.window_s)
    tokens = None if limit.tokens_s is None else _tighter(None, limit.tokens or 0, limit.tokens_s,
                                                          tokens_tat - now, limit.window_s)
    return _made(requests, tokens)


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
    if actual is None or actual == counted or not rates:
        return ()
    more = actual - counted
    return tuple([TokenCharge(r.scope, more, r.tokens_s) for r in rates if r.tokens_s is not None])
