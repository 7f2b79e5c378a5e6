"""The governor: admits a model call against the run's limits and the team's budget.

Every call is admitted before it is forwarded and closed after it, exactly once:

    admit_turn(...)  a pass-through call: the run's turn slot, its calls in flight, its
                     budget (strict) and the team's budget, checked and held in ONE atomic
                     store step (`Store.admit`), so caps are exact across replicas
    admit_call(...)  a server-side run's model call: the team's budget only (the run is
                     driven under a lease by one replica, whose loop checks the run's caps)
    booking(...)     the actual cost, booked by `Store.commit_turn` with the run's save
    settle(...)      the actual cost booked on its own (server-side calls)
    release(...)     nothing booked (upstream error, cancel, nothing received)

An `Admission` is an async context manager: leaving it without a booking releases what it
holds, whatever the exit (error, cancellation, client gone). What it holds belongs to this
process (`owner`) and lives `ttl_s` unless renewed: the governor renews every hold of its
calls in flight every third of that, so a process that dies blocks nothing for longer, and
a restarted one releases its old holds at once (`release_owner`).

Reservations are sized for every choice (`n`): the prompt once plus `n` times the output
allowance. Modes: `turn` checks before the call (an overshoot is at most one turn per call
in flight, and only when a reply outgrows its allowance); `strict` clamps the upstream
`max_tokens` (per choice) to what the run's and the team's remaining budgets can pay for,
so spend never passes either budget, and refuses when that is zero.

Rate limits of the caller's key and team (`rate_limits`) are claimed in the same store
step: one request and the counted prompt against each scope's buckets, and a slot of its
calls in flight (the reservation itself, so it is released, renewed and expired with it);
the booking reconciles the tokens with the real usage. A refusal is `RateLimited` (429,
retryable), never a stop of the run. Far from its limits, a call's request and tokens come
from what an earlier claim of this process took ahead (`allowances`), and its claim only
checks its calls in flight.

Tokens are counted only where they change a decision: teams with a budget or a token
limit, and strict runs. A pass-through call of a team without either counts nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, cast

from gateway.config.settings import Defaults, TeamConfig
from gateway.harness.state import RunState, public_run_id
from gateway.harness.usage import Price, Usage
from gateway.providers.errors import UpstreamError
from gateway.server.http.errors import ApiError, Conflict, LimitExceeded
from gateway.server.runs import rate_limits
from gateway.server.runs.allowances import FRESH_S, Allowance, Allowances
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    Attribution,
    Booking,
    Hold,
    Claim,
    Figures,
    Grant,
    RateLimit,
    Store,
)
from gateway.store.errors import AlreadyBooked, RunNotFound, SpoolNotReady, StaleRun, StoreError
from gateway.store.periods import PeriodKind, period_key
from gateway.store.spool import BOOKING_ONLY, Spool, booking_json
from gateway.tokens import TokenCounter

log = logging.getLogger(__name__)

RESERVE_ATTEMPTS = 8
"""Strict reservations re-read the ledger and retry when a concurrent call got there first."""
MARGIN_USD = 2e-6
"""Kept off a strict clamp so float dust never turns an affordable reservation into a refusal."""

_BUDGETS = ("run_budget", "key_budget", "user_budget", "team_budget")
"""Refusals a strict admission clamps again for (a concurrent call got there first)."""
MAX_VIEWS = 4096
"""Views of teams (one per key) whose rate limits the governor keeps built."""

Clock = Callable[[], datetime]
Claims = Callable[[float, tuple[RateLimit, ...], int], Claim]
"""An admission's claim for an amount, the rate limits its store step spends and its tokens."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Ask:
    """What a model call asks for: its price, prompt, output cap per choice and choices, and
    who asks (the model's name, the call's user, the run's policy: its spend's attribution)."""

    price: Price
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    max_tokens: int | None = None
    n: int = 1
    model: str = ""
    user: str | None = None
    policy: str = ""


