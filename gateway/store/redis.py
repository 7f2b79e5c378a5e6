"""The Redis store: runs, traces, ledgers and leases shared by several gateway replicas.

Every read-check-write is one Lua script, so it is atomic across replicas; reservation
expiry uses the Redis server's clock (TIME), which all replicas share. Durability is the
server's (configure appendonly for it); this module adds no caching.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Final, NamedTuple, cast

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # redis-py before 7: no such notifications, nothing to turn off
    _PLAIN_POOL: dict[str, Any] = {}
else:
    # Their default ("auto") makes the pool skip its check of an idle connection before use
    # (`ensure_connection`), so one the server closed (a restart, a failover) was used as it
    # was, and with no retries the first call after the restart was refused with a 503.
    _PLAIN_POOL = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}

from gateway.harness.state import RunState
from gateway.store import redis_lua
from gateway.store.audit import GENESIS, AuditEntry, AuditRecord, chain, matches
from gateway.store.base import (
    DEFAULT_RESERVATION_TTL_S,
    Attribution,
    Hold,
    SpendRow,
    spend_day,
    EXPIRED_RETENTION_S,
    PRUNE_BATCH,
    Booking,
    Claim,
    ClockPush,
    Event,
    Figures,
    Grant,
    Lease,
    ReloadMark,
    Ledger,
    RateLimit,
    RateState,
    Refusal,
    TokenCharge,
    check_list_args,
    check_ttl,
    from_micros,
    new_reservation_id,
    optional_micros,
    RunWrite,
    new_run_write,
    parse_run,
    run_write,
    to_micros,
)
from gateway.store.dsn import redact
from gateway.store.errors import (
    AlreadyBooked,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    RunExists,
    RunNotFound,
    StaleKey,
    StaleRun,
    StoreError,
)
from gateway.store.keys import ConsoleSession, KeyRecord
from gateway.store.outbox import Claimed, Notice, NoticeRule, check_notices
from gateway.store.periods import ended_before as period_ended
from gateway.store.redis_wire import Lane, Script, Unconfirmed, Wait

DEFAULT_PREFIX: Final = "gw:"
DEFAULT_TIMEOUT_S: Final = 2.0
DEFAULT_WAIT_TIMEOUT_S: Final = 0.5
"""How long replicas have to confirm a write when `store.wait_replicas` asks them to."""
_RETENTION_MS: Final = str(int(EXPIRED_RETENTION_S * 1000))
_ANNOUNCE_RELOAD: Final = Script(redis_lua.ANNOUNCE_RELOAD)
_CREATE_RUN: Final = Script(redis_lua.CREATE_RUN)
_LOAD_RUN: Final = Script(redis_lua.LOAD_RUN, writes=False)
_SAVE_RUN: Final = Script(redis_lua.SAVE_RUN)
_COMMIT_TURN: Final = Script(redis_lua.COMMIT_TURN)
_LIST_RUNS: Final = Script(redis_lua.LIST_RUNS, writes=False)
_ADMIT: Final = Script(redis_lua.ADMIT)
_FIGURES: Final = Script(redis_lua.FIGURES, writes=False)  # its reclaim is made again by the next admission
_RENEW: Final = Script(redis_lua.RENEW)
_RELEASE_OWNER: Final = Script(redis_lua.RELEASE_OWNER)
_SETTLE: Final = Script(redis_lua.SETTLE)
_RELEASE: Final = Script(redis_lua.RELEASE)
_PUSH_CLOCKS: Final = Script(redis_lua.PUSH_CLOCKS)
_TEAM_SPEND: Final = Script(redis_lua.TEAM_SPEND, writes=False)
_ACQUIRE_LEASE: Final = Script(redis_lua.ACQUIRE_LEASE, keys=4)
_RELEASE_LEASE: Final = Script(redis_lua.RELEASE_LEASE, keys=3)
_PRUNE_RUNS: Final = Script(redis_lua.PRUNE_RUNS)
_ENQUEUE: Final = Script(redis_lua.ENQUEUE)
_APPEND_EVENTS: Final = Script(redis_lua.APPEND_EVENTS)
_CLAIM_NOTICES: Final = Script(redis_lua.CLAIM_NOTICES)
_NOTICE_OUTCOME: Final = Script(redis_lua.NOTICE_OUTCOME)
_PUT_KEY: Final = Script(redis_lua.PUT_KEY)
_CHARGE: Final = Script(redis_lua.CHARGE)
_KEYS_SINCE: Final = Script(redis_lua.KEYS_SINCE, writes=False)
_LIST_KEYS: Final = Script(redis_lua.LIST_KEYS, writes=False)
_TOUCH_KEYS: Final = Script(redis_lua.TOUCH_KEYS)
_PUT_SESSION: Final = Script(redis_lua.PUT_SESSION)
_DELETE_SESSION: Final = Script(redis_lua.DELETE_SESSION)
_APPEND_AUDIT: Final = Script(redis_lua.APPEND_AUDIT)
_PRUNE_AUDIT: Final = Script(redis_lua.PRUNE_AUDIT)
AUDIT_ATTEMPTS: Final = 64
"""A step with audit entries is chained after the head it read; another replica's audited
step in between makes it chain again, this many times at most."""
AUDIT_PAGE: Final = 500


class _Translate:
    """Turns client errors (connection refused, timeouts) into StoreError naming the server.

    A lost connection also drops the idle connections (the store's lane's and the pool's):
    they were opened to the same server and are as dead as this one, so after a restart of
    Redis the next calls connect afresh instead of each failing once on a stale socket.
    """

    def __init__(self, url: str, store: RedisStore) -> None:
        self.url = redact(url)
        self.store = store

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if isinstance(exc, RedisError):
            client = self.store._client
            if isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self.store._lane.drop_idle()
                    await client.connection_pool.disconnect(inuse_connections=False)
            raise StoreError(f"redis store {self.url}: {exc}") from exc


class RedisStore:
    """The store in a Redis server; every replica pointing at the same url and prefix shares it."""

    lookup_in_admission = True  # a look-up is a round trip; ADMIT reports a stored run

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wait_replicas: int = 0, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._errors = _Translate(url, self)
        # Every command has a deadline: a frozen server (SIGSTOP, a stalled network) is a
        # StoreError after timeout_s, never a call that waits forever. No retries: the
        # client's default retries multiply the deadline, and a command that timed out may
        # have run (a booking sent twice would be booked twice).
        self._client: aioredis.Redis | None = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            **_PLAIN_POOL)
        # The scripts (every call's round trips) go through a lane of their own, with the same
        # deadline and no retries either (redis_wire); the client serves the other commands.
        # With `wait_replicas`, each write returns once that many replicas have it (WAIT, in
        # the same round trip); one they did not confirm in time is a failed write.
        self._lane = Lane(self._client.connection_pool, timeout_s,
                          Wait(wait_replicas, wait_timeout_s) if wait_replicas > 0 else None)
        self.notice_rule: NoticeRule | None = None
        self._audit_turn = asyncio.Lock()

    async def server_settings(self, *names: str) -> dict[str, str] | None:
        """The server's own settings of these names (CONFIG GET), or None when it refuses
        CONFIG (managed Redis offerings often do); StoreError when it cannot be reached."""
        client = self._redis()
        found: dict[str, str] = {}
        async with self._errors:
            try:
                for name in names:
                    found.update({_text(k): _text(v) for k, v in (await client.config_get(name)).items()})
            except ResponseError:  # unknown, renamed or forbidden command: not an outage
                return None
        return found

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreError(f"redis store {redact(self.url)} is closed")
        return self._client

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    async def create_run(self, state: RunState) -> None:
        self._redis()
        async with self._errors:
            created = await self._lane.run(_CREATE_RUN, [self.prefix, *_run_fields(state)])
        if int(created) != 1:
            raise RunExists(state.run_id)
        state.mark_stored()

    async def load_run(self, run_id: str) -> RunState | None:
        self._redis()
        async with self._errors:
            found: list[Any] = await self._lane.run(_LOAD_RUN, [self.prefix, run_id])
        return _parsed(run_id, found) if found else None

    async def save_run(self, state: RunState, *, lease: Lease | None = None) -> None:
        now = time.time()
        revision = state.revision + 1
        written = run_write(state, revision, now)
        self._redis()
        async with self._errors:
            result: list[Any] = await self._lane.run(_SAVE_RUN, [
                self.prefix, state.run_id, str(state.revision), str(revision), state.status, state.team, written.head,
                str(state.turns), str(to_micros(state.cost_usd, "cost_usd")), _lease_value(lease),
                *_transcript_args(written)])
        self._check_saved(state, result, lease=lease)
        state.revision = revision
        state.updated_at = now
        state.mark_stored()

    @staticmethod
    def _check_saved(state: RunState, result: list[Any], reservation_id: str | None = None,
                     lease: Lease | None = None) -> None:
        if int(result[0]) == 4 and lease is not None:
            raise LeaseLost(state.run_id, lease.epoch)
        if int(result[0]) == 3:
            raise AlreadyBooked(reservation_id or "")
        if int(result[0]) == 0:
            raise RunNotFound(state.run_id)
        if int(result[0]) == 2:
            raise StaleRun(state.run_id, state.revision, int(result[1]))

    async def commit_turn(self, state: RunState, events: list[Event], booking: Booking | None = None,
                          audit: Sequence[AuditEntry] = (), *, lease: Lease | None = None) -> Ledger | None:
        actual = 0 if booking is None else to_micros(booking.actual_usd, "actual_usd")
        now = time.time()
        revision = state.revision + 1
        written = run_write(state, revision, now)
        args: list[Any] = [self.prefix, state.run_id, str(state.revision), str(revision), state.status, state.team,
                           written.head, str(state.turns), str(to_micros(state.cost_usd, "cost_usd"))]
        if booking is None:
            args += ["0", "", "0", "", "", _RETENTION_MS]
        else:
            flag = "2" if booking.if_held and booking.reservation_id else "1"
            args += [flag, booking.reservation_id or "", str(actual), booking.team, booking.period, _RETENTION_MS]
        charges = () if booking is None else booking.tokens
        args += [_lease_value(lease), *_transcript_args(written), str(len(events)), *(orjson.dumps(e) for e in events),
                 str(len(charges)), *_charges(charges)]
        notices = self._notice_args(state.run_id, events)
        self._redis()

        async def run(audited: list[Any]) -> list[Any]:
            async with self._errors:
                return cast(list[Any], await self._lane.run(_COMMIT_TURN, [*args, *audited, *notices]))

        result, _ = await self._audited(audit, run)
        self._check_saved(state, result, None if booking is None else booking.reservation_id, lease)
        state.revision = revision
        state.updated_at = now
        state.mark_stored()
        return None if booking is None else (from_micros(int(result[1])), from_micros(int(result[2])))

    async def list_runs(self, team: str | None = None, status: str | None = None, limit: int = 100,
                        policies: Collection[str] | None = None) -> list[RunState]:
        check_list_args(status, limit, policies)
        if policies is not None and not policies:
            return []
        wanted = "" if policies is None else "|" + "|".join(sorted(set(policies))) + "|"
        self._redis()
        async with self._errors:
            flat: list[Any] = await self._lane.run(
                _LIST_RUNS, [self.prefix, team or "", status or "", str(limit), wanted])
        return [_parsed(_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]

    async def append_events(self, run_id: str, events: list[Event], *, lease: Lease | None = None) -> None:
        if not events:
            return
        encoded = [orjson.dumps(e) for e in events]
        notices = self._notice_args(run_id, events)
        if not notices and lease is None:
            self._redis()
            async with self._errors:
                await self._lane.command("RPUSH", self._key("events", run_id), *encoded, writes=True)
            return
        self._redis()
        async with self._errors:
            added = await self._lane.run(_APPEND_EVENTS, [self.prefix, run_id, _lease_value(lease), str(len(encoded)),
                                                          *encoded, *notices])
        if int(added) < 0 and lease is not None:
            raise LeaseLost(run_id, lease.epoch)

    def _notice_args(self, run_id: str, events: list[Event]) -> list[str | bytes]:
        """The notices of `events` as the Lua scripts take them: id, body, period triples."""
        notices = self.notice_rule(run_id, events) if self.notice_rule is not None and events else ()
        return _notice_triples(notices)

    async def events(self, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
        start = max(after, 0)
        async with self._errors:
            raw = await self._redis().lrange(self._key("events", run_id), start, -1)
        return [(start + i + 1, orjson.loads(item)) for i, item in enumerate(raw)]

    async def reserve(
        self, team: str, period: str, amount_usd: float, budget_usd: float, ttl_s: float = DEFAULT_RESERVATION_TTL_S
    ) -> str | None:
        to_micros(budget_usd, "budget_usd")
        return (await self.admit(Claim(team, period, amount_usd, budget_usd, ttl_s=ttl_s))).reservation_id

    async def admit(self, claim: Claim) -> Grant:
        amount = to_micros(claim.amount_usd, "amount_usd")
        budget = optional_micros(claim.budget_usd, "budget_usd")
        run_budget = optional_micros(claim.run_budget_usd, "run_budget_usd")
        ttl_ms = round(check_ttl(claim.ttl_s, "ttl_s", allow_zero=True) * 1000)
        rid = new_reservation_id()
        args: list[Any] = [self.prefix, claim.team, claim.period, str(amount), _opt(budget), str(ttl_ms), rid, _RETENTION_MS,
                claim.run_id or "", _opt(claim.max_turns), _opt(claim.max_in_flight), _opt(run_budget), claim.owner,
                str(claim.tokens)]
        scopes = _scopes(claim.rates, claim.team) if claim.rates else _NO_SCOPES
        args += scopes.head
        if scopes.args:
            args += scopes.args
        args.append("" if claim.attribution is None else claim.attribution.encoded())
        args.append(str(len(claim.holds)))
        if claim.holds:
            args += [f"{h.kind} {to_micros(h.budget_usd, 'budget')} {h.period} {h.scope}" for h in claim.holds]
        if claim.create is not None:
            args += _run_fields(claim.create)
        self._redis()
        async with self._errors:
            try:
                result: list[Any] = await self._lane.run(_ADMIT, args)
            except Unconfirmed as exc:  # not held where a failover would find it: give it back, and fail
                if isinstance(exc.reply, list) and exc.reply and int(exc.reply[0]) == 1:
                    with contextlib.suppress(RedisError):
                        await self._lane.run(_RELEASE, [self.prefix, rid])
                raise
        if int(result[0]) == 2 and claim.create is not None:
            run_id = claim.create.run_id
            raise RunExists(run_id, _parsed(run_id, result[1]) if result[1] else None)
        if claim.create is not None:
            claim.create.mark_stored()
        if int(result[0]) == 1:
            revision = None if claim.run_id is None else int(result[2])
            return Grant(rid, rates=_granted(claim, scopes, result[1]) if claim.rates else (), run_revision=revision)
        tail = len(result) - 2 * len(claim.holds)
        return Grant(None, cast(Refusal, _text(result[1])), _figures(result[2:8], result[tail:]),
                     _clocks(claim, scopes, result[8:tail]))

    async def figures(self, team: str, period: str, run_id: str | None = None,
                      holds: Sequence[Hold] = ()) -> Figures:
        self._redis()
        async with self._errors:
            result: list[Any] = await self._lane.run(
                _FIGURES, [self.prefix, team, period, run_id or "", _RETENTION_MS,
                           *(f"{h.period} {h.scope}" for h in holds)])
        return _figures(result[:6], result[6:])

    async def renew(self, reservation_ids: Sequence[str], ttl_s: float) -> None:
        if not reservation_ids:
            return
        ttl_ms = max(1, math.ceil(check_ttl(ttl_s, "ttl_s", allow_zero=False) * 1000))
        self._redis()
        async with self._errors:
            await self._lane.run(_RENEW, [self.prefix, str(ttl_ms), *reservation_ids])

    async def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        self._redis()
        async with self._errors:
            return int(await self._lane.run(_RELEASE_OWNER, [self.prefix, owner, *sorted(keep)]))

    async def settle(self, reservation_id: str, actual_usd: float, tokens: Sequence[TokenCharge] = ()) -> None:
        actual = to_micros(actual_usd, "actual_usd")
        self._redis()
        async with self._errors:
            await self._lane.run(_SETTLE, [self.prefix, reservation_id, str(actual), *_charges(tokens)])

    async def push_clocks(self, pushes: Sequence[ClockPush]) -> None:
        self._redis()
        if not pushes:
            return
        async with self._errors:
            await self._lane.run(_PUSH_CLOCKS, [self.prefix, *(f"{p.requests_s!r} {p.tokens_s!r} {p.scope}"
                                                               for p in pushes)])

    async def release(self, reservation_id: str) -> None:
        self._redis()
        async with self._errors:
            await self._lane.run(_RELEASE, [self.prefix, reservation_id])

    async def team_spend(self, team: str, period: str) -> tuple[float, float]:
        self._redis()
        async with self._errors:
            spent, reserved = await self._lane.run(_TEAM_SPEND, [self.prefix, team, period, _RETENTION_MS])
        return from_micros(int(spent)), from_micros(int(reserved))

    async def charge(self, team: str, period: str, amount_usd: float, attribution: Attribution | None = None) -> None:
        amount = to_micros(amount_usd, "amount_usd")
        self._redis()
        async with self._errors:
            await self._lane.run(_CHARGE, [self.prefix, team, period, str(amount),
                                           "" if attribution is None else attribution.encoded()])

    async def spend(self, first_day: str, last_day: str, team: str | None = None) -> list[SpendRow]:
        client = self._redis()
        first, last = _day_number(first_day), _day_number(last_day)
        out: list[SpendRow] = []
        async with self._errors:
            days = await client.zrangebyscore(f"{self.prefix}spend:days", first, last)
            for raw_day in days:
                day = int(_text(raw_day))
                fields = await client.hgetall(f"{self.prefix}spend:{day}")
                name = spend_day(day * 86_400.0)
                figures: dict[str, list[int]] = {}
                for raw_field, value in fields.items():
                    kind, _, who = _text(raw_field).partition(":")
                    figures.setdefault(who, [0, 0])[0 if kind == "c" else 1] = int(value)
                for who, (micros, calls) in sorted(figures.items()):
                    row_team, _, attr = who.partition("\x1f")
                    if team is None or row_team == team:
                        out.append(SpendRow(name, row_team, *Attribution.decoded(attr), micros, calls))
        return out

    async def prune_spend(self, before_day: str) -> int:
        client = self._redis()
        async with self._errors:
            days = await client.zrangebyscore(f"{self.prefix}spend:days", "-inf", f"({_day_number(before_day)}")
            for raw_day in days:
                day = _text(raw_day)
                async with client.pipeline(transaction=True) as pipe:
                    pipe.delete(f"{self.prefix}spend:{day}")
                    pipe.zrem(f"{self.prefix}spend:days", day)
                    await pipe.execute()
        return len(days)

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        ttl_ms = max(1, math.ceil(check_ttl(ttl_s, "ttl_s", allow_zero=False) * 1000))
        self._redis()
        async with self._errors:
            epoch = int(await self._lane.run(_ACQUIRE_LEASE, [
                self._key("lease", run_id), self._key("leases-of", owner), f"{self.prefix}lease-epoch",
                self._key("fence", run_id), owner, str(ttl_ms)]))
        return Lease(run_id, owner, epoch) if epoch > 0 else None

    async def release_lease(self, run_id: str, owner: str) -> None:
        self._redis()
        async with self._errors:
            await self._lane.run(_RELEASE_LEASE, [self._key("lease", run_id), self._key("leases-of", owner),
                                                  self._key("fence", run_id), owner])

    async def prune_runs(self, updated_before: float, *, events_only: bool = False) -> int:
        self._redis()
        total, offset = 0, 0
        while True:
            async with self._errors:
                pruned, kept, scanned = await self._lane.run(_PRUNE_RUNS, [
                    self.prefix, repr(updated_before), str(offset), str(PRUNE_BATCH), "1" if events_only else "0"])
            total += int(pruned)
            offset += int(kept)
            if int(scanned) < PRUNE_BATCH:
                return total

    async def prune_ledgers(self, ended_before: float) -> int:
        client = self._redis()
        pruned = 0
        async with self._errors:
            async for key in client.scan_iter(match=self._key("ledger", "*"), count=500):
                fields = [f.decode() if isinstance(f, bytes) else f for f in await client.hkeys(key)]
                old = [f for f in fields if f.startswith("spent:") and period_ended(f[len("spent:"):], ended_before)]
                if old:
                    pruned += int(await client.hdel(key, *old))
        return pruned

    async def put_response(self, response_id: str, team: str, body: bytes) -> None:
        async with self._errors:
            async with self._redis().pipeline(transaction=True) as pipe:
                pipe.hset(self._key("response", response_id), mapping={"team": team, "body": body})
                pipe.zadd(f"{self.prefix}responses", {response_id: time.time()})  # for retention
                await pipe.execute()

    async def get_response(self, response_id: str) -> tuple[str, bytes] | None:
        async with self._errors:
            got = await self._redis().hmget(self._key("response", response_id), ["team", "body"])
        team, body = got[0], got[1]
        if team is None or body is None:
            return None
        return (team.decode() if isinstance(team, bytes) else str(team),
                body if isinstance(body, bytes) else str(body).encode())

    async def delete_response(self, response_id: str) -> bool:
        async with self._errors:
            async with self._redis().pipeline(transaction=True) as pipe:
                pipe.delete(self._key("response", response_id))
                pipe.zrem(f"{self.prefix}responses", response_id)
                deleted, _ = await pipe.execute()
        return int(deleted) == 1

    async def prune_responses(self, created_before: float) -> int:
        client = self._redis()
        index = f"{self.prefix}responses"
        pruned = 0
        async with self._errors:
            while ids := await client.zrangebyscore(index, "-inf", f"({created_before!r}", start=0, num=PRUNE_BATCH):
                names = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
                async with client.pipeline(transaction=True) as pipe:
                    pipe.delete(*(self._key("response", n) for n in names))
                    pipe.zrem(index, *names)
                    await pipe.execute()
                pruned += len(names)
        return pruned

    async def enqueue_notices(self, notices: Sequence[Notice]) -> int:
        if not notices:
            return 0
        args = _notice_triples(notices)
        self._redis()
        async with self._errors:
            return int(await self._lane.run(_ENQUEUE, [self.prefix, *args]))

    async def claim_notices(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        lease_ms = max(1, math.ceil(check_ttl(lease_s, "lease_s", allow_zero=False) * 1000))
        self._redis()
        async with self._errors:
            flat: list[Any] = await self._lane.run(
                _CLAIM_NOTICES, [self.prefix, owner, str(max(limit, 0)), str(lease_ms)])
        return [Claimed(_text(flat[i]), bytes(flat[i + 1]), int(flat[i + 2] or 0)) for i in range(0, len(flat), 3)]

    async def notice_sent(self, notice_id: str) -> None:
        self._redis()
        async with self._errors:
            await self._lane.run(_NOTICE_OUTCOME, [self.prefix, notice_id, "", "sent", "0", ""])

    async def notice_failed(self, notice_id: str, owner: str, retry_in_s: float | None, error: str) -> None:
        retry = None if retry_in_s is None else check_ttl(retry_in_s, "retry_in_s", allow_zero=True)
        outcome = "failed" if retry is None else "retry"
        self._redis()
        async with self._errors:
            await self._lane.run(
                _NOTICE_OUTCOME, [self.prefix, notice_id, owner, outcome, str(round((retry or 0) * 1000)), error])

    async def outbox_depth(self) -> int:
        async with self._errors:
            return int(await self._redis().zcard(f"{self.prefix}outbox:due"))

    async def prune_outbox(self, done_before: float) -> int:
        client = self._redis()
        index = f"{self.prefix}outbox:done"
        pruned = 0
        async with self._errors:
            ids = await client.zrangebyscore(index, "-inf", f"({int(done_before * 1000)}")
            for raw in ids:
                notice_id = _text(raw)
                period = await client.hget(self._key("outbox:msg", notice_id), "period")
                if period and not period_ended(_text(period), done_before):
                    continue  # a budget notice keeps its id until its period ended
                async with client.pipeline(transaction=True) as pipe:
                    pipe.delete(self._key("outbox:msg", notice_id))
                    pipe.zrem(index, notice_id)
                    await pipe.execute()
                pruned += 1
        return pruned

    # --- keys, sessions, audit ------------------------------------------------------------

    async def _audited(self, entries: Sequence[AuditEntry], run: Callable[[list[Any]], Awaitable[list[Any]]]
                       ) -> tuple[list[Any], list[AuditRecord]]:
        """`run(audit arguments)` (a script that takes them, _AUDIT), chained after the audit
        head read first, again while another replica's step moved the head in between (this
        process's audited steps take turns, so only other replicas can)."""
        if not entries:
            return await run(["", "0"]), []
        async with self._audit_turn:
            return await self._chained(entries, run)

    async def _chained(self, entries: Sequence[AuditEntry], run: Callable[[list[Any]], Awaitable[list[Any]]]
                       ) -> tuple[list[Any], list[AuditRecord]]:
        for attempt in range(AUDIT_ATTEMPTS):
            async with self._errors:
                head = await self._lane.command("GET", f"{self.prefix}audit:head")
            seq, _, digest = _text(head).partition(" ") if head else ("0", "", GENESIS)
            records = chain(int(seq), digest, entries, time.time())
            args: list[Any] = [seq, str(len(records))]
            for r in records:
                args += [str(r.seq), r.stored()]
            args.append(records[-1].hash)
            result = await run(args)
            if int(result[0]) != -1:
                return result, records
            await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))  # another replica's step won: spread out
        raise StoreError(f"redis store {redact(self.url)}: the audit log moved under {AUDIT_ATTEMPTS} attempts in a row")

    async def put_key(self, record: KeyRecord, expected_revision: int | None,
                      audit: Sequence[AuditEntry] = ()) -> KeyRecord:
        self._redis()
        head: list[Any] = [self.prefix, record.id, record.team,
                           "" if expected_revision is None else str(expected_revision), record.stored()]

        async def run(args: list[Any]) -> list[Any]:
            async with self._errors:
                return cast(list[Any], await self._lane.run(_PUT_KEY, head + args))

        result, _ = await self._audited(audit, run)
        code = int(result[0])
        if code == 0:
            raise KeyExists(record.id)
        if code == 2:
            raise KeyNotFound(record.id)
        if code == 3:
            raise StaleKey(record.id, expected_revision or 0, int(result[1]))
        used = _text(result[2])
        return replace(record, revision=int(result[1]), last_used_at=float(used) if used else None)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        async with self._errors:
            revision, body, used = await self._redis().hmget(self._key("key", key_id), ["revision", "body",
                                                                                        "last_used"])
        if body is None:
            return None
        return KeyRecord.from_stored(body, int(_text(revision)), float(used) if used else None)

    async def list_keys(self, team: str | None = None, *, after: str = "", limit: int = 100) -> list[KeyRecord]:
        self._redis()
        async with self._errors:
            flat: list[Any] = await self._lane.run(_LIST_KEYS, [self.prefix, team or "", after, str(max(limit, 0))])
        return _key_records(flat)

    async def keys_since(self, revision: int) -> tuple[list[KeyRecord], int]:
        self._redis()
        async with self._errors:
            last = await self._lane.command("GET", f"{self.prefix}keys:revision")
            if int(last or 0) <= revision:
                return [], int(last or 0)
            flat: list[Any] = await self._lane.run(_KEYS_SINCE, [self.prefix, str(revision)])
        return _key_records(flat[1:]), int(flat[0])

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        if not used:
            return
        self._redis()
        async with self._errors:
            await self._lane.run(_TOUCH_KEYS, [self.prefix, *(f"{at!r} {key_id}" for key_id, at in used.items())])

    async def put_session(self, session: ConsoleSession, audit: Sequence[AuditEntry] = ()) -> None:
        self._redis()
        head: list[Any] = [self.prefix, session.id_hash, session.stored(), repr(session.idle_until),
                           str(int(session.expires_at * 1000))]

        async def run(args: list[Any]) -> list[Any]:
            async with self._errors:
                return cast(list[Any], await self._lane.run(_PUT_SESSION, head + args))

        await self._audited(audit, run)

    async def get_session(self, id_hash: str) -> ConsoleSession | None:
        async with self._errors:
            body, idle = await self._redis().hmget(self._key("session", id_hash), ["body", "idle_until"])
        if body is None:
            return None
        found = ConsoleSession.from_stored(id_hash, body, float(idle or 0))
        return found if found.expires_at > time.time() else None

    async def touch_session(self, id_hash: str, idle_until: float) -> None:
        key = self._key("session", id_hash)
        async with self._errors:
            current = await self._redis().hget(key, "idle_until")
            if current is not None and float(current) < idle_until:
                await self._redis().hset(key, "idle_until", repr(idle_until))

    async def delete_session(self, id_hash: str, audit: Sequence[AuditEntry] = ()) -> bool:
        self._redis()

        async def run(args: list[Any]) -> list[Any]:
            async with self._errors:
                return cast(list[Any], await self._lane.run(_DELETE_SESSION, [self.prefix, id_hash, *args]))

        result, _ = await self._audited(audit, run)
        return int(result[1]) == 1

    async def prune_sessions(self, now: float) -> int:
        client = self._redis()
        pruned = 0
        async with self._errors:  # past expires_at Redis forgets them itself; idle ones are found here
            async for key in client.scan_iter(match=self._key("session", "*"), count=500):
                idle = await client.hget(key, "idle_until")
                if idle is not None and float(idle) <= now:
                    pruned += int(await client.delete(key))
        return pruned

    async def append_audit(self, entries: Sequence[AuditEntry]) -> list[AuditRecord]:
        if not entries:
            return []
        self._redis()

        async def run(args: list[Any]) -> list[Any]:
            async with self._errors:
                return cast(list[Any], await self._lane.run(_APPEND_AUDIT, [self.prefix, *args]))

        return (await self._audited(entries, run))[1]

    async def audit_log(self, *, after_seq: int = 0, limit: int = 100, since: float | None = None,
                        action: str | None = None, team: str | None = None) -> list[AuditRecord]:
        client = self._redis()
        out: list[AuditRecord] = []
        start = f"({after_seq}"
        async with self._errors:
            while len(out) < limit:
                page = await client.zrangebyscore(f"{self.prefix}audit", start, "+inf", start=0, num=AUDIT_PAGE)
                if not page:
                    break
                for raw in page:
                    record = AuditRecord.from_stored(cast(bytes, raw))
                    if matches(record, since, action, team):
                        out.append(record)
                        if len(out) >= limit:
                            break
                start = f"({AuditRecord.from_stored(cast(bytes, page[-1])).seq}"
        return out

    async def prune_audit(self, before: float) -> int:
        self._redis()
        total = 0
        while True:
            async with self._errors:
                n = int(await self._lane.run(_PRUNE_AUDIT, [self.prefix, repr(before), str(PRUNE_BATCH)]))
            total += n
            if n < PRUNE_BATCH:
                return total

    # --- reloads across replicas -----------------------------------------------------------------

    async def reload_mark(self) -> ReloadMark:
        self._redis()
        async with self._errors:
            generation, origin = await self._lane.command("HMGET", f"{self.prefix}reload", "generation", "origin")
        return ReloadMark(int(generation or 0), _text(origin) if origin else "")

    async def announce_reload(self, origin: str) -> ReloadMark:
        self._redis()
        async with self._errors:
            generation = await self._lane.run(_ANNOUNCE_RELOAD, [self.prefix, origin])
        return ReloadMark(int(generation), origin)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            async with self._errors:
                await self._lane.close()
                await client.aclose()


