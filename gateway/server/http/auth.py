"""Who is calling: the Bearer key names a team, and the key itself (`Caller`).

Keys come from config.yaml (read-only, `source: config`) and from the store (issued by the
admin API, `gateway.store.keys.KeyRecord`). A call's key is looked up by its SHA-256 in this
process's keyring, with no store round trip: the keyring reads the keys written since it
last looked (`Store.keys_since`, one cheap read when nothing changed) every `SYNC_S`, so a
key revoked, rotated or changed on any replica is seen by every process within that
(docs/keys.md). A secret the keyring does not know is not refused before one such read that
started after the call arrived (`catch_up`, shared by every call waiting): a key created on
one process works on the next call wherever it lands. Expiry and a rotated-out secret's
grace are checked against the clock on every call.

An authenticated call works as a view of its team (`TeamConfig`) carrying the key
(`caller`): a store key's view narrows the team's policies to the key's, and names the
key's models, user, budget and rate limits, so every rule downstream reads one shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Final

from aiohttp import web

from gateway.config.fields import ConfigError, Field
from gateway.config.keys import Caller, ConfigKey, key_scope_of
from gateway.config.rates import parse_rate_limits
from gateway.config.settings import TeamConfig
from gateway.server.http.errors import Unauthorized
from gateway.store.base import Store
from gateway.store.errors import StoreError
from gateway.store.signals import changed, poll_period
from gateway.store.keys import KeyRecord

log = logging.getLogger(__name__)

SYNC_S: Final = 0.25
"""How often each process reads the keys written since it last looked: a revoked key is
refused everywhere within this (plus one store read)."""
CATCH_UP_S: Final = 1.0
"""How long a call with a secret the keyring does not know waits for the store's new keys
before it is refused anyway (a store that does not answer)."""
TOUCH_S: Final = 60.0
"""How often each process writes the `last_used_at` of the store keys it served."""
AS_TEAM: Final = web.RequestKey("as_team", TeamConfig)
"""Set by the console on the request it hands a `/v1` handler: the signed-in session's view
(the console has no key to put in an Authorization header)."""
AUTHENTICATED: Final = web.RequestKey("authenticated", TeamConfig)
"""The view a request authenticated as (its team, and its key as `caller`): the access log's
team and key id."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class _Entry:
    """A secret the keyring knows: the view of its team a call works as, and, for a store
    key, until when it is valid (`until`: a rotated-out secret's grace; None: no end but the
    record's own expiry)."""

    digest: bytes
    view: TeamConfig | None
    record: KeyRecord | None = None
    until: float | None = None
    problem: str = ""
    """Why a known secret is refused whatever the time (its team left the config, ...)."""