@dataclass
class Admission:
    """One admitted call. `max_tokens` is the clamp to send upstream (strict), else None;
    `allowed_completion` bounds the completion tokens the upstream may bill (all choices)."""

    governor: Governor
    run_id: str
    team: TeamConfig
    strict: bool
    n: int = 1
    period: str | None = None
    reservation: str | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    allowed_completion: int | None = None
    closed: bool = field(default=False)
    rates: tuple[RateLimit, ...] = ()
    token_cap: int | None = None
    """The fewest tokens one of `rates` allows per window (None: no limit of tokens)."""
    counted_tokens: int = 0
    """What the rate limits counted for the call before it ran (its prompt); booked against real usage."""
    rate_headers: rate_limits.Pairs = ()
    """The x-ratelimit-* headers of the clocks as the admission left them."""
    allowance: Allowance | None = None
    """The rate allowance the call was admitted through (its booking's tokens are paid from it)."""
    run_revision: int | None = None
    """The run's stored revision when it was admitted (`Grant.run_revision`)."""
    fit: bool = False
    """The run's budget asks a person before it is passed (`on_exceed: ask`): the call's whole
    hold must fit in it, and its output is held to its allowance (`max_tokens`)."""
    run_budget_usd: float | None = None
    """The run's budget a pass-through claim is checked against (strict, or `fit`)."""
    holds: tuple[Hold, ...] = ()
    """The key's and the user's budgets the call holds against besides the team's."""
    attribution: Attribution | None = None

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self.closed:  # nothing was booked: give everything back, even when cancelled
            await asyncio.shield(self.governor.release(self))


