"""`open_store`: the `store:` section of config.yaml turned into a Store, or a clear error."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from gateway.store.base import Store
from gateway.store.dsn import redact
from gateway.store.errors import StoreConfigError

_FIELDS: Final[Mapping[str, frozenset[str]]] = MappingProxyType({
    "sqlite": frozenset({"kind", "path"}),
    "redis": frozenset({"kind", "url", "prefix", "timeout_s", "allow_eviction", "wait_replicas", "wait_timeout_s"}),
    "postgres": frozenset({"kind", "dsn", "dsn_env", "schema", "pool", "timeout_s"}),
    "memory": frozenset({"kind"}),
})
DEFAULT_DSN_ENV: Final = "GATEWAY_PG_DSN"
_PG_SCHEMES: Final = ("postgresql://", "postgres://")
_REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")
MAX_WAIT_REPLICAS: Final = 16
DEFAULT_REDIS_TIMEOUT_S: Final = 2.0
"""The deadline of one Redis command (connect, send, reply): past it the call fails with
StoreError, so a frozen server costs a caller this long, not forever."""


def _text(config: Mapping[str, Any], name: str, example: str) -> str:
    value = config.get(name)
    if value is None:
        raise StoreConfigError(f"store.{name}: missing (e.g. {name}: {example})")
    if not isinstance(value, str) or not value.strip():
        raise StoreConfigError(f"store.{name}: expected a non-empty string, got {value!r}")
    return value


def _timeout(config: Mapping[str, Any]) -> float:
    timeout = config.get("timeout_s", DEFAULT_REDIS_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise StoreConfigError(f"store.timeout_s: expected a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _postgres(config: Mapping[str, Any], environ: Mapping[str, str]) -> Store:
    """`{kind: postgres, dsn | dsn_env, schema, pool: {min, max}, timeout_s}`."""
    if "dsn" in config and "dsn_env" in config:
        raise StoreConfigError("store: give dsn or dsn_env, not both")
    if "dsn" in config:
        dsn = _text(config, "dsn", "postgresql://gateway@db.internal:5432/gateway")
    else:
        name = config.get("dsn_env", DEFAULT_DSN_ENV)
        if not isinstance(name, str) or not name.strip():
            raise StoreConfigError(f"store.dsn_env: expected the name of an environment variable, got {name!r}")
        dsn = environ.get(name, "")
        if not dsn:
            raise StoreConfigError(f"store.dsn_env: the environment variable {name} is not set (it holds the "
                                   "PostgreSQL DSN, e.g. postgresql://gateway:secret@db:5432/gateway)")
    if not dsn.startswith(_PG_SCHEMES):
        raise StoreConfigError(f"store.dsn: expected a {' or '.join(_PG_SCHEMES)} DSN, got {redact(dsn)!r}")
    schema = config.get("schema", "gateway")
    if not isinstance(schema, str) or not schema.replace("_", "a").isalnum() or not schema[:1].isalpha() \
            or len(schema) > 48 or schema.lower() != schema:
        raise StoreConfigError(f"store.schema: expected a lower-case name of letters, digits and _ (at most 48), "
                               f"got {schema!r}")
    pool = config.get("pool", {})
    if not isinstance(pool, Mapping):
        raise StoreConfigError(f"store.pool: expected a mapping like {{min: 1, max: 10}}, got {pool!r}")
    unknown = sorted(str(k) for k in pool if k not in ("min", "max"))
    if unknown:
        raise StoreConfigError(f"store.pool: unknown field(s) {', '.join(unknown)} (allowed: max, min)")
    sizes = []
    for name, default in (("min", 1), ("max", 10)):
        value = pool.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
            raise StoreConfigError(f"store.pool.{name}: expected a whole number from 0 to 1000, got {value!r}")
        sizes.append(value)
    if sizes[1] < 1 or sizes[0] > sizes[1]:
        raise StoreConfigError(f"store.pool: expected 0 <= min <= max and max >= 1, got min {sizes[0]}, max {sizes[1]}")
    try:
        from gateway.store.postgres import PostgresStore
    except ImportError as exc:
        raise StoreConfigError("store.kind: postgres needs the asyncpg package, in the extra 'postgres': "
                               "pip install 'gateway[postgres]'") from exc
    return PostgresStore(dsn, schema, pool_min=sizes[0], pool_max=sizes[1], timeout_s=_timeout(config))


def open_store(config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Store:
    """Open the store described by `{kind: sqlite, path}`, `{kind: redis, url[, prefix, timeout_s,
    allow_eviction, wait_replicas, wait_timeout_s]}`,
    `{kind: postgres, dsn | dsn_env[, schema, pool, timeout_s]}` or `{kind: memory}`.

    Errors (StoreConfigError) name the field and what is wrong. A Redis server is only
    contacted on first use; an unreachable one then raises StoreError naming it.
    """
    if not isinstance(config, Mapping):
        raise StoreConfigError(f"store: expected a mapping like {{kind: sqlite, path: ./gateway.db}}, got {config!r}")
    kind = config.get("kind")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise StoreConfigError(f"store.kind: expected one of {', '.join(sorted(_FIELDS))}, got {kind!r}")
    unknown = sorted(str(k) for k in config if k not in _FIELDS[kind])
    if unknown:
        raise StoreConfigError(
            f"store: unknown field(s) {', '.join(unknown)} for kind {kind} "
            f"(allowed: {', '.join(sorted(_FIELDS[kind]))})"
        )
    if kind == "sqlite":
        from gateway.store.sqlite import SqliteStore

        return SqliteStore(_text(config, "path", "./gateway.db"))
    if kind == "postgres":
        return _postgres(config, os.environ if environ is None else environ)
    if kind == "redis":
        url = _text(config, "url", "redis://127.0.0.1:6379/0")
        if not url.startswith(_REDIS_SCHEMES):
            raise StoreConfigError(f"store.url: expected a {', '.join(_REDIS_SCHEMES)} URL, got {url!r}")
        prefix = config.get("prefix", "gw:")
        if not isinstance(prefix, str):
            raise StoreConfigError(f"store.prefix: expected a string, got {prefix!r}")
        if not isinstance(config.get("allow_eviction", False), bool):
            raise StoreConfigError(f"store.allow_eviction: expected true or false, got {config['allow_eviction']!r}")
        timeout = _timeout(config)
        replicas = config.get("wait_replicas", 0)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_WAIT_REPLICAS:
            raise StoreConfigError(f"store.wait_replicas: expected a whole number from 0 to {MAX_WAIT_REPLICAS}, "
                                   f"got {replicas!r}")
        from gateway.store.redis import DEFAULT_WAIT_TIMEOUT_S, RedisStore

        wait = config.get("wait_timeout_s", min(DEFAULT_WAIT_TIMEOUT_S, timeout / 2))
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < timeout:
            raise StoreConfigError(f"store.wait_timeout_s: expected a number of seconds > 0 and below store.timeout_s "
                                   f"({timeout:g}), got {wait!r}")
        try:
            return RedisStore(url, prefix, timeout_s=float(timeout), wait_replicas=replicas,
                              wait_timeout_s=float(wait))
        except ValueError as exc:
            raise StoreConfigError(f"store.url: {exc}") from exc
    from gateway.store.memory import MemoryStore

    return MemoryStore()