def _notice_triples(notices: Sequence[Notice]) -> list[str | bytes]:
    check_notices(notices)
    return [part for n in notices for part in (n.id, n.body, n.period or "")]


def _lease_value(lease: Lease | None) -> str:
    """A lease as its key holds it (ACQUIRE_LEASE: "epoch owner"); '' for none."""
    return "" if lease is None else f"{lease.epoch} {lease.owner}"


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


@functools.lru_cache(maxsize=1024)
def _rate_args(rates: tuple[RateLimit, ...]) -> tuple[bytes, ...]:
    """ADMIT's argument per scope ("window per-request per-token max-in-flight scope", '-'
    for no such limit), spelt and encoded (the client sends bytes as they are) once per set
    of scopes (one per team and key)."""
    return tuple(f"{r.window_s!r} {_num(r.requests_s)} {_num(r.tokens_s)} {_opt(r.max_in_flight) or '-'} {r.scope}"
                 .encode() for r in rates)


def _num(value: float | None) -> str:
    return "-" if value is None else repr(value)


def _charges(tokens: Sequence[TokenCharge]) -> list[str]:
    """The scripts' token charges: one argument each, "tokens seconds-per-token scope"."""
    return [str(c.tokens) + _charge_tail(c.tokens_s, c.scope) for c in tokens]


