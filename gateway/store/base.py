"""The store contract: runs, traces, team ledgers and leases behind one small Protocol.

Implementations: `memory` (tests), `sqlite` (one machine, the default) and `redis` (several
replicas). All of them keep money as integer micro-dollars so that sums are exact; the
Protocol speaks float USD at the edges because that is what prices produce.

A run is kept as a head and a transcript (`RunWrite`): the head (`RunState.head_json`: the
run's fields and counters, a few KB) is rewritten by every save; its messages and its
`per_turn` entries are kept beside it as items, each written once, so that a save costs
the same at turn 200 as at turn 2. A store must read a run back in one consistent snapshot
(the head and exactly the items it counts, `parse_run`), and write a save's head and items
in the one step that checks its revision (and lease, `Lease`). Runs stored before heads
(schema 1 to 4, one body holding everything) are read as they are and take the new shape on
their next save.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple, Protocol

import orjson

from gateway.harness.state import STATUSES, RunState, StateError, transcript_change
from gateway.harness.trace import Event as Event  # the store keeps trace lines
from gateway.harness.usage import Usage
from gateway.store.audit import AuditEntry, AuditRecord
from gateway.store.errors import StoreError
from gateway.store.keys import ConsoleSession, KeyRecord
from gateway.store.outbox import Claimed, Notice, NoticeRule

Ledger = tuple[float, float]
"""(spent, reserved) USD of a team in a period, as `team_spend` reports them."""

MICROS_PER_USD = 1_000_000
DEFAULT_RESERVATION_TTL_S = 600.0
"""A reservation outlives any sane model call; past it, the reserving process is presumed dead."""
EXPIRED_RETENTION_S = 86_400.0
"""How long an expired reservation is remembered, so a late `settle` still books the spend."""
PRUNE_BATCH = 500
"""Runs a prune deletes per step; the store serves other calls between steps."""


@dataclass(frozen=True)
class Lease:
    """The right to drive one run, as `Store.acquire_lease` granted it.

    `epoch` is a fencing token. Every store keeps, per run, besides the lease itself (who
    may take the run, until when), its **fence**: the last lease taken on the run, as
    (owner, epoch), or "released". The rules every store follows:

    - `acquire_lease(run, owner)` is granted when nobody else's lease is live. If the fence
      names `owner` (it was the last to take the run and did not release it, whether its
      lease is live or lapsed), the lease keeps that epoch; otherwise it gets a new epoch,
      higher than every epoch the run's lease ever had, and the fence becomes (owner, epoch).
    - `release_lease(run, owner)` and `release_owner(owner)` end the lease and set the fence
      to "released" if it names `owner`: no write under that epoch counts again, and the
      next lease, even the same owner's, gets a new epoch.
    - A write given a lease (`save_run`, `commit_turn`, `append_events`) checks, in the same
      atomic step as the write and before anything else, that the fence is exactly
      (lease.owner, lease.epoch); otherwise it raises LeaseLost and writes nothing at all
      (no head, no transcript item, no trace line, no outbox notice, no booking on any
      ledger, no spend row, no audit record), even when it would also have been stale.
      The lease's expiry is not checked there: a holder whose lease lapsed while nobody
      took the run over goes on writing; once another process took it, it cannot.
    - Writes without a lease are not fenced (the run's revision checks them), and neither
      are reservations: `settle` and `release` of a model call's reservation book and free
      it whatever happened to the run's lease, since the upstream was paid.

    So a driver that stalled past its TTL (a frozen process, a long pause) and was replaced
    can never write to the run again, even if it wakes up before it notices."""

    run_id: str
    owner: str
    epoch: int


@dataclass(frozen=True)
class Booking:
    """What a turn books on its team's ledger, in the same step as the run's save.

    With `reservation_id`, that reservation is settled for `actual_usd` (exactly as `settle`:
    once, on the reservation's own team and period); without, `actual_usd` is charged to
    `team`'s `period` (as `charge`, nothing when it is 0). `team` and `period` also name the
    ledger whose figures `commit_turn` returns.
    """

    team: str
    period: str
    actual_usd: float
    reservation_id: str | None = None
    if_held: bool = False
    """With a reservation: refuse the whole commit (AlreadyBooked, nothing written) unless the
    reservation is still stored, so a booking replayed after an outage books exactly once."""
    tokens: tuple[TokenCharge, ...] = ()
    """Token clocks to reconcile, with the settle of `reservation_id` (once, like it)."""
    attribution: Attribution | None = None
    """Without a reservation: whose spend the charge is (with one, the reservation's own)."""


RATE_SLACK_S = 1e-6
"""Float dust allowed on a rate check, so the N-th request of a burst of N is never refused."""


@dataclass(frozen=True)
class RateLimit:
    """The rate limits of one scope (a team, a key) a `Claim` is checked against.

    GCRA (a token bucket kept as one "theoretical arrival time" per kind): the scope may
    spend `requests` requests and `tokens` tokens per `window_s`, refilled continuously,
    at most that many at once. A request costs `requests_s` = window_s / requests of the
    request clock, a token `tokens_s` = window_s / tokens of the token clock; a claim fits
    when the clock, pushed forward by its cost from no earlier than now, stays within
    `window_s` of now. `max_in_flight` caps the scope's live reservations. None: no such
    limit. `scope` is a store key ("team:NAME", "key:DIGEST").

    `spends`: how many requests one claim of this limit spends (`spending`): a process takes
    the requests of its next calls ahead with one claim (gateway.server.runs.allowances).
    """

    scope: str
    window_s: float = 60.0
    requests: int | None = None
    tokens: int | None = None
    max_in_flight: int | None = None
    spends: int = 1
    # Derived once (they are read several times on every limited call), not compared.
    requests_s: float | None = field(default=None, init=False, compare=False)
    tokens_s: float | None = field(default=None, init=False, compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests_s",
                           None if self.requests is None else self.window_s / self.requests * self.spends)
        object.__setattr__(self, "tokens_s", None if self.tokens is None else self.window_s / self.tokens)
        # A claim's rates key the stores' caches (statements, arguments) on every call: hash once.
        object.__setattr__(self, "_hash", hash((self.scope, self.window_s, self.requests, self.tokens,
                                                self.max_in_flight, self.spends)))

    def __hash__(self) -> int:
        return self._hash

    def spending(self, requests: int) -> RateLimit:
        """This limit for a claim that spends `requests` requests of it (0 and more), not one:
        `requests_s` is their cost together."""
        return self if requests == self.spends else replace(self, spends=requests)

    def in_flight_only(self) -> RateLimit | None:
        """This limit without its clocks: what a claim whose request and tokens were taken
        ahead still checks (its calls in flight); None when there is nothing to check."""
        if self.max_in_flight is None:
            return None
        return RateLimit(self.scope, self.window_s, max_in_flight=self.max_in_flight)


class RateState(NamedTuple):
    """A scope's clocks (epoch seconds of the store's clock), as `now` saw them: after the
    claim on a grant, before it on a refusal; `in_flight` counts live reservations (only
    when the scope has `max_in_flight`, else 0). A NamedTuple (immutable like a frozen
    dataclass, a third of its cost to make): one is made per scope on every limited call."""

    scope: str
    now: float
    requests_tat: float = 0.0
    tokens_tat: float = 0.0
    in_flight: int = 0


RateKind = Literal["requests", "tokens", "in_flight"]


def rate_refusal(limit: RateLimit, state: RateState, tokens: int) -> RateKind | None:
    """Which of a scope's limits a claim of one request and `tokens` tokens breaks (state before it)."""
    if limit.max_in_flight is not None and state.in_flight >= limit.max_in_flight:
        return "in_flight"
    if limit.requests_s is not None and not fits(state.requests_tat, state.now, limit.requests_s, limit.window_s):
        return "requests"
    if limit.tokens_s is not None and not fits(state.tokens_tat, state.now, tokens * limit.tokens_s, limit.window_s):
        return "tokens"
    return None


def fits(tat: float, now: float, cost_s: float, window_s: float) -> bool:
    """GCRA: a cost of `cost_s` on a clock at `tat` stays within the window."""
    return max(tat, now) + cost_s - now <= window_s + RATE_SLACK_S


class ClockPush(NamedTuple):
    """Seconds to move a scope's clocks by, from no earlier than now (negative: back), for
    `Store.push_clocks`: what a process gives back of the requests and tokens it took ahead
    and did not use."""

    scope: str
    requests_s: float
    tokens_s: float


class TokenCharge(NamedTuple):
    """Tokens a booking adds to (or, negative, gives back to) a scope's token clock: the
    real usage minus what the admission counted. `tokens_s` is `RateLimit.tokens_s`. A
    NamedTuple, as RateState: one per token-limited scope on every booking."""

    scope: str
    tokens: int
    tokens_s: float


class Hold(NamedTuple):
    """A budget besides the team's that a `Claim` holds its amount against, in the same step:
    a key's (`kind` "key", `scope` "key:<id>") or a user's ("user", "user:<team>:<user>").
    Each scope keeps a ledger of its own per `period`, as a team does (scopes contain ':',
    which no team name may); a grant holds the claim's whole amount on each."""

    kind: Literal["key", "user"]
    scope: str
    period: str
    budget_usd: float

    @property
    def tag(self) -> str:
        """How a reservation lists the holds it counts in ("|key:key_x#2026-12|")."""
        return f"|{self.scope}#{self.period}|"


class Attribution(NamedTuple):
    """Who a booked call's spend belongs to, besides its team (`Store.spend`): the key's id,
    the call's user, the model asked for, the run's policy ('' for none)."""

    key: str = ""
    user: str = ""
    model: str = ""
    policy: str = ""

    def encoded(self) -> str:
        return "\x1f".join(part.replace("\x1f", " ") for part in self)

    @classmethod
    def decoded(cls, raw: str | None) -> Attribution:
        if not raw:
            return cls()
        parts = raw.split("\x1f")
        return cls(*parts[:4]) if len(parts) >= 4 else cls()


class SpendRow(NamedTuple):
    """What one day's bookings spent, for one team, key, user, model and policy (micro-dollars, exact)."""

    day: str
    team: str
    key: str
    user: str
    model: str
    policy: str
    cost_micros: int
    calls: int


@dataclass(frozen=True)
class Claim:
    """What one admitted model call holds until its turn is booked or the call is released.

    An amount of the team's budget for `period` (checked against `budget_usd` when it is
    set) and, with `run_id`, one of the run's turn slots: the run's booked turns plus the
    slots held for it stay below `max_turns`, the slots stay below `max_in_flight`, and
    (with `run_budget_usd`) the run's booked cost plus the amounts its slots hold plus this
    one stay within it. All checked and held in one atomic step, across every replica.
    `owner` names the process that holds it (`release_owner`); past `ttl_s` without
    `renew` the hold no longer counts (its process is presumed dead). With `rates`, one
    request and `tokens` tokens must fit each scope's limits, checked and spent in the same
    step (the SQLite store keeps the clocks of at most two scopes per claim: a key's and
    its team's).

    With `create` (a new run whose id is `run_id`), the run is first stored as `create_run`
    would store it, in the same store step: one write instead of two for a run's first call.
    RunExists when the id is taken (then nothing is written or held); the run stays stored
    when the claim itself is refused, as if `create_run` had come first.

    `holds`: the key's and the user's budgets (`Hold`), each checked like the team's (its
    period's spend plus the amounts its live reservations hold plus this one within its
    budget) and held in the same step. `attribution` goes with the reservation: its booking
    adds the spend to the day's `SpendRow` of the team and this attribution.
    """

    team: str
    period: str
    amount_usd: float = 0.0
    budget_usd: float | None = None
    run_id: str | None = None
    max_turns: int | None = None
    max_in_flight: int | None = None
    run_budget_usd: float | None = None
    owner: str = ""
    ttl_s: float = DEFAULT_RESERVATION_TTL_S
    rates: tuple[RateLimit, ...] = ()
    """Rate limits checked and spent with the claim (one request and `tokens` tokens each)."""
    tokens: int = 0
    """The tokens the call is counted for before it runs (its prompt)."""
    create: RunState | None = None
    holds: tuple[Hold, ...] = ()
    attribution: Attribution | None = None


Refusal = Literal["max_turns", "busy", "run_budget", "key_budget", "user_budget", "team_budget", "run_missing",
                  "rate_limit"]
"""Why `admit` held nothing: the run's turn cap, its calls in flight, its budget, a hold's
budget (the key's, the user's), the team's budget, a run that is not stored, or a rate limit
of one of the claim's scopes. Checked in this order (a run that is not stored first)."""


@dataclass(frozen=True)
class Figures:
    """A team's ledger in one period and one run's counts, as an admission sees them."""

    spent_usd: float = 0.0
    reserved_usd: float = 0.0
    run_turns: int = 0
    run_in_flight: int = 0
    run_cost_usd: float = 0.0
    run_held_usd: float = 0.0
    holds: tuple[tuple[float, float], ...] = ()
    """(spent, reserved) USD of each of the claim's `holds`, in order, in their periods."""


@dataclass(frozen=True)
class Grant:
    """The answer to a `Claim`: a reservation id, or the refusal and the figures behind it."""

    reservation_id: str | None
    refused: Refusal | None = None
    figures: Figures = Figures()
    rates: tuple[RateState, ...] = ()
    """One per `Claim.rates`, in order: after the claim on a grant, as checked on a refusal."""
    run_revision: int | None = None
    """On a grant of a claim with `run_id`: the run's stored revision as the claim was judged
    (in the same step), so a caller that started from a cached run knows whether it was current."""


class ReloadMark(NamedTuple):
    """The last reload announced to every process sharing the store (`Store.announce_reload`)."""

    generation: int
    """How many reloads were announced so far (0: none)."""
    origin: str
    """Who announced the last one: the announcing server's `origin` ('' when none was)."""


class Store(Protocol):
    """Durable state shared by every request (and every replica) of the gateway."""

    lookup_in_admission: bool
    """True when a pass-through call's run is better not looked up before its admission: a
    look-up costs a round trip of its own, and an admission whose `Claim.create` names a
    stored run reports that run (`RunExists.stored`) in the same step."""

    notice_rule: NoticeRule | None
    """Turns the trace lines `append_events` and `commit_turn` write into outbox notices,
    written in the same step (None: no notices). Set once, before the store is used."""

    async def create_run(self, state: RunState) -> None:
        """Store a new run as given (revision included): its head and its whole transcript
        (`new_run_write`). Raises RunExists if the id is taken. Then `state.mark_stored()`."""
        ...

    async def load_run(self, run_id: str) -> RunState | None:
        """The stored run (its head and its transcript, read in one snapshot: `parse_run`),
        or None if there is none."""
        ...

    async def save_run(self, state: RunState, *, lease: Lease | None = None) -> None:
        """Save `state` if nobody saved since it was loaded (optimistic concurrency).

        `state.revision` must equal the stored revision, else StaleRun (RunNotFound if the
        run was never created). With `lease`, only while the run's fence is that lease
        (`Lease`), else LeaseLost; either refusal writes nothing. It writes `run_write(state, revision +
        1, now)`: the head, and of the transcript only what the store does not hold yet
        (`state.stored_messages`, `state.stored_per_turn`). On success the store holds
        revision + 1, `state.revision` and `state.updated_at` are updated in place and
        `state.mark_stored()` is called. Durable once it returns: a SIGKILL of the process
        right after loses nothing.
        """
        ...

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None,
                          audit: Sequence[AuditEntry] = (), *, lease: Lease | None = None) -> Ledger | None:
        """Save `state`, append `events`, book `booking` and record `audit` (the administrative
        act the save is, gateway.store.audit) as one step: all of it or nothing.

        The save is `save_run`'s (StaleRun, RunNotFound or, with `lease`, LeaseLost, and then
        nothing at all is written: no line, no notice, no booking on any ledger, no spend row,
        no audit record; on success `state.revision` and `state.updated_at` are updated in
        place), the events are `append_events`', the booking is `settle`'s or `charge`'s (see
        `Booking`). Durable once it returns. Returns the booking's team ledger (spent,
        reserved) right after, as `team_spend` would; None without a booking.
        """
        ...

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100,
                        policies: Collection[str] | None = None) -> list[RunState]:
        """Runs, newest first (by creation time), optionally of one team and/or one status and/or
        governed by one of `policies` (by name; an empty collection lists nothing). Only the
        runs that pass every filter are read and parsed, so a filter keeps a scan cheap."""
        ...

    async def append_events(self, run_id: str, events: list[Event], *, lease: Lease | None = None) -> None:
        """Append trace events to a run; they get the next sequence numbers (from 1), in order.
        With `lease`, only while the run's fence is that lease (`Lease`), else LeaseLost and
        nothing is appended (nor any notice of the events)."""
        ...

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        """The run's events with sequence number > `after`, in order, as (seq, event)."""
        ...

    async def reserve(
        self, team: str, period: str, amount_usd: float, budget_usd: float, ttl_s: float = DEFAULT_RESERVATION_TTL_S
    ) -> str | None:
        """Atomically hold `amount_usd` of the team's period budget.

        Succeeds only if spent + reserved + amount <= budget, across every process and replica
        sharing the store; returns a reservation id, or None if refused. Reservations older
        than `ttl_s` (their process presumably died) are released on the team's next reserve.
        """
        ...

    async def admit(self, claim: Claim) -> Grant:
        """Check and hold a `Claim` in one atomic step (see `Claim`); refusals hold nothing.
        RunExists (nothing written) when `claim.create` names a run that is stored already;
        with `lookup_in_admission`, the exception carries the stored run (`stored`)."""
        ...

    async def figures(self, team: str, period: str, run_id: str | None = None,
                      holds: Sequence[Hold] = ()) -> Figures:
        """The figures `admit` checks, now (a strict admission sizes its clamp from them)."""
        ...

    async def renew(self, reservation_ids: Sequence[str], ttl_s: float) -> None:
        """Push back the expiry of held reservations (their process is alive)."""
        ...

    async def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        """Release every reservation and every run lease `owner` still holds (each lease as
        `release_lease`: its fence "released"), and make the notices it was delivering due
        again at once (it restarted: an owner name is never live in two processes); returns
        how many reservations. The reservations in `keep` stay held: turns waiting in the
        spool, booked against them once the store takes them."""
        ...

    async def settle(self, reservation_id: str, actual_usd: float, tokens: Sequence[TokenCharge] = ()) -> None:
        """Turn a reservation into spending of `actual_usd` (more or less than reserved) on its
        team's ledger and on the ledgers of its holds, add it to the day's `SpendRow` of its
        attribution, and reconcile the `tokens` clocks with what the call really used.

        Idempotent: settling twice, or after release, books nothing more. A reservation that
        expired is still booked (the money was spent), for EXPIRED_RETENTION_S.
        """
        ...

    async def push_clocks(self, pushes: Sequence[ClockPush]) -> None:
        """Move each scope's rate clocks by its seconds (`ClockPush`), from no earlier than
        now: max(clock, now) + seconds; a kind pushed by 0 is left as it is."""
        ...

    async def release(self, reservation_id: str) -> None:
        """Give a reservation back unspent. Idempotent; a no-op after settle."""
        ...

    async def team_spend(self, team: str, period: str) -> tuple[float, float]:
        """(spent, reserved) USD of the team in the period; expired reservations not counted."""
        ...

    async def charge(self, team: str, period: str, amount_usd: float, attribution: Attribution | None = None) -> None:
        """Book spending without a reservation (sub-run roll-ups, spend already incurred), and
        add it to the day's `SpendRow` of `attribution` (None: the team's alone)."""
        ...

    async def spend(self, first_day: str, last_day: str, team: str | None = None) -> list[SpendRow]:
        """The spend rows of the days from `first_day` to `last_day` (UTC, "YYYY-MM-DD",
        both included), of one team or all. Every booking of a ledger adds to one row (its
        day is the booking's), so a team's rows over a budget period sum to its ledger."""
        ...

    async def prune_spend(self, before_day: str) -> int:
        """Retention: forget the spend rows of days before `before_day`; returns how many days."""
        ...

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        """Take (or extend) the right to drive a run for `ttl_s`, in one atomic step: the
        lease if it was free, released, expired or `owner`'s live one, else None. It keeps
        its epoch when the run's fence names `owner` (it was the last to take the run and did
        not release it); otherwise it gets a new, higher one and the fence names it (`Lease`),
        so a holder whose lease was taken by another meanwhile sees a different epoch on its
        next renewal, and knows it lost it."""
        ...

    async def release_lease(self, run_id: str, owner: str) -> None:
        """Give the lease back, if the run's fence names `owner` (its lease live or lapsed):
        the fence becomes "released", so writes under that epoch are refused from now on and
        the next lease gets a new epoch (`Lease`). A no-op if another owner took the run."""
        ...

    async def prune_runs(self, updated_before: float, *, events_only: bool = False) -> int:
        """Retention: delete runs that are not `running` and were last saved before
        `updated_before` (epoch seconds), with their events; with `events_only`, delete only
        their events and keep the runs. A `running` run is never touched (a pass-through run
        between calls, or one being driven). Works in batches, yielding to other calls in
        between; returns how many runs were pruned (with `events_only`: whose events were)."""
        ...

    async def prune_ledgers(self, ended_before: float) -> int:
        """Retention: delete the ledger figures of budget periods that ended before
        `ended_before` (epoch seconds; see `periods.period_end`). The current period, and a
        `total` period, never end. Returns how many (team, period) figures were deleted."""
        ...

    async def put_response(self, response_id: str, team: str, body: bytes) -> None:
        """Keep a stored Responses-API response (`body`, opaque JSON) under its id for `team`."""
        ...

    async def get_response(self, response_id: str) -> tuple[str, bytes] | None:
        """(team, body) of a stored response, or None."""
        ...

    async def delete_response(self, response_id: str) -> bool:
        """Forget a stored response; True if it was there."""
        ...

    async def prune_responses(self, created_before: float) -> int:
        """Retention: forget stored responses made before `created_before` (epoch seconds);
        returns how many."""
        ...

    async def enqueue_notices(self, notices: Sequence[Notice]) -> int:
        """Add notices to the outbox, due now; an id already there is left alone. Returns how
        many were added. Durable once it returns."""
        ...

    async def claim_notices(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        """Up to `limit` due notices, oldest due first, held for `owner` for `lease_s`: no
        other claim gets them until the lease ends (then they are due again, for anyone)."""
        ...

    async def notice_sent(self, notice_id: str) -> None:
        """The notice was delivered: never due again (kept until `prune_outbox`)."""
        ...

    async def notice_failed(self, notice_id: str, owner: str, retry_in_s: float | None, error: str) -> None:
        """A delivery attempt of `owner`'s claim failed: count it and make the notice due
        again in `retry_in_s`, or (None) give up on it for good. Nothing if `owner` no longer
        holds it (its lease ended and another claim took it)."""
        ...

    async def outbox_depth(self) -> int:
        """Notices not yet delivered nor given up (due now or later, claimed or not)."""
        ...

    async def prune_outbox(self, done_before: float) -> int:
        """Retention: forget notices delivered or given up before `done_before` (epoch
        seconds), except those whose budget `period` has not ended by then. Returns how many."""
        ...

    # --- keys, console sessions and the audit log (gateway.store.keys, gateway.store.audit) ---

    async def put_key(self, record: KeyRecord, expected_revision: int | None,
                      audit: Sequence[AuditEntry] = ()) -> KeyRecord:
        """Write a key record whole, and `audit`'s entries, in one step: all of it or nothing.

        `expected_revision` None: a new key (KeyExists if its id is taken); else the stored
        record's revision must equal it (StaleKey; KeyNotFound when there is none). The store
        gives the record the next revision of its one key counter (shared by every key, so
        `keys_since` finds every write) and returns it as stored. A key's `team` never changes.
        """
        ...

    async def get_key(self, key_id: str) -> KeyRecord | None:
        """The stored key (with its `last_used_at`), or None."""
        ...

    async def list_keys(self, team: str | None = None, *, after: str = "", limit: int = 100) -> list[KeyRecord]:
        """Keys in id order (creation order: `keys.new_key_id`) after the id `after`, of one
        team or of all; at most `limit`."""
        ...

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        """The keys written after `revision` (any order) and the store's last key revision
        (0 when no key was ever written). With nothing new, one cheap read: every process
        calls it about four times a second to keep its keyring current."""
        ...

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        """Set `last_used_at` of these keys (epoch s; never moved back), without a revision:
        a coarse figure, written by each process at most once a minute."""
        ...

    async def put_session(self, session: ConsoleSession, audit: Sequence[AuditEntry] = ()) -> None:
        """Store a console session (by `id_hash`, never the id) with `audit`'s entries, in one step."""
        ...

    async def get_session(self, id_hash: str) -> ConsoleSession | None:
        """The session, or None (never stored, deleted, or past `expires_at`)."""
        ...

    async def touch_session(self, id_hash: str, idle_until: float) -> None:
        """Push back a session's idle expiry (never moved back)."""
        ...

    async def delete_session(self, id_hash: str, audit: Sequence[AuditEntry] = ()) -> bool:
        """End a session, with `audit`'s entries, in one step; True if it was stored."""
        ...

    async def prune_sessions(self, now: float) -> int:
        """Retention: forget sessions past their idle or absolute expiry; returns how many."""
        ...

    async def append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        """Number and chain `entries` after the last record (`gateway.store.audit.chain`) and
        store them, in one step; returns them as stored. Durable once it returns."""
        ...

    async def audit_log(self, *, after_seq: int = 0, limit: int = 100, since: float | None = None,
                        action: str | None = None, team: str | None = None) -> list[AuditRecord]:
        """Records in order (`seq`) after `after_seq`, at or after `since` (epoch s), of one
        `action`, concerning or made by one `team` (`audit.matches`); at most `limit`."""
        ...

    async def prune_audit(self, before: float) -> int:
        """Retention: forget records written before `before` (epoch s), oldest first, always
        keeping the newest (the next record chains after it). Returns how many."""
        ...

    # --- reloads across replicas (gateway.server.reload_watch) ---

    async def reload_mark(self) -> ReloadMark:
        """The last reload announced: one cheap read (each process reads it about once per
        polling period, in the background, and when a notification of topic `reload` comes)."""
        ...

    async def announce_reload(self, origin: str) -> ReloadMark:
        """Count one more reload announced by `origin` (a process, or the workers of one
        server, that served its files anew) and return the mark as written. On a store that
        notifies (PostgreSQL), the notification of topic `reload` is sent in the same step."""
        ...

    async def close(self) -> None:
        """Release connections and files. Idempotent."""
        ...


def to_micros(usd: float, what: str) -> int:
    """USD -> integer micro-dollars, refusing non-numbers (TypeError), negative or non-finite amounts by name.

    Rounds to the nearest micro-dollar: price arithmetic leaves float dust (0.00247 is
    2469.9999999999995 micros), which must not become a whole micro-dollar.
    """
    if isinstance(usd, bool) or not isinstance(usd, (int, float)):
        raise TypeError(f"{what} must be a number of USD, got {usd!r}")
    if not math.isfinite(usd) or usd < 0:
        raise ValueError(f"{what} must be a finite amount >= 0 USD, got {usd!r}")
    return round(usd * MICROS_PER_USD)


def judge(claim: Claim, figures: Figures, run_exists: bool, rates: Sequence[RateState] = ()) -> Refusal | None:
    """Which of a claim's conditions the figures break, first in the order of `Refusal`."""
    if claim.run_id is not None and not run_exists:
        return "run_missing"
    if claim.max_turns is not None and figures.run_turns + figures.run_in_flight >= claim.max_turns:
        return "max_turns"
    if claim.max_in_flight is not None and figures.run_in_flight >= claim.max_in_flight:
        return "busy"
    amount = to_micros(claim.amount_usd, "amount_usd")
    if claim.run_budget_usd is not None and (to_micros(figures.run_cost_usd, "run_cost_usd")
                                             + to_micros(figures.run_held_usd, "run_held_usd") + amount
                                             > to_micros(claim.run_budget_usd, "run_budget_usd")):
        return "run_budget"
    for hold, (spent, reserved) in zip(claim.holds, figures.holds, strict=True):
        if to_micros(spent, "spent") + to_micros(reserved, "reserved") + amount > to_micros(hold.budget_usd, "budget"):
            return "key_budget" if hold.kind == "key" else "user_budget"
    if claim.budget_usd is not None and (to_micros(figures.spent_usd, "spent_usd")
                                         + to_micros(figures.reserved_usd, "reserved_usd") + amount
                                         > to_micros(claim.budget_usd, "budget_usd")):
        return "team_budget"
    if any(rate_refusal(limit, state, claim.tokens) for limit, state in zip(claim.rates, rates, strict=True)):
        return "rate_limit"
    return None


def spend_day(epoch_s: float) -> str:
    """The UTC day of a booking, as `SpendRow.day`."""
    return time.strftime("%Y-%m-%d", time.gmtime(epoch_s))


def optional_micros(usd: float | None, what: str) -> int | None:
    return None if usd is None else to_micros(usd, what)


def from_micros(micros: int) -> float:
    return micros / MICROS_PER_USD


def check_ttl(ttl_s: float, what: str, *, allow_zero: bool) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {ttl_s!r}")
    if not math.isfinite(ttl_s):
        raise ValueError(f"{what} must be a finite number of seconds, got {ttl_s!r}")
    if ttl_s < 0 or (ttl_s == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, got {ttl_s!r}")
    return float(ttl_s)


def check_list_args(status: str | None, limit: int, policies: Collection[str] | None = None) -> None:
    if status is not None and status not in STATUSES:
        raise ValueError(f"unknown run status {status!r}; expected one of {', '.join(STATUSES)}")
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an integer, got {limit!r}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit!r}")
    if isinstance(policies, str):
        raise TypeError(f"policies must be a collection of policy names, not the string {policies!r}")


def scope_tag(scope: str) -> str:
    """How a reservation lists the scopes whose calls in flight it counts in ("|team:a|")."""
    return f"|{scope}|"


def new_reservation_id() -> str:
    return "res_" + os.urandom(16).hex()


class RunWrite(NamedTuple):
    """A run as one write stores it: its head (`RunState.head_json`, the one place a store
    rewrites on every save, a few KB whatever the run's length) and what changed in its
    transcript, which a store keeps beside the head as items, each written once:

    - messages: keep the first `messages_from` stored ones, then store `messages` (JSON,
      one item each) at positions `messages_from`, `messages_from` + 1, ...;
    - `per_turn`: the same from `per_turn_from`, each entry b"prompt completion", or, the
      last one a save writes when it holds the ids of the model's calls recorded since the
      store last kept the run (schema 6), `[prompt, completion, [ids]]` as JSON (`turn_item`);
    - `truncates`: stored items past those positions must go first (a pass-through client
      sent a history that differs from the stored one); else there are none.

    The head's `transcript` counts what the store holds beside it after the write; a store
    reads back exactly that many of each (`parse_run`)."""

    head: bytes
    messages_from: int
    messages: list[bytes]
    per_turn_from: int
    per_turn: list[bytes]
    truncates: bool


def run_write(state: RunState, revision: int | None = None, updated_at: float | None = None) -> RunWrite:
    """What a save of `state` writes (`RunWrite`): its head at `revision` and `updated_at`
    (as they are when None) and the part of its transcript the store does not hold yet."""
    head = state.head_json()
    if revision is not None:
        head["revision"] = revision
    if updated_at is not None:
        head["updated_at"] = updated_at
    change = transcript_change(state)
    return RunWrite(orjson.dumps(head), change.messages_from, [orjson.dumps(m) for m in change.messages],
                    change.per_turn_from, _turn_items(change.per_turn, change.call_ids), change.truncates)


def new_run_write(state: RunState) -> RunWrite:
    """What storing `state` as a new run writes: its head and its whole transcript, the
    last `per_turn` entry holding every id of the model's calls (`state` is not changed:
    the write may be refused)."""
    return run_write(state.unstored())._replace(truncates=True)


def _turn_items(per_turn: Sequence[Usage], call_ids: list[str]) -> list[bytes]:
    """`per_turn` entries as stored items (`RunWrite.per_turn`): the last holds `call_ids`."""
    items = [b"%d %d" % (u.prompt_tokens, u.completion_tokens) for u in per_turn]
    if call_ids and items:
        last = per_turn[-1]
        items[-1] = orjson.dumps([last.prompt_tokens, last.completion_tokens, call_ids])
    return items


def turn_item(item: bytes | str) -> list[Any]:
    """A stored `per_turn` entry back (`RunWrite.per_turn`): [prompt, completion], and the
    ids of the model's calls third when it holds some."""
    raw = item.encode() if isinstance(item, str) else bytes(item)
    if raw[:1] == b"[":
        entry = orjson.loads(raw)
        if not isinstance(entry, list):
            raise StateError(f"a turn's stored entry is not a list: {raw[:80]!r}")
        return entry
    return [int(x) for x in raw.split()]


def parse_run(run_id: str, raw: bytes | str,
              transcript: tuple[Sequence[bytes | str], Sequence[bytes | str]] = ((), ())) -> RunState:
    """A stored run back: its head and the messages and `per_turn` entries kept beside it (a
    body stored before heads, schema 1 to 4, holds its transcript itself and nothing is
    kept beside it). The run knows what the store holds (`RunState.mark_stored`). An
    unreadable run is a StoreError naming it."""
    try:
        data = orjson.loads(raw)
        if isinstance(data, dict) and "transcript" in data:
            messages, entries = transcript
            state = RunState.from_json(data, ([orjson.loads(m) for m in messages], [turn_item(t) for t in entries]))
            state.mark_stored()
            return state
        return RunState.from_json(data)
    except orjson.JSONDecodeError as exc:
        raise StoreError(f"stored run {run_id!r} cannot be read: it is not valid JSON: {exc}") from exc
    except StateError as exc:
        raise StoreError(f"stored run {run_id!r} cannot be read: {exc}") from exc
