"""The governor: admits a model call against the run's limits and the team's budget.

Every call is admitted before it is forwarded and closed after it, exactly once:

    open(...)     sync: the run's turn cap and budget, counting calls already in flight here
    reserve(...)  the exact prompt cost (o200k_base) plus the output allowance, held
                  atomically on the team ledger (store.reserve) for the current period
    settle(...)   the actual cost booked in place of the reservation
    release(...)  nothing booked (upstream error, cancel, nothing received)

A pass-through turn closes its admission with `booking(...)` instead of `settle`: the
store books it in the same step as the run's save (`Store.commit_turn`).

Modes: `turn` checks before the call (an overshoot is at most one turn per call in
flight, and only when a reply outgrows its allowance); `strict` clamps the upstream
`max_tokens` to what the run's and the team's remaining budgets can pay for, so spend
never passes either budget, and refuses when that is zero.

Tokens are counted only where they change a decision: teams with a budget and strict
runs. A pass-through call of a team without a budget counts nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.harness.state import RunState
from gateway.harness.usage import Price, Usage
from gateway.server.config import Defaults, TeamConfig
from gateway.server.errors import LimitExceeded
from gateway.store.base import Booking, Store
from gateway.store.periods import period_key
from gateway.tokens import TokenCounter

RESERVE_ATTEMPTS = 8
"""Strict reservations re-read the ledger and retry when a concurrent call got there first."""
MARGIN_USD = 2e-6
"""Kept off a strict clamp so float dust never turns an affordable reservation into a refusal."""

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Admission:
    """One admitted call. `max_tokens` is the clamp to send upstream (strict), else None."""

    run_id: str
    team: TeamConfig
    strict: bool
    period: str | None = None
    reservation: str | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    run_hold_usd: float = 0.0
    closed: bool = field(default=False)


class Governor:
    """Admission control shared by the pass-through route and server-side runs."""

    def __init__(self, store: Store, counter: TokenCounter, defaults: Defaults, clock: Clock = _utc_now) -> None:
        self.store = store
        self.counter = counter
        self.defaults = defaults
        self.clock = clock
        self._turns: dict[str, int] = {}
        self._usd: dict[str, float] = {}
        self._periods: dict[tuple[object, ...], str] = {}

    def period(self, team: TeamConfig) -> str:
        """The team's ledger key now (rolls over with the clock)."""
        if self.clock is _utc_now:  # the real clock: the UTC day number is enough to look it up
            key: tuple[object, ...] = (team.budget_period, int(time.time() // 86_400))
            cached = self._periods.get(key)
            if cached is not None:
                return cached
        now = self.clock()
        if now.tzinfo is None:
            return period_key(team.budget_period, now)  # refuses a naive clock, by name
        utc = now.astimezone(UTC)
        if self.clock is not _utc_now:
            key = (team.budget_period, utc.year, utc.month, utc.day)
            cached = self._periods.get(key)
            if cached is not None:
                return cached
        if len(self._periods) > 64:  # period_key formats dates: once a day per kind is enough
            self._periods.clear()
        self._periods[key] = value = period_key(team.budget_period, utc)
        return value

    def in_flight(self, run_id: str) -> int:
        return self._turns.get(run_id, 0)

    def open(self, run: RunState, team: TeamConfig) -> Admission:
        """Check the run's turn cap and budget now and count the call in flight (no await:
        two calls of one run cannot both pass the last turn in this process)."""
        limits = run.limits
        flying = self._turns.get(run.run_id, 0)
        if limits.max_turns is not None and run.turns + flying >= limits.max_turns:
            extra = f", {flying} more in flight" if flying else ""
            raise LimitExceeded("max_turns_exceeded",
                                f"run {run.run_id} reached its cap of {limits.max_turns} turns "
                                f"({run.turns} done{extra}); nothing was forwarded")
        if limits.max_budget_usd is not None and run.cost_usd >= limits.max_budget_usd:
            raise LimitExceeded("budget_exceeded",
                                f"run {run.run_id} spent ${run.cost_usd:.6f} of its ${limits.max_budget_usd:.6f} "
                                "budget; nothing was forwarded")
        strict = limits.budget_mode == "strict" or team.budget_mode == "strict"
        return self._hold(run.run_id, team, strict)

    def open_call(self, run_id: str, team: TeamConfig, strict: bool) -> Admission:
        """Count a call in flight without run checks (a server-side loop checks its own)."""
        return self._hold(run_id, team, strict)

    def _hold(self, run_id: str, team: TeamConfig, strict: bool) -> Admission:
        self._turns[run_id] = self._turns.get(run_id, 0) + 1
        return Admission(run_id=run_id, team=team, strict=strict)

    async def reserve(self, adm: Admission, *, price: Price, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None, max_tokens: int | None,
                      run_remaining_usd: float | None) -> None:
        """Count, clamp and reserve for an opened call; on refusal the admission is closed."""
        try:
            await self._reserve(adm, price, messages, tools, max_tokens, run_remaining_usd)
        except BaseException:
            self._close(adm)
            raise

    async def _reserve(self, adm: Admission, price: Price, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None, max_tokens: int | None,
                       run_remaining_usd: float | None) -> None:
        team = adm.team
        if not adm.strict and team.budget_usd is None:
            return
        prompt = self.counter.count_request(messages, tools)
        adm.prompt_tokens = prompt
        allowance = max_tokens or self.defaults.output_allowance_tokens
        out = allowance
        if adm.strict and run_remaining_usd is not None:
            # Calls of this run already in flight hold part of its budget.
            left = run_remaining_usd - self._usd.get(adm.run_id, 0.0) - MARGIN_USD
            out = min(out, price.max_output_tokens(left, prompt))
            if out <= 0:
                raise LimitExceeded("budget_exceeded",
                                    f"run {adm.run_id} has ${max(run_remaining_usd, 0.0):.6f} of budget left, not "
                                    f"enough for the prompt ({prompt} tokens) and one output token (strict mode); "
                                    "nothing was forwarded")
        if adm.strict:
            adm.run_hold_usd = price.cost(Usage(prompt, out))
            self._usd[adm.run_id] = self._usd.get(adm.run_id, 0.0) + adm.run_hold_usd
            adm.max_tokens = out
        if team.budget_usd is None:
            return
        adm.period = self.period(team)
        for _ in range(RESERVE_ATTEMPTS):
            if adm.strict:
                spent, reserved = await self.store.team_spend(team.name, adm.period)
                team_out = min(out, price.max_output_tokens(team.budget_usd - spent - reserved - MARGIN_USD, prompt))
                if team_out <= 0:
                    raise await self._team_refusal(adm, price, prompt, 1)
                adm.max_tokens = team_out
            amount = price.cost(Usage(prompt, adm.max_tokens if adm.strict and adm.max_tokens else allowance))
            adm.reservation = await self.store.reserve(team.name, adm.period, amount, team.budget_usd)
            if adm.reservation is not None:
                return
            if not adm.strict:
                raise await self._team_refusal(adm, price, prompt, allowance)
        raise await self._team_refusal(adm, price, prompt, adm.max_tokens or 1)

    async def _team_refusal(self, adm: Admission, price: Price, prompt: int, out: int) -> LimitExceeded:
        team = adm.team
        period = adm.period or self.period(team)
        spent, reserved = await self.store.team_spend(team.name, period)
        need = price.cost(Usage(prompt, out))
        mode = "strict mode: at least one output token" if adm.strict else f"allowance {out} output tokens"
        return LimitExceeded(
            "team_budget_exceeded",
            f"team '{team.name}' budget of ${team.budget_usd:.6f} for period {period} cannot pay for this call: "
            f"spent ${spent:.6f}, reserved by calls in flight ${reserved:.6f}, this call needs up to ${need:.6f} "
            f"(prompt {prompt} tokens + {mode}); nothing was forwarded",
        )

    async def settle(self, adm: Admission, actual_usd: float) -> None:
        """Book the call's actual cost (the team's ledger holds it even without a budget)."""
        if adm.closed:
            return
        self._close(adm)
        if adm.reservation is not None:
            await self.store.settle(adm.reservation, actual_usd)
        elif actual_usd > 0:
            await self.store.charge(adm.team.name, adm.period or self.period(adm.team), actual_usd)

    def booking(self, adm: Admission, actual_usd: float) -> Booking | None:
        """Close the call and say what `Store.commit_turn` must book for it (what `settle`
        would book); None when there is nothing to book (closed already, or free and
        unreserved)."""
        if adm.closed:
            return None
        self._close(adm)
        if adm.reservation is None and actual_usd <= 0:
            return None
        return Booking(adm.team.name, adm.period or self.period(adm.team), actual_usd, adm.reservation)

    async def book(self, booking: Booking) -> None:
        """Book on its own what a failed `commit_turn` did not (settle is idempotent)."""
        if booking.reservation_id is not None:
            await self.store.settle(booking.reservation_id, booking.actual_usd)
        elif booking.actual_usd > 0:
            await self.store.charge(booking.team, booking.period, booking.actual_usd)

    def remaining(self, team: TeamConfig, ledger: tuple[float, float] | None) -> float | None:
        """Budget minus spent minus reserved from ledger figures the store just reported."""
        if team.budget_usd is None or ledger is None:
            return None
        return team.budget_usd - ledger[0] - ledger[1]

    async def release(self, adm: Admission) -> None:
        """Nothing to pay: give the reservation back."""
        if adm.closed:
            return
        self._close(adm)
        if adm.reservation is not None:
            await self.store.release(adm.reservation)

    def _close(self, adm: Admission) -> None:
        if adm.closed:
            return
        adm.closed = True
        n = self._turns.get(adm.run_id, 0) - 1
        if n > 0:
            self._turns[adm.run_id] = n
        else:
            self._turns.pop(adm.run_id, None)
        if adm.run_hold_usd:
            left = self._usd.get(adm.run_id, 0.0) - adm.run_hold_usd
            if n > 0 and left > 1e-12:
                self._usd[adm.run_id] = left
            else:
                self._usd.pop(adm.run_id, None)

    async def team_remaining(self, team: TeamConfig) -> float | None:
        """Budget minus spent minus reserved for the current period (None: no team budget)."""
        if team.budget_usd is None:
            return None
        spent, reserved = await self.store.team_spend(team.name, self.period(team))
        return team.budget_usd - spent - reserved