@functools.lru_cache(maxsize=1024)
def _charge_tail(tokens_s: float, scope: str) -> str:
    """A charge's argument after its tokens, the same for every booking of a scope: the
    float's repr is the dear part, made once."""
    return f" {tokens_s!r} {scope}"


class _Scopes(NamedTuple):
    """A claim's rate scopes as ADMIT takes them: `head` its arguments 15 and 16 (how many
    scope arguments, the own team's max_in_flight when that is all its scope checks, ''
    else), `args` one per other scope (`_rate_args`), `own` the index in the claim's rates of
    the scope in argument 16 (None: none)."""

    head: tuple[str, str]
    args: tuple[bytes, ...]
    own: int | None


_NO_SCOPES: Final = _Scopes(("0", ""), (), None)


@functools.lru_cache(maxsize=1024)
def _scopes(rates: tuple[RateLimit, ...], team: str) -> _Scopes:
    """`_Scopes` of a claim of `team` (one per team and key, and per allowance's check)."""
    own = next((i for i, r in enumerate(rates) if r.scope == "team:" + team and r.requests is None
                and r.tokens is None and r.max_in_flight is not None), None)
    others = tuple(r for i, r in enumerate(rates) if i != own)
    return _Scopes((str(len(others)), "" if own is None else str(rates[own].max_in_flight)), _rate_args(others), own)