class KeyRing:
    """Keys -> views of their teams. Lookups go by sha256 digest and confirm in constant time."""

    def __init__(self, teams: Iterable[TeamConfig], store: Store | None = None) -> None:
        self._store = store
        self._teams: dict[str, TeamConfig] = {}
        self._config: dict[bytes, _Entry] = {}
        self._records: dict[str, KeyRecord] = {}
        self._stored: dict[bytes, _Entry] = {}
        self._config_views: dict[str, TeamConfig] = {}
        self.revision = 0
        """The store's key revision this keyring has read up to."""
        self._syncing = asyncio.Lock()
        self._syncs = 0
        """Syncs started so far (under `_syncing`): a catch-up waits for one started after it."""
        self.used: dict[str, float] = {}
        """Store keys served since the last `flush_used`, and when."""
        self.set_teams(teams)

    # --- what it knows ----------------------------------------------------------------------

    def set_teams(self, teams: Iterable[TeamConfig]) -> None:
        """The config's teams and their keys (again, after a reload): the store's keys are
        seen through the new teams at once."""
        self._teams = {t.name: t for t in teams}
        self._config, self._config_views = {}, {}
        for t in self._teams.values():
            for ck in t.config_keys:
                view = replace(t, caller=_config_caller(ck))
                self._config[_digest(ck.key)] = _Entry(_digest(ck.key), view)
                self._config_views[ck.id] = view
        self._stored = {}
        for record in self._records.values():
            self._index(record)

    def _put(self, record: KeyRecord) -> None:
        old = self._records.get(record.id)
        if old is not None:
            for h in (old.secret_hash, old.previous_hash):
                if h is not None:
                    self._stored.pop(bytes.fromhex(h), None)
        self._records[record.id] = record
        self._index(record)

    def _index(self, record: KeyRecord) -> None:
        view, problem = self._view(record)
        current = bytes.fromhex(record.secret_hash)
        self._stored[current] = _Entry(current, view, record, None, problem)
        if record.previous_hash is not None and record.previous_until is not None:
            previous = bytes.fromhex(record.previous_hash)
            self._stored[previous] = _Entry(previous, view, record, record.previous_until, problem)

    def _view(self, record: KeyRecord) -> tuple[TeamConfig | None, str]:
        team = self._teams.get(record.team)
        if team is None:
            return None, f"its team '{record.team}' is no longer in the gateway's config"
        policies = team.policies if record.policies is None else tuple(
            p for p in team.policies if p in record.policies)
        if not policies:
            return None, f"none of its policies ({', '.join(record.policies or ())}) is still one of team " \
                         f"'{team.name}''s"
        try:
            limits = None if record.rate_limits is None else parse_rate_limits(
                Field("key", "rate_limits", dict(record.rate_limits)))
        except ConfigError:
            return None, "its stored rate_limits cannot be read"
        caller = Caller(record.id, record.name, "store", key_scope_of(record.id), limits, record.user, record.models,
                        record.budget_usd, record.budget_period, record.manage_keys, record.generation)
        return replace(team, policies=policies, caller=caller), ""

    def team_of(self, name: str) -> TeamConfig | None:
        """A team of the config, by name."""
        return self._teams.get(name)

    def teams(self) -> list[TeamConfig]:
        return list(self._teams.values())

    def record(self, key_id: str) -> KeyRecord | None:
        """A store key's record as this process last read it."""
        return self._records.get(key_id)

    def records(self) -> list[KeyRecord]:
        return list(self._records.values())

    def config_view(self, key_id: str) -> TeamConfig | None:
        """The view of a config key, by its id."""
        return self._config_views.get(key_id)

    # --- per call -----------------------------------------------------------------------------

    def team(self, key: str) -> TeamConfig | None:
        """The view of the key's team a call works as, or None (unknown, revoked, expired,
        rotated out past its grace, or its team gone)."""
        digest = _digest(key)
        entry = self._config.get(digest) or self._stored.get(digest)
        if entry is None or not hmac.compare_digest(digest, entry.digest):
            return None
        record = entry.record
        if record is None:
            return entry.view
        now = time.time()
        if entry.view is None or not record.usable(now) or (entry.until is not None and entry.until <= now):
            return None
        self.used[record.id] = now
        return entry.view

    def knows(self, key: str) -> bool:
        """Whether the keyring has this secret, usable or not."""
        digest = _digest(key)
        return digest in self._config or digest in self._stored

    async def find(self, key: str) -> TeamConfig | None:
        """`team(key)`, after reading the store's new keys when the keyring does not know the
        secret (a key just created on another process)."""
        team = self.team(key)
        if team is None and not self.knows(key) and await self.catch_up():
            team = self.team(key)
        return team

    def refusal(self, key: str) -> str:
        """Why `team(key)` is None, in words for the 401 (never naming another key)."""
        entry = self._stored.get(_digest(key))
        if entry is None or entry.record is None:
            return "invalid API key: no team has this key"
        record, now = entry.record, time.time()
        if record.revoked_at is not None:
            return f"this key ({record.id}) was revoked"
        if record.expires_at is not None and record.expires_at <= now:
            return f"this key ({record.id}) expired"
        if entry.until is not None and entry.until <= now:
            return f"this secret of key {record.id} was rotated out; use the new one"
        return f"this key ({record.id}) cannot be used: {entry.problem}"

    async def authenticate(self, request: web.Request) -> TeamConfig:
        """The caller's view of its team, or 401 naming what is wrong with the header."""
        signed_in: TeamConfig | None = request.get(AS_TEAM)
        if signed_in is not None:
            request[AUTHENTICATED] = signed_in
            return signed_in
        header = request.headers.get("Authorization")
        if not header:
            raise Unauthorized("missing Authorization header: send 'Authorization: Bearer <your gateway key>'")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        key = key.strip()
        team = await self.find(key)
        if team is None:
            raise Unauthorized(self.refusal(key))
        request[AUTHENTICATED] = team
        return team

    def view_by_id(self, key_id: str, generation: int | None = None) -> TeamConfig | None:
        """The view a key (by id) works as now, or None when it no longer may (the console's
        sessions: with `generation`, a key rotated since is refused too)."""
        view = self._config_views.get(key_id)
        if view is not None:
            return view
        record = self._records.get(key_id)
        if record is None or not record.usable(time.time()):
            return None
        if generation is not None and record.generation != generation:
            return None
        entry = self._stored.get(bytes.fromhex(record.secret_hash))
        return None if entry is None else entry.view

    async def find_by_id(self, key_id: str, generation: int | None = None) -> TeamConfig | None:
        """`view_by_id`, after reading the store's new keys when the keyring does not know the
        key (a console session begun on another process with a key just created there)."""
        view = self.view_by_id(key_id, generation)
        if view is None and key_id not in self._records and key_id not in self._config_views \
                and await self.catch_up():
            view = self.view_by_id(key_id, generation)
        return view

    # --- keeping current ------------------------------------------------------------------------

    async def sync(self) -> int:
        """Read the keys written since the last sync; returns how many changed."""
        if self._store is None:
            return 0
        async with self._syncing:
            return await self._read(self._store)

    async def _read(self, store: Store) -> int:
        self._syncs += 1
        found, last = await store.keys_since(self.revision)
        for record in found:
            self._put(record)
        self.revision = max(self.revision, last)
        return len(found)

    async def catch_up(self) -> bool:
        """Wait for a sync that started after this call did (one store read at a time, shared
        by every call waiting: unknown secrets cannot make a process read the store more
        often than one read after the other); False when the store did not answer within
        `CATCH_UP_S`, or there is none."""
        if self._store is None:
            return False
        asked = self._syncs
        try:
            async with asyncio.timeout(CATCH_UP_S):
                async with self._syncing:
                    if self._syncs == asked:  # else one started after this call and has ended
                        await self._read(self._store)
        except (StoreError, TimeoutError):
            return False  # the keyring keeps what it knew; `keep_synced` says so in the log
        return True

    def learn(self, record: KeyRecord) -> None:
        """A key this process just wrote: known here at once, before the next sync."""
        self._put(record)

    async def keep_synced(self, interval_s: float = SYNC_S) -> None:
        """`sync` every `interval_s` (runs until cancelled); a failure is logged once a minute."""
        warned = 0.0
        period = poll_period(self._store, interval_s)
        while True:
            await changed(self._store, "keys", "", period)  # a sleep, cut short by a store that notifies
            try:
                await self.sync()
            except StoreError as exc:
                if time.monotonic() - warned > 60:
                    warned = time.monotonic()
                    log.warning("cannot read the store's keys (the keyring keeps what it knew): %s", exc)

    async def flush_used(self) -> None:
        """Write the `last_used_at` of the store keys served since the last flush."""
        if self._store is None or not self.used:
            return
        used, self.used = self.used, {}
        try:
            await self._store.touch_keys(used)
        except StoreError as exc:
            log.warning("cannot write when %d keys were last used: %s", len(used), exc)

    async def keep_touching(self, interval_s: float = TOUCH_S) -> None:
        """`flush_used` every `interval_s` (runs until cancelled)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.flush_used()


def _config_caller(ck: ConfigKey) -> Caller:
    return Caller(ck.id, ck.name, "config", key_scope_of(ck.id), ck.limits, ck.user, ck.models, ck.budget_usd,
                  ck.budget_period, ck.manage_keys, 0)
