"""Keys and console sessions as the store keeps them: records, never secrets.

A key's secret is `gw-` + 32 random bytes in base62 (`new_secret`), shown once, at creation
or rotation. The store keeps only its SHA-256 (`secret_hash`) and a short visible prefix
(`KeyRecord.prefix`, for lists). SHA-256 without a salt or a slow KDF is enough here: the
secret is 256 uniformly random bits, so no dictionary or brute force reaches it (salts and
slow hashes protect guessable passwords), and an unsalted digest can be looked up directly
on every call. Nothing a store holds can authenticate: a key's hash, a console session's
hash (`ConsoleSession.id_hash`).

A `KeyRecord` is written whole by `Store.put_key` under optimistic concurrency (its
`revision`, which the store assigns from one counter shared by every key: a process that
has seen revision N reads only the keys written since, `Store.keys_since`). `last_used_at`
is kept beside the record (`Store.touch_keys`), coarse, without a new revision.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from gateway.store.errors import KeyExists, KeyNotFound, StaleKey

SECRET_PREFIX = "gw-"
SECRET_BYTES = 32
VISIBLE_CHARS = 6
"""Characters of a secret after `gw-` that lists show (`KeyRecord.prefix`): 36 bits of 256."""
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
KeySource = Literal["store", "config"]
KEY_PERIODS = ("day", "week", "month", "total")


def base62(data: bytes, width: int = 0) -> str:
    """`data` as a base62 number, left-padded with zeros to `width`."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 62)
        out.append(BASE62[r])
    return "".join(reversed(out)).rjust(width, "0")


def new_secret() -> str:
    """A new key secret: `gw-` + 32 random bytes in base62 (43 characters)."""
    return SECRET_PREFIX + base62(os.urandom(SECRET_BYTES), 43)