def _granted(claim: Claim, scopes: _Scopes, raw: bytes | str) -> tuple[RateState, ...]:
    """The clocks of a grant: ADMIT's one string, the server's clock then the two clocks of
    each scope argument after the claim (in flight is not read on a grant: 0); the own team
    scope of argument 16 has no clocks."""
    parts = raw.split()
    now = float(parts[0])
    rates = claim.rates
    if len(rates) == 1:  # a team's limits alone, the usual claim: no loop to set up
        if scopes.own is not None:
            return (RateState(rates[0].scope, now),)
        return (RateState(rates[0].scope, now, float(parts[1]), float(parts[2])),)
    out, at = [], 1
    for i, r in enumerate(rates):
        if i == scopes.own:
            out.append(RateState(r.scope, now))
        else:
            out.append(RateState(r.scope, now, float(parts[at]), float(parts[at + 1])))
            at += 2
    return tuple(out)


def _clocks(claim: Claim, scopes: _Scopes, raw: list[Any]) -> tuple[RateState, ...]:
    """The server's clock, then the scopes' clocks ADMIT returns (three values per scope, the
    own team scope of argument 16 first)."""
    now = float(_text(raw[0]))
    own = scopes.own

    def at(i: int) -> int:  # where the i-th scope's three values start
        return 3 * (i if own is None else 0 if i == own else i + (i < own)) + 1

    return tuple(RateState(r.scope, now, float(_text(raw[at(i)])), float(_text(raw[at(i) + 1])), int(raw[at(i) + 2]))
                 for i, r in enumerate(claim.rates))