class RunCrowded(Conflict):
    """Too many calls of one run in flight: refused before anything is forwarded; retryable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="run_busy", headers={"x-should-retry": "true", "retry-after": "1"})


class Governor:
    """Admission control shared by the pass-through route and server-side runs."""

    def __init__(self, store: Store, counter: TokenCounter, defaults: Defaults, clock: Clock = _utc_now, *,
                 owner: str = "", ttl_s: float = DEFAULT_RESERVATION_TTL_S, spool: Spool | None = None) -> None:
        self.store = store
        self.spool = spool
        """Where spend the store cannot take waits (`book_surely`); while its reserve is not
        intact, no call is admitted."""
        self.counter = counter
        self.defaults = defaults
        self.clock = clock
        self.owner = owner
        self.ttl_s = ttl_s
        self._periods: dict[tuple[object, ...], str] = {}
        self._live: set[str] = set()  # reservations of calls in flight here (renewed)
        self.spooled: set[str] = set()
        """Reservations of spend waiting in the spool: held (renewed) until it is booked."""
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._detached: set[asyncio.Future[Any]] = set()  # calls whose caller stopped, still booking
        # by team and key scope: the rate limits, and the fewest tokens one of them allows per window
        self._rates: dict[int, tuple[TeamConfig, tuple[RateLimit, ...], int | None]] = {}
        self.allowances = Allowances()

    def configure(self, defaults: Defaults) -> None:
        """A config reload: its defaults from now on; the rate limits built for the old config's
        views are dropped (each view of the new config builds its own; calls admitted before keep
        what they claimed; what this process took ahead under the old limits is given back once idle)."""
        self.defaults = defaults
        self._rates = {}

    def rates(self, team: TeamConfig) -> tuple[RateLimit, ...]:
        """The rate limits a call of `team` claims (its key's and the team's), built once."""
        return self._limits(team)[0]

    def _limits(self, team: TeamConfig) -> tuple[tuple[RateLimit, ...], int | None]:
        caller = team.caller
        if team.rate_limits is None and (caller is None or caller.limits is None):
            return (), None
        # By the view itself (the keyring makes one per key and record revision, and keeps
        # it): an int to hash, where the limits' own dataclasses would be hashed field by field.
        found = self._rates.get(id(team))
        if found is not None and found[0] is team:
            return found[1], found[2]
        rates = rate_limits.claims(team)
        cap = min((r.tokens for r in rates if r.tokens is not None), default=None)
        if len(self._rates) >= MAX_VIEWS:
            self._rates.clear()
        self._rates[id(team)] = (team, rates, cap)
        return rates, cap

    def period(self, team: TeamConfig) -> str:
        """The team's ledger key now (rolls over with the clock)."""
        return self.period_of(team.budget_period)

    def period_of(self, kind: str) -> str:
        """The ledger key of a budget period of `kind` now ("day", "week", "month", "total")."""
        if self.clock is _utc_now:  # the real clock: the UTC day number is enough to look it up
            key: tuple[object, ...] = (kind, int(time.time() // 86_400))
            cached = self._periods.get(key)
            if cached is not None:
                return cached
        now = self.clock()
        if now.tzinfo is None:
            return period_key(cast(PeriodKind, kind), now)  # refuses a naive clock, by name
        utc = now.astimezone(UTC)
        if self.clock is not _utc_now:
            key = (kind, utc.year, utc.month, utc.day)
            cached = self._periods.get(key)
            if cached is not None:
                return cached
        if len(self._periods) > 64:  # period_key formats dates: once a day per kind is enough
            self._periods.clear()
        self._periods[key] = value = period_key(cast(PeriodKind, kind), utc)
        return value

    def holds(self, team: TeamConfig, user: str | None) -> tuple[Hold, ...]:
        """The budgets besides the team's a call of `team` (a view: its key) and `user` holds
        against: the key's, and the user's (a team's `user_budget_usd`, for a call that has a
        user). Both are held with the same amount as the team's, in the same store step."""
        caller = team.caller
        out: tuple[Hold, ...] = ()
        if caller is not None and caller.budget_usd is not None:
            out = (Hold("key", caller.scope, self.period_of(caller.budget_period), caller.budget_usd),)
        if user and team.user_budget_usd is not None:
            out += (Hold("user", f"user:{team.name}:{user}", self.period_of(team.user_budget_period),
                         team.user_budget_usd),)
        return out

    # --- admission -------------------------------------------------------------------------

    async def admit_turn(self, run: RunState, team: TeamConfig, ask: Ask, *, create: bool = False,
                         fit: bool = False) -> Admission:
        """Admit one pass-through call of `run`: its turn slot and budget holds, or a refusal
        (LimitExceeded, RunCrowded) before anything is forwarded. With `create`, `run` is new
        and is stored by the first store step of the admission (RunExists if it was taken).
        With `fit` (the run's budget asks a person before it is passed), the call's whole
        hold must fit in the run's budget, checked in the store step like strict mode's."""
        limits = run.limits
        strict = limits.budget_mode == "strict" or team.budget_mode == "strict"
        fit = fit and limits.max_budget_usd is not None
        if limits.max_duration_s is not None:
            started = run.started_at or run.created_at
            if time.time() - started >= limits.max_duration_s:
                raise LimitExceeded("max_duration_exceeded",
                                    f"run {run.run_id} started {time.time() - started:.1f} s ago, past its cap of "
                                    f"{limits.max_duration_s:g} s; nothing was forwarded")
        if not strict and limits.max_budget_usd is not None and run.cost_usd >= limits.max_budget_usd:
            raise LimitExceeded("budget_exceeded",
                                f"run {run.run_id} spent ${run.cost_usd:.6f} of its ${limits.max_budget_usd:.6f} "
                                "budget; nothing was forwarded")
        rates, token_cap = self._limits(team)
        adm = self._admission(run.run_id, team, strict, ask, rates, token_cap, run.policy, fit)
        run_budget = limits.max_budget_usd if strict or fit else None
        adm.run_budget_usd = run_budget

        pending = [run] if create else []

        def claim(amount: float, rates: tuple[RateLimit, ...], tokens: int) -> Claim:
            return Claim(team.name, adm.period or "", amount, team.budget_usd, run_id=run.run_id,
                         max_turns=limits.max_turns, max_in_flight=self.defaults.max_calls_in_flight_per_run,
                         run_budget_usd=run_budget, owner=self.owner, ttl_s=self.ttl_s, rates=rates,
                         tokens=tokens, create=pending.pop() if pending else None,  # only the first stores the run
                         holds=adm.holds, attribution=adm.attribution)

        await self._admit(adm, ask, claim, run_budget)
        return adm

    async def admit_call(self, run_id: str, team: TeamConfig, strict: bool, ask: Ask,
                         run_remaining_usd: float | None, *, fit: bool = False) -> Admission:
        """Admit one model call of a server-side run (its loop checks the run's own caps; with
        `fit`, the call's whole hold must fit in `run_remaining_usd`: the run's budget asks a
        person before it is passed)."""
        rates, token_cap = self._limits(team)
        fit = fit and run_remaining_usd is not None
        adm = self._admission(run_id, team, strict, ask, rates, token_cap, ask.policy, fit)

        def claim(amount: float, rates: tuple[RateLimit, ...], tokens: int) -> Claim:
            return Claim(team.name, adm.period or "", amount, team.budget_usd, owner=self.owner, ttl_s=self.ttl_s,
                         rates=rates, tokens=tokens, holds=adm.holds, attribution=adm.attribution)

        run_left = run_remaining_usd if strict or fit else None
        await self._admit(adm, ask, claim, None, run_left)
        return adm

    def _admission(self, run_id: str, team: TeamConfig, strict: bool, ask: Ask, rates: tuple[RateLimit, ...],
                   token_cap: int | None, policy: str, fit: bool) -> Admission:
        caller = team.caller
        return Admission(self, run_id, team, strict, n=ask.n, period=self.period(team), rates=rates,
                         token_cap=token_cap, fit=fit, holds=self.holds(team, ask.user),
                         attribution=Attribution("" if caller is None else caller.key_id, ask.user or "", ask.model,
                                                 policy))

    async def _admit(self, adm: Admission, ask: Ask, claim: Claims, run_budget: float | None,
                     run_left: float | None = None) -> None:
        if self.spool is not None and not self.spool.intact:
            adm.closed = True
            raise SpoolNotReady(f"the spool {self.spool.path} has no room set aside: {self.spool.condition.detail}")
        team = adm.team
        limited = adm.token_cap is not None  # a limit of tokens: the prompt is counted against it
        budgeted = team.budget_usd is not None or bool(adm.holds) or adm.fit
        counts = adm.strict or budgeted or limited
        prompt = self.counter.count_request(ask.messages, ask.tools) if counts else 0
        adm.prompt_tokens = prompt if counts else None
        if limited:
            adm.counted_tokens = prompt
            too_large = rate_limits.too_large(adm.rates, prompt) if prompt > (adm.token_cap or 0) else None
            if too_large is not None:
                adm.closed = True
                raise too_large
        allowance = ask.max_tokens or self.defaults.output_allowance_tokens
        if adm.fit:  # the whole hold must fit in the run's budget (pass-through: the store step checks it)
            if run_left is not None and ask.price.cost(Usage(prompt, allowance * ask.n)) > run_left:
                raise self._refusal(adm, "run_budget", Figures(), ask, prompt, allowance, run_left)
            adm.max_tokens = allowance
        if not adm.strict:
            amount = ask.price.cost(Usage(prompt, allowance * ask.n)) if budgeted else 0.0
            self._close_on_refusal(adm, await self._claim(adm, claim, amount), ask, prompt, allowance)
            adm.allowed_completion = allowance * ask.n if adm.fit else (
                None if ask.max_tokens is None else ask.max_tokens * ask.n)
            return
        figures = await self.store.figures(team.name, adm.period or "", adm.run_id if run_budget is not None else None,
                                           adm.holds)
        for _ in range(RESERVE_ATTEMPTS):
            out = self._strict_output(adm, ask, prompt, allowance, figures, run_budget, run_left)
            adm.max_tokens = out
            grant = await self._claim(adm, claim, ask.price.cost(Usage(prompt, out * ask.n)))
            if grant.reservation_id is not None or grant.refused not in _BUDGETS:
                self._close_on_refusal(adm, grant, ask, prompt, out)
                adm.allowed_completion = out * ask.n
                return
            figures = grant.figures  # a concurrent call got there first: clamp again
        raise self._refusal(adm, "team_budget", figures, ask, prompt, 1)

    async def _claim(self, adm: Admission, claim: Claims, amount: float) -> Grant:
        """One store step of the admission: the claim, its rate limits spent from this
        process's allowance where it holds them (`allowances`); a rate refusal of a claim
        that used the allowance is tried once more as the plain claim, which alone decides."""
        if not adm.rates:
            return await self.store.admit(claim(amount, (), 0))
        now = time.time()
        take = self.allowances.take(adm.rates, adm.counted_tokens, now)
        if take is None:  # nothing to take ahead: the claim as it is
            grant = await self.store.admit(claim(amount, adm.rates, adm.counted_tokens))
            if grant.reservation_id is not None:
                adm.rate_headers = rate_limits.pairs(adm.rates, grant.rates)
            return grant
        try:
            grant = await self.store.admit(claim(amount, take.rates, take.tokens))
            if grant.reservation_id is None:
                self.allowances.refused(take)
                if grant.refused != "rate_limit" or take.plain:
                    return grant
                take = self.allowances.plain(adm.rates, adm.counted_tokens)
                grant = await self.store.admit(claim(amount, take.rates, take.tokens))
                if grant.reservation_id is None:
                    return grant
        except BaseException:  # cancelled or failed: nothing of it is held here
            self.allowances.refused(take)
            raise
        adm.rate_headers = self.allowances.granted(take, grant.rates, now)
        adm.allowance = take.allowance
        return grant

    def _strict_output(self, adm: Admission, ask: Ask, prompt: int, allowance: int, figures: Figures,
                       run_budget: float | None, run_left: float | None) -> int:
        """The output tokens per choice that every budget can still pay for (strict mode)."""
        out = allowance
        if run_budget is not None:
            run_left = run_budget - figures.run_cost_usd - figures.run_held_usd
        if adm.fit and run_left is not None and ask.price.cost(Usage(prompt, allowance * ask.n)) > run_left:
            raise self._refusal(adm, "run_budget", figures, ask, prompt, allowance, run_left)
        if run_left is not None:
            out = min(out, ask.price.max_output_tokens(run_left - MARGIN_USD, prompt) // ask.n)
            if out <= 0:
                raise self._refusal(adm, "run_budget", figures, ask, prompt, 1, run_left)
        for hold, (spent, reserved) in zip(adm.holds, figures.holds, strict=True):
            out = min(out, ask.price.max_output_tokens(hold.budget_usd - spent - reserved - MARGIN_USD, prompt) // ask.n)
            if out <= 0:
                raise self._refusal(adm, f"{hold.kind}_budget", figures, ask, prompt, 1)
        if adm.team.budget_usd is not None:
            team_left = adm.team.budget_usd - figures.spent_usd - figures.reserved_usd - MARGIN_USD
            out = min(out, ask.price.max_output_tokens(team_left, prompt) // ask.n)
            if out <= 0:
                raise self._refusal(adm, "team_budget", figures, ask, prompt, 1)
        return out

    def _close_on_refusal(self, adm: Admission, grant: Grant, ask: Ask, prompt: int, out: int) -> None:
        if grant.reservation_id is None:
            if grant.refused == "rate_limit":
                adm.closed = True
                raise rate_limits.refused(adm.rates, grant.rates, adm.counted_tokens)
            raise self._refusal(adm, grant.refused or "busy", grant.figures, ask, prompt, out)
        adm.reservation = grant.reservation_id
        adm.run_revision = grant.run_revision
        self._live.add(grant.reservation_id)

    def _refusal(self, adm: Admission, why: str, figures: Figures, ask: Ask, prompt: int, out: int,
                 run_left: float | None = None) -> Exception:
        adm.closed = True
        run_id, team = public_run_id(adm.run_id), adm.team
        need = ask.price.cost(Usage(prompt, out * ask.n))
        choices = f" x {ask.n} choices" if ask.n > 1 else ""
        if why == "max_turns":
            extra = f", {figures.run_in_flight} more in flight" if figures.run_in_flight else ""
            return LimitExceeded("max_turns_exceeded", f"run {run_id} reached its cap of turns ({figures.run_turns} "
                                                       f"done{extra}); nothing was forwarded")
        if why == "busy":
            return RunCrowded(f"run {run_id} has {figures.run_in_flight} calls in flight, the most one run may have "
                           f"(defaults.max_calls_in_flight_per_run); nothing was forwarded, retry when one is done")
        if why == "run_missing":
            return Conflict(f"run {run_id} is no longer stored; nothing was forwarded", code="run_not_found")
        if why == "run_budget" and adm.fit:
            left = run_left
            if left is None and adm.run_budget_usd is not None:
                left = adm.run_budget_usd - figures.run_cost_usd - figures.run_held_usd
            shown = f"${max(left, 0.0):.6f}" if left is not None else "not enough"
            held = f" (held by calls in flight: ${figures.run_held_usd:.6f})" if figures.run_held_usd else ""
            return LimitExceeded("budget_exceeded",
                                 f"run {run_id} has {shown} of its budget left{held}: "
                                 f"the next call may cost up to ${need:.6f} (prompt {prompt} tokens + {out} output "
                                 f"tokens{choices}); nothing was forwarded")
        if why == "run_budget":
            left = run_left if run_left is not None else None
            shown = f"${max(left, 0.0):.6f}" if left is not None else "not enough"
            return LimitExceeded("budget_exceeded",
                                 f"run {run_id} has {shown} of budget left (spent ${figures.run_cost_usd:.6f}, held by "
                                 f"calls in flight ${figures.run_held_usd:.6f}), not enough for the prompt ({prompt} "
                                 f"tokens) and one output token{choices} (strict mode); nothing was forwarded")
        mode = "strict mode: at least one output token" if adm.strict else f"allowance {out} output tokens"
        if why in ("key_budget", "user_budget"):
            kind = "key" if why == "key_budget" else "user"
            i = next(i for i, h in enumerate(adm.holds) if h.kind == kind)
            hold, (spent, reserved) = adm.holds[i], (figures.holds[i] if len(figures.holds) > i else (0.0, 0.0))
            caller = adm.team.caller
            whose = f"key {caller.key_id}" if kind == "key" and caller is not None else \
                f"user '{hold.scope.split(':', 2)[2]}' of team '{team.name}'"
            return LimitExceeded(
                "key_budget_exceeded" if kind == "key" else "user_budget_exceeded",
                f"{whose} has a budget of ${hold.budget_usd:.6f} for period {hold.period}, which cannot pay for this "
                f"call: spent ${spent:.6f}, reserved by calls in flight ${reserved:.6f}, this call needs up to "
                f"${need:.6f} (prompt {prompt} tokens + {mode}{choices}); nothing was forwarded")
        return LimitExceeded(
            "team_budget_exceeded",
            f"team '{team.name}' budget of ${team.budget_usd or 0.0:.6f} for period {adm.period} cannot pay for this "
            f"call: spent ${figures.spent_usd:.6f}, reserved by calls in flight ${figures.reserved_usd:.6f}, this call "
            f"needs up to ${need:.6f} (prompt {prompt} tokens + {mode}{choices}); nothing was forwarded",
        )

    # --- closing ---------------------------------------------------------------------------

    def _close(self, adm: Admission) -> bool:
        if adm.closed:
            return False
        adm.closed = True
        if adm.reservation is not None:
            self._live.discard(adm.reservation)
        return True

    async def settle(self, adm: Admission, actual_usd: float, tokens: int | None = None) -> None:
        """Book the call's actual cost (the team's ledger holds it even without a budget) and
        reconcile its rate limits with the `tokens` it really used (prompt + completion).
        When the store cannot take it now, it waits in the spool (`book_surely`)."""
        booking = self.booking(adm, actual_usd, tokens)
        if booking is not None:
            await self.book_surely(booking)

    def booking(self, adm: Admission, actual_usd: float, tokens: int | None = None) -> Booking | None:
        """Close the call and say what `Store.commit_turn` must book for it (what `settle`
        would book, `tokens` reconciled as there); None when there is nothing to book
        (closed already, or free and unreserved)."""
        if not self._close(adm):
            return None
        if adm.reservation is None and actual_usd <= 0:
            return None
        return Booking(adm.team.name, adm.period or self.period(adm.team), actual_usd, adm.reservation,
                       tokens=self.allowances.charges(adm.allowance, adm.rates, adm.counted_tokens, tokens),
                       attribution=None if adm.reservation is not None else adm.attribution)

    async def book(self, booking: Booking) -> None:
        """Book on its own what a failed `commit_turn` did not (settle is idempotent)."""
        if booking.reservation_id is not None:
            await self.store.settle(booking.reservation_id, booking.actual_usd, booking.tokens)
        elif booking.actual_usd > 0:
            await self.store.charge(booking.team, booking.period, booking.actual_usd, booking.attribution)

    async def book_surely(self, booking: Booking) -> None:
        """`book`, and when the store cannot take it now, keep it in the spool (booked once
        the store takes it, by `booking.replay_spool`) with its reservation held meanwhile:
        spent money is never unbooked. Raises only what the store refuses about the booking."""
        try:
            await self.book(booking)
        except (AlreadyBooked, StaleRun, RunNotFound):
            raise
        except StoreError as exc:
            if self.spool is None:
                raise
            self.keep(booking, {"only": BOOKING_ONLY, "booking": booking_json(booking)}, exc)

    def keep(self, booking: Booking | None, record: dict[str, Any], exc: StoreError) -> None:
        """`record` (spend the store failed to take with `exc`) into the spool, `booking`'s
        reservation held until it is booked. A record the spool cannot write either waits in
        this process's memory (`Spool.append`); the spool's condition says so."""
        assert self.spool is not None
        if booking is not None and booking.reservation_id is not None:
            self.spooled.add(booking.reservation_id)
            self._live.add(booking.reservation_id)
        with contextlib.suppress(StoreError):  # kept in memory, and logged (once) by the spool's condition
            self.spool.append(record)
        log.debug("$%.9f of team %s waits in the spool: the store failed with %s",
                  booking.actual_usd if booking else 0.0, booking.team if booking else "-", exc)

    def booked(self, reservation_ids: Collection[str]) -> None:
        """Spooled spend now booked (or booked elsewhere): its reservations are not held any more."""
        for rid in reservation_ids:
            self.spooled.discard(rid)
            self._live.discard(rid)

    async def release(self, adm: Admission) -> None:
        """Nothing to pay: give the reservation (and the run's slot) back."""
        if self._close(adm) and adm.reservation is not None:
            await self.store.release(adm.reservation)

    def remaining(self, team: TeamConfig, ledger: tuple[float, float] | None) -> float | None:
        """Budget minus spent minus reserved from ledger figures the store just reported."""
        if team.budget_usd is None or ledger is None:
            return None
        return team.budget_usd - ledger[0] - ledger[1]

    async def team_remaining(self, team: TeamConfig) -> float | None:
        """Budget minus spent minus reserved for the current period (None: no team budget)."""
        if team.budget_usd is None:
            return None
        spent, reserved = await self.store.team_spend(team.name, self.period(team))
        return team.budget_usd - spent - reserved

    # --- this process's holds --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def run_lock(self, run_id: str) -> AsyncIterator[None]:
        """Serialises this process's bookings of one run, so that concurrent calls of a run
        book one after the other instead of all racing on the run's revision."""
        lock, users = self._locks.get(run_id) or (asyncio.Lock(), 0)
        self._locks[run_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[run_id]
            if users <= 1:
                del self._locks[run_id]
            else:
                self._locks[run_id] = (lock, users - 1)

    async def start(self) -> None:
        """A restarted process gives back what its previous life still held, but for the
        reservations of spend waiting in the spool: those it holds until they are booked."""
        spooled = self.spool.reservations() if self.spool is not None else set()
        self.spooled |= spooled
        self._live |= spooled
        if self.owner:
            released = await self.store.release_owner(self.owner, keep=spooled)
            if released:
                log.info("released %d reservations left by this gateway's previous process", released)

    def finish_in_background(self, call: asyncio.Future[Any], run_id: str) -> None:
        """Keep an admitted call its caller stopped waiting for until it ends: it books its
        answer (or releases its hold) then. Kept here, so that it is not collected meanwhile."""
        self._detached.add(call)

        def ended(done: asyncio.Future[Any]) -> None:
            self._detached.discard(done)
            if done.cancelled():
                return
            exc = done.exception()
            if exc is None:
                log.info("run %s: a model call answered after the run stopped waiting for it; booked on the team",
                         run_id)
            elif not isinstance(exc, (ApiError, UpstreamError, StoreError)):
                log.error("run %s: a model call left behind by a stop failed", run_id, exc_info=exc)

        call.add_done_callback(ended)

    async def give_back(self, idle_s: float = FRESH_S) -> None:
        """Give back to the store's clocks what this process took ahead of its calls and has
        not used for `idle_s` (everything with 0: it stops)."""
        pushes = self.allowances.idle(time.time(), idle_s)
        if pushes:
            try:
                await self.store.push_clocks(pushes)
            except StoreError as exc:  # what they held comes back as the scopes' buckets fill
                log.warning("cannot give back %d rate clocks taken ahead: %s", len(pushes), exc)

    async def give_back_idle(self) -> None:
        """`give_back` every FRESH_S (runs until cancelled)."""
        while True:
            await asyncio.sleep(FRESH_S)
            await self.give_back()

    async def keep_alive(self) -> None:
        """Renew the holds of calls in flight every third of their ttl (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            if not self._live:
                continue
            try:
                await self.store.renew(list(self._live), self.ttl_s)
            except StoreError as exc:
                log.warning("cannot renew %d reservations: %s", len(self._live), exc)
