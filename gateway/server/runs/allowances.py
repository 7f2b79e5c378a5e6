"""Rate allowances: the requests and tokens a process takes from a scope's clocks ahead of its calls.

A limited call far from its limits does not need a store step of its own for its clocks.
When the last clocks this process saw leave a scope much room, the claim of one call also
takes some of the next calls' requests and tokens (`RateLimit.spending`), and the following
calls of the same scopes spend them here, with a claim that only checks their calls in
flight (`RateLimit.in_flight_only`) besides their reservation and budget.

Limits stay exact across replicas: what a process takes is spent on the store's clocks
when it takes it, so all replicas together never admit more than a limit allows. What a
process holds and does not use is only unavailable to the others for a while:

- it takes at most 1/SHARE of the room its last clocks showed, and at most MAX_SPARE
  requests; below 2 x SHARE requests (or calls' worth of tokens) of room it takes nothing
  ahead, so calls near a limit are checked one by one, as without allowances;
- it spends what it holds for FRESH_S at most after taking it (then the next call's claim
  goes to the store, which also refreshes the clocks the answers' headers show);
- it gives back what it still holds once idle for FRESH_S (`Allowances.idle`, pushed back
  with `Store.push_clocks`), and when it stops. A process that dies keeps its part until
  the scope's bucket is full again.

A booking that used more tokens than its call counted pays the difference from the
allowance while it lasts, and books only the rest on the store's clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from gateway.server.runs import rate_limits
from gateway.store.base import ClockPush, RateLimit, RateState, TokenCharge

SHARE: Final = 64
"""A process takes ahead at most 1/SHARE of a scope's room, and only when that is two
requests (or, for tokens, two calls' worth) or more."""
MAX_SPARE: Final = 16
"""The most requests a process takes ahead of its calls, per set of scopes."""
FRESH_S: Final = 1.0
"""How long what a process took may serve its calls, and how long it may lie unused before
it is given back."""


@dataclass
class Allowance:
    """What this process holds of one set of scopes (a key's and its team's, as a call claims
    them): taken together, spent together, so one count of each kind serves them all."""

    rates: tuple[RateLimit, ...]
    checked: tuple[RateLimit, ...]
    """What a call served from the allowance still claims: each scope's calls in flight."""
    requests: int = 0
    tokens: int = 0
    asked_requests: int = 0
    """Spare requests asked for by claims still in the store step (not held yet)."""
    asked_tokens: int = 0
    states: tuple[RateState, ...] = ()
    """The scopes' clocks after the last claim that took some ahead (what it took included)."""
    taken_at: float = 0.0
    used_at: float = 0.0
    per_call: float = 0.0
    """Tokens a call of these scopes really uses, on average (0: none booked yet)."""
    full: rate_limits.Pairs | None = None
    """The headers of a full bucket (of one scope): the same whatever the time."""
    no_spare_until: float = 0.0
    """The last clocks left too little room to take anything ahead: not asked again until then."""
    limits_requests: bool = False
    limits_tokens: bool = False
    clocked: bool = False

    def __post_init__(self) -> None:
        self.clocked = self.limits_requests or self.limits_tokens

    def shown(self, now: float) -> rate_limits.Pairs:
        """The x-ratelimit-* headers of the clocks as if this process held nothing ahead."""
        if len(self.states) == 1:  # one scope (a team's limits alone): no clocks to make
            limit = self.rates[0]
            requests_tat, tokens_tat = self.unheld(limit, self.states[0])
            if requests_tat <= now and tokens_tat <= now:  # a full bucket: the same headers whenever
                if self.full is None:
                    self.full = rate_limits.one_scope(limit, now, now, now)
                return self.full
            return rate_limits.one_scope(limit, requests_tat, tokens_tat, now)
        return rate_limits.pairs(self.rates, self.clocks(now))

    def clocks(self, now: float) -> tuple[RateState, ...]:
        """The clocks as if this process held nothing ahead."""
        return tuple(RateState(state.scope, now, *self.unheld(limit, state))
                     for limit, state in zip(self.rates, self.states, strict=True))

    def unheld(self, limit: RateLimit, state: RateState) -> tuple[float, float]:
        """A scope's (requests, tokens) clocks of `states` without what this process holds."""
        return (state.requests_tat - self.requests * (limit.requests_s or 0.0),
                state.tokens_tat - self.tokens * (limit.tokens_s or 0.0))


class Take(NamedTuple):
    """How one call is admitted against its scopes' clocks: `rates` and `tokens` are what its
    claim spends in the store step; the rest it took from the allowance. (A NamedTuple: one
    is made on every call of a limited team.)"""

    allowance: Allowance
    rates: tuple[RateLimit, ...]
    tokens: int
    own_requests: int = 0
    """The call's own request, taken from the allowance (1) or from the store (0)."""
    own_tokens: int = 0
    """Of the call's counted tokens, those taken from the allowance."""
    spare_requests: int = 0
    spare_tokens: int = 0

    @property
    def local(self) -> bool:
        """True when the claim spends no clock at all (everything came from the allowance)."""
        return self.rates is self.allowance.checked

    @property
    def plain(self) -> bool:
        """True when the claim is what the call would claim without allowances."""
        return not (self.local or self.own_requests or self.own_tokens or self.spare_requests or self.spare_tokens)


class Allowances:
    """The allowances of this process, by set of scopes (`rates` of `Governor.rates`)."""

    def __init__(self) -> None:
        self._by_rates: dict[tuple[RateLimit, ...], Allowance] = {}
        self._spending: dict[tuple[RateLimit, int], RateLimit] = {}

    def _allowance(self, rates: tuple[RateLimit, ...]) -> Allowance:
        found = self._by_rates.get(rates)
        if found is None:
            checked = tuple(r for r in (limit.in_flight_only() for limit in rates) if r is not None)
            found = self._by_rates[rates] = Allowance(
                rates, checked, limits_requests=any(r.requests_s is not None for r in rates),
                limits_tokens=any(r.tokens_s is not None for r in rates))
        return found

    def take(self, rates: tuple[RateLimit, ...], tokens: int, now: float) -> Take | None:
        """The claim of one call of `rates` counted for `tokens`: from the allowance what it
        holds (while fresh), from the store the rest plus, far from the limits, some spare.
        None when there is nothing to take ahead, and the call claims its limits as they are:
        its scopes have no clocks (`max_in_flight` alone), or are near a limit and nothing is
        held (until `no_spare_until`, when a claim through the allowance looks again)."""
        a = self._by_rates.get(rates) or self._allowance(rates)
        if not a.clocked or (now < a.no_spare_until and not a.requests and not a.tokens):
            return None
        fresh = bool(a.states) and now - a.taken_at < FRESH_S
        own_r = 1 if fresh and a.limits_requests and a.requests >= 1 else 0
        own_t = min(tokens, a.tokens) if fresh and a.limits_tokens else 0
        need_r = a.limits_requests and not own_r
        need_t = a.limits_tokens and own_t < tokens
        a.requests -= own_r
        a.tokens -= own_t
        a.used_at = now
        if not need_r and not need_t:
            return Take(a, a.checked, 0, own_r, own_t)
        if now < a.no_spare_until:  # near a limit: the claims go one by one for a while
            spare_r = spare_t = 0
        else:
            spare_r, spare_t = self._spare(a, tokens, now)
            if not spare_r and not spare_t and a.states:
                a.no_spare_until = now + FRESH_S
        a.asked_requests += spare_r
        a.asked_tokens += spare_t
        n_r = (0 if own_r else 1) + spare_r
        if n_r == 1:  # one request, as without allowances: the limits as they are
            claimed = rates
        else:
            claimed = tuple(self._spends(r, n_r) if r.requests_s is not None else r for r in rates)
        return Take(a, claimed, tokens - own_t + spare_t, own_r, own_t, spare_r, spare_t)

    def _spends(self, limit: RateLimit, requests: int) -> RateLimit:
        key = (limit, requests)
        found = self._spending.get(key)
        if found is None:
            if len(self._spending) > 4096:  # limits from config: a few per team and key
                self._spending.clear()
            found = self._spending[key] = limit.spending(requests)
        return found

    def _spare(self, a: Allowance, tokens: int, now: float) -> tuple[int, int]:
        """What to take ahead: a share of the room the last clocks showed, less what is held
        or asked for already; nothing before the first clocks."""
        if not a.states:
            return 0, 0
        requests = MAX_SPARE
        room_t: float = math.inf
        for limit, state in zip(a.rates, a.states, strict=True):
            requests_tat, tokens_tat = a.unheld(limit, state)
            if limit.requests_s is not None:
                room = int(rate_limits.room(limit.requests_s, requests_tat - now, limit.window_s))
                requests = min(requests, room // SHARE if room >= 2 * SHARE else 0)
            if limit.tokens_s is not None:
                room_t = min(room_t, rate_limits.room(limit.tokens_s, tokens_tat - now, limit.window_s) / SHARE)
        spare_r = max(0, requests - a.requests - a.asked_requests) if a.limits_requests else 0
        spare_t = 0
        if a.limits_tokens:
            calls = (a.requests + a.asked_requests + spare_r) if a.limits_requests else MAX_SPARE
            per_call = a.per_call or tokens
            want = min(math.ceil(calls * per_call), int(room_t))
            if room_t >= 2 * per_call:
                spare_t = max(0, want - a.tokens - a.asked_tokens)
        return spare_r, spare_t

    def granted(self, take: Take, states: Sequence[RateState], now: float) -> rate_limits.Pairs:
        """A claim of `take` was granted, its clocks now `states` (empty: it spent none):
        hold what it took ahead; returns the x-ratelimit-* headers its answer shows."""
        a = take.allowance
        if take.local:
            return a.shown(now)
        a.asked_requests -= take.spare_requests
        a.asked_tokens -= take.spare_tokens
        a.requests += take.spare_requests
        a.tokens += take.spare_tokens
        a.states = tuple(states)
        a.taken_at = now
        return a.shown(now)

    def refused(self, take: Take) -> None:
        """A claim of `take` was refused: nothing it asked for is held, and what the call took
        from the allowance is the allowance's again."""
        a = take.allowance
        a.requests += take.own_requests
        a.tokens += take.own_tokens
        a.asked_requests -= take.spare_requests
        a.asked_tokens -= take.spare_tokens

    def plain(self, rates: tuple[RateLimit, ...], tokens: int) -> Take:
        """The claim of one call as without allowances (after a refusal of one with)."""
        return Take(self._allowance(rates), rates, tokens)

    @staticmethod
    def charges(a: Allowance | None, rates: tuple[RateLimit, ...], counted: int,
                actual: int | None) -> tuple[TokenCharge, ...]:
        """What a booking reconciles on the store's token clocks: the tokens used beyond those
        counted, less what the allowance `a` (the call's, if it was admitted through one) pays
        for; tokens used below the count go back to the store's clocks, as without allowances."""
        if actual is None or not rates:
            return ()
        if a is not None and a.limits_tokens:
            a.per_call = actual if not a.per_call else a.per_call * 0.8 + actual * 0.2
            more = actual - counted
            if 0 < more <= a.tokens:  # all of it paid ahead: nothing to book on the clocks
                a.tokens -= more
                return ()
            if more > 0 and a.tokens > 0:
                counted += a.tokens
                a.tokens = 0
        return rate_limits.charges(rates, counted, actual)

    def idle(self, now: float, idle_s: float = FRESH_S) -> list[ClockPush]:
        """Give back what allowances unused for `idle_s` hold (all of it with idle_s=0): the
        pushes that take it off the store's clocks."""
        out: list[ClockPush] = []
        for a in self._by_rates.values():
            if (a.requests or a.tokens) and now - a.used_at >= idle_s and now - a.taken_at >= idle_s:
                for limit in a.rates:
                    requests_s = -a.requests * (limit.requests_s or 0.0)
                    tokens_s = -a.tokens * (limit.tokens_s or 0.0)
                    if requests_s or tokens_s:
                        out.append(ClockPush(limit.scope, requests_s, tokens_s))
                a.requests = a.tokens = 0
        return out