def _key_records(flat: list[Any]) -> list[KeyRecord]:
    """(revision, body, last_used) triples of the key scripts as records."""
    out = []
    for i in range(0, len(flat), 3):
        used = _text(flat[i + 2])
        out.append(KeyRecord.from_stored(flat[i + 1], int(flat[i]), float(used) if used else None))
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _figures(raw: list[Any], holds: list[Any] = []) -> Figures:  # noqa: B006 - read only
    """{spent, reserved, turns, cost, in_flight, held} of the Lua scripts (micros as integers),
    and the holds' spent and reserved after them."""
    spent, reserved, turns, cost, in_flight, held = (_text(v) for v in raw)
    return Figures(from_micros(int(spent)), from_micros(int(reserved)), int(turns or 0), int(in_flight),
                   from_micros(int(cost)), from_micros(int(held)),
                   tuple((from_micros(int(_text(holds[i]))), from_micros(int(_text(holds[i + 1]))))
                         for i in range(0, len(holds), 2)))


def _day_number(day: str) -> int:
    """A spend row's day ("YYYY-MM-DD") as the days since the epoch its Redis hash is named by."""
    return int(datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC).timestamp() // 86_400)


def _run_fields(state: RunState) -> list[str | bytes]:
    """A new run as the scripts store it (CREATE_RUN's arguments after the prefix)."""
    written = new_run_write(state)
    return [state.run_id, state.team, state.status, repr(state.created_at), str(state.revision), written.head,
            str(state.turns), str(to_micros(state.cost_usd, "cost_usd")), state.policy, *_transcript_args(written)]


def _transcript_args(w: RunWrite) -> list[str | bytes]:
    """A save's transcript change as the scripts take it (redis_lua._TRANSCRIPT)."""
    return [str(w.messages_from), str(len(w.messages)), *w.messages, str(w.per_turn_from), str(len(w.per_turn)),
            *w.per_turn, "1" if w.truncates else "0"]


def _parsed(run_id: str, found: list[Any]) -> RunState:
    """A run as the scripts read it back (redis_lua read_run: body, messages, per_turn)."""
    body, messages, entries = found
    return parse_run(run_id, body, (messages, entries))