def secret_hash(secret: str) -> str:
    """What the store keeps of a secret (hex SHA-256)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def visible_prefix(secret: str) -> str:
    return secret[:len(SECRET_PREFIX) + VISIBLE_CHARS]


def new_key_id(now: float | None = None) -> str:
    """`key_` + the creation time (ms, base62, sortable) + 64 random bits: ids list in creation order."""
    ms = int((time.time() if now is None else now) * 1000)
    return "key_" + base62(ms.to_bytes(8, "big"), 8) + base62(os.urandom(8), 11)


@dataclass(frozen=True)
class KeyRecord:
    """One key: who it belongs to, what it may do, and the hash of its secret.

    `models` (globs) and `policies` narrow the team's (None: the team's); `budget_usd` per
    `budget_period` is the key's own budget, held in the admission step with the others;
    `rate_limits` is the config block form (`requests_per_minute`, ...). `previous_hash` is
    the secret a rotation replaced, valid until `previous_until` (epoch s). `generation`
    counts rotations (a console session signed in before the last one has ended).
    """

    id: str
    team: str
    name: str
    prefix: str
    secret_hash: str
    created_at: float
    created_by: str = ""
    user: str | None = None
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None
    models: tuple[str, ...] | None = None
    policies: tuple[str, ...] | None = None
    budget_usd: float | None = None
    budget_period: str = "month"
    rate_limits: Mapping[str, int] | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    manage_keys: bool = False
    previous_hash: str | None = None
    previous_until: float | None = None
    generation: int = 1
    revision: int = 0
    source: KeySource = "store"

    def stored(self) -> bytes:
        """The body the store keeps (everything but `revision` and `last_used_at`, kept beside it)."""
        return orjson.dumps({
            "v": 1, "id": self.id, "team": self.team, "name": self.name, "prefix": self.prefix,
            "secret_hash": self.secret_hash, "created_at": self.created_at, "created_by": self.created_by,
            "user": self.user, "expires_at": self.expires_at, "revoked_at": self.revoked_at,
            "models": None if self.models is None else list(self.models),
            "policies": None if self.policies is None else list(self.policies),
            "budget_usd": self.budget_usd, "budget_period": self.budget_period,
            "rate_limits": None if self.rate_limits is None else dict(self.rate_limits),
            "metadata": dict(self.metadata), "manage_keys": self.manage_keys,
            "previous_hash": self.previous_hash, "previous_until": self.previous_until,
            "generation": self.generation, "source": self.source,
        })

    @classmethod
    def from_stored(cls, body: bytes | str, revision: int, last_used_at: float | None = None) -> KeyRecord:
        d: dict[str, Any] = orjson.loads(body)
        return cls(
            id=str(d["id"]), team=str(d["team"]), name=str(d.get("name") or ""), prefix=str(d.get("prefix") or ""),
            secret_hash=str(d["secret_hash"]), created_at=float(d.get("created_at") or 0.0),
            created_by=str(d.get("created_by") or ""), user=d.get("user"), expires_at=d.get("expires_at"),
            revoked_at=d.get("revoked_at"), last_used_at=last_used_at,
            models=None if d.get("models") is None else tuple(d["models"]),
            policies=None if d.get("policies") is None else tuple(d["policies"]),
            budget_usd=d.get("budget_usd"), budget_period=str(d.get("budget_period") or "month"),
            rate_limits=d.get("rate_limits"), metadata=dict(d.get("metadata") or {}),
            manage_keys=bool(d.get("manage_keys")), previous_hash=d.get("previous_hash"),
            previous_until=d.get("previous_until"), generation=int(d.get("generation") or 1), revision=revision,
            source="config" if d.get("source") == "config" else "store",
        )

    def public(self) -> dict[str, Any]:
        """The record as the admin API shows it: no hash of any secret."""
        return {
            "object": "key", "id": self.id, "team": self.team, "name": self.name, "prefix": self.prefix,
            "source": self.source, "user": self.user, "created_at": self.created_at, "created_by": self.created_by,
            "expires_at": self.expires_at, "revoked_at": self.revoked_at, "last_used_at": self.last_used_at,
            "models": None if self.models is None else list(self.models),
            "policies": None if self.policies is None else list(self.policies),
            "budget_usd": self.budget_usd, "budget_period": self.budget_period,
            "rate_limits": None if self.rate_limits is None else dict(self.rate_limits),
            "metadata": dict(self.metadata), "manage_keys": self.manage_keys,
            "previous_valid_until": self.previous_until if self.previous_hash else None,
            "revision": self.revision,
        }

    def usable(self, now: float) -> bool:
        """Not revoked, not expired (the secret itself is checked by the caller)."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    def with_changes(self, **changes: Any) -> KeyRecord:
        return replace(self, **changes)


@dataclass(frozen=True)
class ConsoleSession:
    """A signed-in console session. The cookie holds a random id; the store only its hash.

    `key_id` and `generation` name the key it signed in with: a revoked, expired or rotated
    key (a higher generation), or one no longer in the config, ends the session. It ends
    too `idle_s` after its last use (`idle_until`, pushed on use) and at `expires_at`."""

    id_hash: str
    team: str
    key_id: str
    generation: int
    created_at: float
    idle_until: float
    expires_at: float

    def stored(self) -> bytes:
        return orjson.dumps({"team": self.team, "key_id": self.key_id, "generation": self.generation,
                             "created_at": self.created_at, "expires_at": self.expires_at})

    @classmethod
    def from_stored(cls, id_hash: str, body: bytes | str, idle_until: float) -> ConsoleSession:
        d = orjson.loads(body)
        return cls(id_hash, str(d["team"]), str(d["key_id"]), int(d["generation"]), float(d["created_at"]),
                   float(idle_until), float(d["expires_at"]))

    def live(self, now: float) -> bool:
        return now < self.idle_until and now < self.expires_at


def check_key_revision(key_id: str, expected: int | None, stored: int | None) -> None:
    """A key write's precondition (`Store.put_key`): a new key (`expected` None) must not be
    stored yet (KeyExists); an update must find the key (KeyNotFound) at `expected` (StaleKey)."""
    if expected is None:
        if stored is not None:
            raise KeyExists(key_id)
    elif stored is None:
        raise KeyNotFound(key_id)
    elif stored != expected:
        raise StaleKey(key_id, expected, stored)


def session_hash(session_id: str) -> str:
    """What the store keeps of a console session's id (hex SHA-256)."""
    return secret_hash(session_id)
