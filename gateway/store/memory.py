"""The in-memory store: the real contract without durability, for tests and one-off runs.

Runs and events are kept serialized, as the durable stores keep them, so a caller that
mutates a loaded run cannot reach into the store, and unserializable data fails here too.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import orjson

from gateway.harness.state import RunState
from gateway.store.audit import GENESIS, AuditEntry, AuditRecord, chain, matches
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    Attribution,
    Hold,
    SpendRow,
    spend_day,
    EXPIRED_RETENTION_S,
    Booking,
    Claim,
    ClockPush,
    Event,
    Figures,
    Grant,
    Lease,
    ReloadMark,
    Ledger,
    RateState,
    TokenCharge,
    check_list_args,
    check_ttl,
    from_micros,
    judge,
    new_reservation_id,
    optional_micros,
    RunWrite,
    new_run_write,
    parse_run,
    run_write,
    to_micros,
)
from gateway.store.errors import (
    AlreadyBooked,
    LeaseLost,
    RunExists,
    RunNotFound,
    StaleRun,
    StoreError,
)
from gateway.store.keys import ConsoleSession, KeyRecord, check_key_revision
from gateway.store.outbox import Claimed, Notice, NoticeRule, check_notices, notices_of
from gateway.store.periods import ended_before as period_ended


@dataclass
class _StoredRun:
    team: str
    status: str
    created_at: float
    order: int
    revision: int
    body: bytes
    turns: int = 0
    cost: int = 0
    updated_at: float = 0.0
    policy: str = ""  # a run's policy never changes
    messages: list[bytes] = field(default_factory=list)  # the transcript beside the head (`body`)
    per_turn: list[bytes] = field(default_factory=list)

    def write(self, w: RunWrite) -> None:
        self.body = w.head
        del self.messages[w.messages_from:]
        self.messages.extend(w.messages)
        del self.per_turn[w.per_turn_from:]
        self.per_turn.extend(w.per_turn)

    def parse(self, run_id: str) -> RunState:
        return parse_run(run_id, self.body, (self.messages, self.per_turn))


@dataclass
class _Reservation:
    team: str
    period: str
    amount: int
    expires_at: float
    expired: bool = False
    run_id: str | None = None
    owner: str = ""
    scopes: tuple[str, ...] = ()
    holds: tuple[tuple[str, str], ...] = ()  # (scope, period) of each budget it holds against
    attribution: Attribution | None = None

    def live(self, now: float) -> bool:
        return not self.expired and self.expires_at > now


@dataclass
class _Outgoing:
    body: bytes
    period: str | None
    due: float
    attempts: int = 0
    owner: str = ""
    done_at: float | None = None
    state: str = "pending"
    error: str = ""


class MemoryStore:
    """Every method completes without awaiting, so each one is atomic on the event loop."""

    lookup_in_admission = False  # a look-up is cheap here

    def __init__(self) -> None:
        self._runs: dict[str, _StoredRun] = {}
        self._events: dict[str, list[bytes]] = {}
        self._spent: dict[tuple[str, str], int] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._leases: dict[str, tuple[str, float, int]] = {}  # run -> owner, expiry, epoch
        self._epochs: dict[str, int] = {}  # run -> its lease's last epoch (kept after a release)
        self._fences: dict[str, tuple[str, int]] = {}  # run -> who last took its lease (owner, epoch); ("", 0) released
        self._responses: dict[str, tuple[str, bytes]] = {}
        self._spend: dict[tuple[str, str, Attribution], list[int]] = {}  # (day, team, who) -> [micros, calls]
        self._clocks: dict[str, list[float]] = {}  # rate scope -> [requests tat, tokens tat]
        self._response_times: dict[str, float] = {}
        self._outbox: dict[str, _Outgoing] = {}
        self.notice_rule: NoticeRule | None = None
        self._keys: dict[str, KeyRecord] = {}
        self._key_used: dict[str, float] = {}
        self._key_revision = 0
        self._sessions: dict[str, ConsoleSession] = {}
        self._audit: list[AuditRecord] = []
        self._audit_head = (0, GENESIS)
        self._reload = ReloadMark(0, "")
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("memory store is closed")

    async def create_run(self, state: RunState) -> None:
        self._check_open()
        if state.run_id in self._runs:
            raise RunExists(state.run_id)
        stored = _StoredRun(state.team, state.status, state.created_at, len(self._runs), state.revision, b"",
                            state.turns, to_micros(state.cost_usd, "cost_usd"), state.updated_at, state.policy)
        stored.write(new_run_write(state))
        self._runs[state.run_id] = stored
        state.mark_stored()

    async def load_run(self, run_id: str) -> RunState | None:
        self._check_open()
        stored = self._runs.get(run_id)
        return None if stored is None else stored.parse(run_id)

    async def save_run(self, state: RunState, *, lease: Lease | None = None) -> None:
        self._fence(lease)
        self._save(state, [])

    def _fence(self, lease: Lease | None) -> None:
        """LeaseLost unless `lease` (when given) is still the run's fence (`Lease`)."""
        self._check_open()
        if lease is None:
            return
        if self._fences.get(lease.run_id) != (lease.owner, lease.epoch):
            raise LeaseLost(lease.run_id, lease.epoch)

    def _save(self, state: RunState, events: list[Event]) -> None:
        """Checks first, then writes: nothing is changed when anything is refused."""
        self._check_open()
        stored = self._runs.get(state.run_id)
        if stored is None:
            raise RunNotFound(state.run_id)
        if stored.revision != state.revision:
            raise StaleRun(state.run_id, state.revision, stored.revision)
        now = time.time()
        written = run_write(state, state.revision + 1, now)
        encoded = [orjson.dumps(e) for e in events]
        notices = self._notices(state.run_id, events)
        stored.team, stored.status, stored.revision = state.team, state.status, state.revision + 1
        stored.write(written)
        stored.turns, stored.cost = state.turns, to_micros(state.cost_usd, "cost_usd")
        stored.updated_at = now
        if encoded:
            self._events.setdefault(state.run_id, []).extend(encoded)
        self._enqueue(notices)
        state.revision += 1
        state.updated_at = now
        state.mark_stored()

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None,
                          audit: Sequence[AuditEntry] = (), *, lease: Lease | None = None) -> Ledger | None:
        self._fence(lease)
        actual = 0 if booking is None else to_micros(booking.actual_usd, "actual_usd")
        rid = None if booking is None else booking.reservation_id
        if booking is not None and booking.if_held and rid is not None and rid not in self._reservations:
            raise AlreadyBooked(rid)
        self._save(state, events)
        self._append_audit(audit)
        if booking is None:
            return None
        if booking.reservation_id is not None:
            self._settle(booking.reservation_id, actual, booking.tokens)
        elif actual:
            self._book(booking.team, booking.period, actual, booking.attribution)
        return await self.team_spend(booking.team, booking.period)

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100,
                        policies: Collection[str] | None = None) -> list[RunState]:
        self._check_open()
        check_list_args(status, limit, policies)
        chosen = [
            (run_id, s)
            for run_id, s in self._runs.items()
            if (team is None or s.team == team) and (status is None or s.status == status)
            and (policies is None or s.policy in policies)
        ]
        chosen.sort(key=lambda item: (item[1].created_at, item[1].order), reverse=True)
        return [s.parse(run_id) for run_id, s in chosen[:limit]]

    async def append_events(self, run_id: str, events: list[Event], *, lease: Lease | None = None) -> None:
        self._check_open()
        self._fence(lease)
        encoded = [orjson.dumps(e) for e in events]
        notices = self._notices(run_id, events)
        self._events.setdefault(run_id, []).extend(encoded)
        self._enqueue(notices)

    def _notices(self, run_id: str, events: list[Event]) -> Sequence[Notice]:
        return notices_of(self.notice_rule, run_id, events)

    def _enqueue(self, notices: Sequence[Notice]) -> int:
        now = time.time()
        added = 0
        for n in notices:
            if n.id not in self._outbox:
                self._outbox[n.id] = _Outgoing(n.body, n.period, now)
                added += 1
        return added

    async def enqueue_notices(self, notices: Sequence[Notice]) -> int:
        self._check_open()
        check_notices(notices)
        return self._enqueue(notices)

    async def claim_notices(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        self._check_open()
        lease = check_ttl(lease_s, "lease_s", allow_zero=False)
        now = time.time()
        due = sorted((o.due, nid) for nid, o in self._outbox.items() if o.state == "pending" and o.due <= now)
        out = []
        for _, nid in due[:max(limit, 0)]:
            o = self._outbox[nid]
            o.due, o.owner = now + lease, owner
            out.append(Claimed(nid, o.body, o.attempts))
        return out

    async def notice_sent(self, notice_id: str) -> None:
        self._check_open()
        o = self._outbox.get(notice_id)
        if o is not None and o.state == "pending":
            o.state, o.done_at, o.attempts = "delivered", time.time(), o.attempts + 1

    async def notice_failed(self, notice_id: str, owner: str, retry_in_s: float | None, error: str) -> None:
        self._check_open()
        o = self._outbox.get(notice_id)
        if o is None or o.state != "pending" or o.owner != owner:
            return
        o.attempts, o.error, o.owner = o.attempts + 1, error, ""
        if retry_in_s is None:
            o.state, o.done_at = "failed", time.time()
        else:
            o.due = time.time() + check_ttl(retry_in_s, "retry_in_s", allow_zero=True)

    async def outbox_depth(self) -> int:
        self._check_open()
        return sum(1 for o in self._outbox.values() if o.state == "pending")

    async def prune_outbox(self, done_before: float) -> int:
        self._check_open()
        old = [nid for nid, o in self._outbox.items() if o.done_at is not None and o.done_at < done_before
               and (o.period is None or period_ended(o.period, done_before))]
        for nid in old:
            del self._outbox[nid]
        return len(old)

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        self._check_open()
        stored = self._events.get(run_id, [])
        start = max(after, 0)
        return [(start + i + 1, orjson.loads(raw)) for i, raw in enumerate(stored[start:])]

    def _reclaim(self, team: str, now: float) -> None:
        for rid, r in list(self._reservations.items()):
            if r.team != team or r.expires_at > now:
                continue
            if r.expires_at + EXPIRED_RETENTION_S <= now:
                del self._reservations[rid]
            else:
                r.expired = True

    def _reserved(self, team: str, period: str, now: float) -> int:
        return sum(r.amount for r in self._reservations.values() if r.team == team and r.period == period and r.live(now))

    def _figures(self, team: str, period: str, run_id: str | None, now: float,
                 holds: Sequence[Hold] = ()) -> tuple[Figures, _StoredRun | None]:
        run = None if run_id is None else self._runs.get(run_id)
        slots = [] if run_id is None else [r for r in self._reservations.values() if r.run_id == run_id and r.live(now)]
        held = tuple((from_micros(self._spent.get((h.scope, h.period), 0)), from_micros(sum(
            r.amount for r in self._reservations.values() if (h.scope, h.period) in r.holds and r.live(now))))
            for h in holds)
        figures = Figures(from_micros(self._spent.get((team, period), 0)), from_micros(self._reserved(team, period, now)),
                          run.turns if run else 0, len(slots), from_micros(run.cost) if run else 0.0,
                          from_micros(sum(r.amount for r in slots)), held)
        return figures, run

    async def admit(self, claim: Claim) -> Grant:
        self._check_open()
        optional_micros(claim.budget_usd, "budget_usd")
        optional_micros(claim.run_budget_usd, "run_budget_usd")
        amount = to_micros(claim.amount_usd, "amount_usd")
        ttl = check_ttl(claim.ttl_s, "ttl_s", allow_zero=True)
        if claim.create is not None:
            await self.create_run(claim.create)
        now = time.time()
        self._reclaim(claim.team, now)
        figures, run = self._figures(claim.team, claim.period, claim.run_id, now, claim.holds)
        rates = tuple(self._rate_state(limit.scope, now, limit.max_in_flight is not None) for limit in claim.rates)
        refused = judge(claim, figures, run is not None, rates)
        if refused is not None:
            return Grant(None, refused, figures, rates)
        rid = new_reservation_id()
        self._reservations[rid] = _Reservation(claim.team, claim.period, amount, now + ttl, run_id=claim.run_id,
                                               owner=claim.owner, scopes=tuple(
                                                   r.scope for r in claim.rates if r.max_in_flight is not None),
                                               holds=tuple((h.scope, h.period) for h in claim.holds),
                                               attribution=claim.attribution)
        for limit in claim.rates:
            clock = self._clocks.setdefault(limit.scope, [0.0, 0.0])
            if limit.requests_s is not None:
                clock[0] = max(clock[0], now) + limit.requests_s
            if limit.tokens_s is not None:
                clock[1] = max(clock[1], now) + claim.tokens * limit.tokens_s
        after = tuple(self._rate_state(limit.scope, now, limit.max_in_flight is not None) for limit in claim.rates)
        return Grant(rid, None, figures, after, run_revision=None if run is None else run.revision)

    def _rate_state(self, scope: str, now: float, counted: bool) -> RateState:
        clock = self._clocks.get(scope, (0.0, 0.0))
        in_flight = sum(1 for r in self._reservations.values() if scope in r.scopes and r.live(now)) if counted else 0
        return RateState(scope, now, clock[0], clock[1], in_flight)

    def _charge_tokens(self, tokens: Sequence[TokenCharge]) -> None:
        self._push([ClockPush(c.scope, 0.0, c.tokens * c.tokens_s) for c in tokens])

    def _push(self, pushes: Sequence[ClockPush]) -> None:
        now = time.time()
        for push in pushes:
            clock = self._clocks.setdefault(push.scope, [0.0, 0.0])
            if push.requests_s:
                clock[0] = max(clock[0], now) + push.requests_s
            if push.tokens_s:
                clock[1] = max(clock[1], now) + push.tokens_s

    async def figures(self, team: str, period: str, run_id: str | None = None,
                      holds: Sequence[Hold] = ()) -> Figures:
        self._check_open()
        return self._figures(team, period, run_id, time.time(), holds)[0]

    async def renew(self, reservation_ids: Sequence[str], ttl_s: float) -> None:
        self._check_open()
        until = time.time() + check_ttl(ttl_s, "ttl_s", allow_zero=False)
        for rid in reservation_ids:
            r = self._reservations.get(rid)
            if r is not None and not r.expired:
                r.expires_at = max(r.expires_at, until)

    async def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        self._check_open()
        mine = [rid for rid, r in self._reservations.items() if r.owner == owner and not r.expired and rid not in keep]
        for rid in mine:
            del self._reservations[rid]
        for run_id in [run_id for run_id, (held_by, _, _) in self._leases.items() if held_by == owner and owner]:
            del self._leases[run_id]
            self._fences[run_id] = ("", 0)
        now = time.time()
        for o in self._outbox.values():
            if o.state == "pending" and owner and o.owner == owner:
                o.due, o.owner = now, ""
        return len(mine)

    async def reserve(
        self, team: str, period: str, amount_usd: float, budget_usd: float, ttl_s: float = DEFAULT_RESERVATION_TTL_S
    ) -> str | None:
        to_micros(budget_usd, "budget_usd")
        return (await self.admit(Claim(team, period, amount_usd, budget_usd, ttl_s=ttl_s))).reservation_id

    async def settle(self, reservation_id: str, actual_usd: float, tokens: Sequence[TokenCharge] = ()) -> None:
        self._check_open()
        self._settle(reservation_id, to_micros(actual_usd, "actual_usd"), tokens)

    def _settle(self, reservation_id: str, actual: int, tokens: Sequence[TokenCharge] = ()) -> None:
        r = self._reservations.pop(reservation_id, None)
        if r is not None:
            self._book(r.team, r.period, actual, r.attribution)
            for scope, period in r.holds:
                self._spent[(scope, period)] = self._spent.get((scope, period), 0) + actual
            self._charge_tokens(tokens)

    def _book(self, team: str, period: str, actual: int, attribution: Attribution | None) -> None:
        self._spent[(team, period)] = self._spent.get((team, period), 0) + actual
        row = self._spend.setdefault((spend_day(time.time()), team, attribution or Attribution()), [0, 0])
        row[0] += actual
        row[1] += 1

    async def push_clocks(self, pushes: Sequence[ClockPush]) -> None:
        self._check_open()
        self._push(pushes)

    async def release(self, reservation_id: str) -> None:
        self._check_open()
        self._reservations.pop(reservation_id, None)

    async def team_spend(self, team: str, period: str) -> tuple[float, float]:
        self._check_open()
        now = time.time()
        return from_micros(self._spent.get((team, period), 0)), from_micros(self._reserved(team, period, now))

    async def charge(self, team: str, period: str, amount_usd: float, attribution: Attribution | None = None) -> None:
        self._check_open()
        self._book(team, period, to_micros(amount_usd, "amount_usd"), attribution)

    async def spend(self, first_day: str, last_day: str, team: str | None = None) -> list[SpendRow]:
        self._check_open()
        return [SpendRow(day, t, *who, micros, calls) for (day, t, who), (micros, calls) in sorted(self._spend.items())
                if first_day <= day <= last_day and (team is None or t == team)]

    async def prune_spend(self, before_day: str) -> int:
        self._check_open()
        old = [k for k in self._spend if k[0] < before_day]
        for k in old:
            del self._spend[k]
        return len({k[0] for k in old})

    async def prune_runs(self, updated_before: float, *, events_only: bool = False) -> int:
        self._check_open()
        old = [run_id for run_id, s in self._runs.items() if s.status != "running" and s.updated_at < updated_before]
        if events_only:
            return sum(1 for run_id in old if self._events.pop(run_id, None) is not None)
        for run_id in old:
            del self._runs[run_id]
            self._events.pop(run_id, None)
            self._leases.pop(run_id, None)
            self._epochs.pop(run_id, None)
            self._fences.pop(run_id, None)
        return len(old)

    async def prune_ledgers(self, ended_before: float) -> int:
        self._check_open()
        old = [key for key in self._spent if period_ended(key[1], ended_before)]
        for key in old:
            del self._spent[key]
        return len(old)

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        self._check_open()
        ttl = check_ttl(ttl_s, "ttl_s", allow_zero=False)
        now = time.time()
        held = self._leases.get(run_id)
        if held is not None and held[0] != owner and held[1] > now:
            return None
        fence = self._fences.get(run_id)
        if fence is not None and fence[0] == owner:  # ours, live or lapsed with nobody taking it: extended
            epoch = fence[1]
        else:
            epoch = self._epochs[run_id] = self._epochs.get(run_id, 0) + 1
            self._fences[run_id] = (owner, epoch)
        self._leases[run_id] = (owner, now + ttl, epoch)
        return Lease(run_id, owner, epoch)

    async def release_lease(self, run_id: str, owner: str) -> None:
        self._check_open()
        held = self._leases.get(run_id)
        if held is not None and held[0] == owner:
            del self._leases[run_id]
            self._fences[run_id] = ("", 0)

    async def put_response(self, response_id: str, team: str, body: bytes) -> None:
        self._check_open()
        self._responses[response_id] = (team, bytes(body))
        self._response_times[response_id] = time.time()

    async def get_response(self, response_id: str) -> tuple[str, bytes] | None:
        self._check_open()
        return self._responses.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        self._check_open()
        self._response_times.pop(response_id, None)
        return self._responses.pop(response_id, None) is not None

    async def prune_responses(self, created_before: float) -> int:
        self._check_open()
        old = [rid for rid, at in self._response_times.items() if at < created_before]
        for rid in old:
            self._responses.pop(rid, None)
            del self._response_times[rid]
        return len(old)

    # --- keys, sessions, audit ------------------------------------------------------------

    async def put_key(self, record: KeyRecord, expected_revision: int | None,
                      audit: Sequence[AuditEntry] = ()) -> KeyRecord:
        self._check_open()
        stored = self._keys.get(record.id)
        check_key_revision(record.id, expected_revision, None if stored is None else stored.revision)
        self._key_revision += 1
        saved = replace(record, revision=self._key_revision, last_used_at=None)
        self._keys[record.id] = saved
        self._append_audit(audit)
        return replace(saved, last_used_at=self._key_used.get(record.id))

    async def get_key(self, key_id: str) -> KeyRecord | None:
        self._check_open()
        stored = self._keys.get(key_id)
        return None if stored is None else replace(stored, last_used_at=self._key_used.get(key_id))

    async def list_keys(self, team: str | None = None, *, after: str = "", limit: int = 100) -> list[KeyRecord]:
        self._check_open()
        ids = sorted(i for i, k in self._keys.items() if i > after and (team is None or k.team == team))
        return [replace(self._keys[i], last_used_at=self._key_used.get(i)) for i in ids[:max(limit, 0)]]

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        self._check_open()
        return [k for k in self._keys.values() if k.revision > revision], self._key_revision

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        self._check_open()
        for key_id, at in used.items():
            if key_id in self._keys:
                self._key_used[key_id] = max(at, self._key_used.get(key_id, 0.0))

    async def put_session(self, session: ConsoleSession, audit: Sequence[AuditEntry] = ()) -> None:
        self._check_open()
        self._sessions[session.id_hash] = session
        self._append_audit(audit)

    async def get_session(self, id_hash: str) -> ConsoleSession | None:
        self._check_open()
        found = self._sessions.get(id_hash)
        return found if found is not None and found.expires_at > time.time() else None

    async def touch_session(self, id_hash: str, idle_until: float) -> None:
        self._check_open()
        found = self._sessions.get(id_hash)
        if found is not None and idle_until > found.idle_until:
            self._sessions[id_hash] = replace(found, idle_until=idle_until)

    async def delete_session(self, id_hash: str, audit: Sequence[AuditEntry] = ()) -> bool:
        self._check_open()
        found = self._sessions.pop(id_hash, None) is not None
        self._append_audit(audit)
        return found

    async def prune_sessions(self, now: float) -> int:
        self._check_open()
        old = [h for h, s in self._sessions.items() if not s.live(now)]
        for h in old:
            del self._sessions[h]
        return len(old)

    def _append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        if not entries:
            return []
        records = chain(*self._audit_head, entries, time.time())
        self._audit.extend(records)
        self._audit_head = (records[-1].seq, records[-1].hash)
        return records

    async def append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        self._check_open()
        return self._append_audit(entries)

    async def audit_log(self, *, after_seq: int = 0, limit: int = 100, since: float | None = None,
                        action: str | None = None, team: str | None = None) -> list[AuditRecord]:
        self._check_open()
        found = [r for r in self._audit if r.seq > after_seq and matches(r, since, action, team)]
        return found[:max(limit, 0)]

    async def prune_audit(self, before: float) -> int:
        self._check_open()
        keep_from = next((i for i, r in enumerate(self._audit) if r.at >= before), len(self._audit))
        keep_from = min(keep_from, len(self._audit) - 1) if self._audit else 0
        del self._audit[:keep_from]
        return keep_from

    async def reload_mark(self) -> ReloadMark:
        self._check_open()
        return self._reload

    async def announce_reload(self, origin: str) -> ReloadMark:
        self._check_open()
        self._reload = ReloadMark(self._reload.generation + 1, origin)
        return self._reload

    async def close(self) -> None:
        self._closed = True
