"""Who a call comes from: the key it authenticated with (`Caller`), and the rules of scope.

A key is either declared in config.yaml (`ConfigKey`: read-only, `source: config`) or a
record of the store (`gateway.store.keys.KeyRecord`, issued by the admin API). Either way
the keyring hands the endpoints a view of the key's team carrying a `Caller` (its id, user,
models, budget, rate limits), so every rule downstream reads one shape.

Scope narrows, never widens: a key's `models` (globs) and `policies` apply on top of its
team's, its budget is held beside the team's, its rate limits on top of the team's.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.config.rates import RateLimits

KeySource = Literal["config", "store"]
USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:+=/\-]{0,127}")
"""A call's user: 1-128 letters, digits and `_ . @ : + = / -`, starting with a letter or digit."""
MAX_GLOBS = 64
MAX_GLOB_CHARS = 200


def config_key_id(key: str) -> str:
    """The public id of a config key: a digest of it (the store's rate scope of the key uses the same)."""
    return "cfg_" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def key_scope_of(key_id: str) -> str:
    """The rate scope and ledger name of a key, from its id (never the secret)."""
    return "key:" + key_id[4:] if key_id.startswith("cfg_") else "key:" + key_id


@dataclass(frozen=True)
class ConfigKey:
    """A key of config.yaml: `keys: ["sk-..."]`, or `{key|key_env, name, user, models,
    budget_usd, budget_period, manage_keys, rate_limits}`."""

    key: str
    name: str = ""
    user: str | None = None
    models: tuple[str, ...] | None = None
    budget_usd: float | None = None
    budget_period: str = "month"
    manage_keys: bool = False
    limits: RateLimits | None = None

    @property
    def id(self) -> str:
        return config_key_id(self.key)


@dataclass(frozen=True)
class Caller:
    """The key a call authenticated with, as the rules downstream read it.

    `scope` names its rate clocks and its budget ledger in the store (from its id, never the
    secret); `generation` counts its rotations (console sessions signed in before the last
    one end)."""

    key_id: str
    name: str
    source: KeySource
    scope: str
    limits: RateLimits | None = None
    user: str | None = None
    models: tuple[str, ...] | None = None
    budget_usd: float | None = None
    budget_period: str = "month"
    manage_keys: bool = False
    generation: int = 0


def models_allow(globs: Sequence[str] | None, model: str) -> bool:
    """Whether an allow-list of globs (None: everything) lets `model` through."""
    return globs is None or any(fnmatch.fnmatchcase(model, g) for g in globs)


def glob_within(glob: str, allowed: Sequence[str] | None) -> bool:
    """Whether everything `glob` matches is surely matched by `allowed` (None: everything).
    Conservative: a glob is within another when that one matches it as a plain name (`gpt-4o`
    and `gpt-4o-*` are within `gpt-4*`; `*` is within `*` only)."""
    return allowed is None or any(fnmatch.fnmatchcase(glob, a) for a in allowed)


def check_user(value: object) -> str | None:
    """A valid user name, or None when `value` is not one (`USER`)."""
    return value if isinstance(value, str) and USER.fullmatch(value) else None
