"""`gateway db`: the PostgreSQL store's schema and moving a store into it.

    gateway db migrate [--config FILE] [--dry-run]
    gateway db copy --from sqlite:./gateway.db|redis://HOST:6379/0 [--prefix gw:] --to postgres [--config FILE]

`migrate` applies the migrations the config's PostgreSQL schema lacks (as `gateway serve`
does at start, under the same advisory lock); `--dry-run` prints their SQL and changes
nothing (every migration when the database cannot be reached). `copy` moves a SQLite file's
or a Redis prefix's runs, traces, ledgers, spend, responses, outbox, keys, sessions and
audit log into an empty PostgreSQL schema and checks counts and sums (gateway.store.copy).
`--to postgres` is the config's store (which must be `kind: postgres`), or a
`postgresql://` DSN with `--schema`. Exit codes: 0 done, 1 failed, 2 usage or config.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

CONFIG_HELP = "config file (default %(default)s)"


def add_parser(sub: Any) -> None:
    db = sub.add_parser("db", help="the PostgreSQL store: migrate its schema, copy a store into it")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    migrate = db_sub.add_parser("migrate", help="apply the schema's migrations (or print them with --dry-run)")
    migrate.add_argument("--config", default="config.yaml", help=CONFIG_HELP)
    migrate.add_argument("--dry-run", action="store_true", help="print the SQL that would run, change nothing")
    copy = db_sub.add_parser("copy", help="copy a SQLite or Redis store into an empty PostgreSQL schema")
    copy.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                      help="sqlite:PATH, or a redis:// URL (with --prefix)")
    copy.add_argument("--prefix", default="gw:", help="the Redis store's prefix (default %(default)s)")
    copy.add_argument("--to", dest="target", required=True, metavar="TARGET",
                      help="postgres (the config's store) or a postgresql:// DSN (with --schema)")
    copy.add_argument("--schema", default="gateway", help="with a DSN: the schema (default %(default)s)")
    copy.add_argument("--config", default="config.yaml", help=CONFIG_HELP)


def _fail(message: str, code: int) -> int:
    print(f"gateway: {message}", file=sys.stderr)
    return code


def _configured(path: str) -> tuple[str, str, float] | str:
    """(dsn, schema, timeout) of the config's PostgreSQL store, or the error in words."""
    from gateway.config.settings import ConfigError, load_config
    from gateway.store import StoreConfigError, open_store

    try:
        config = load_config(path)
    except ConfigError as exc:
        return f"config error: {exc}"
    if config.store.kind != "postgres":
        return f"{path}: store.kind is {config.store.kind}, not postgres"
    try:
        store = open_store(config.store.options)
    except StoreConfigError as exc:
        return f"config error: {path}: {exc}"
    return str(getattr(store, "dsn")), str(getattr(store, "schema")), float(getattr(store, "timeout_s"))


def db_command(args: argparse.Namespace) -> int:
    if args.db_command == "migrate":
        return _migrate(args)
    return _copy(args)


def _migrate(args: argparse.Namespace) -> int:
    target = _configured(args.config)
    if isinstance(target, str):
        return _fail(target, 2)
    dsn, schema, timeout = target
    import asyncpg

    from gateway.store.postgres import migrate, pending
    from gateway.store.postgres_schema import MIGRATIONS, script
    from gateway.store.errors import StoreError

    if args.dry_run:
        async def todo() -> Any:
            conn = await asyncpg.connect(dsn, timeout=max(timeout, 5.0))
            try:
                return await pending(conn, schema)
            finally:
                await conn.close()

        try:
            left = asyncio.run(todo())
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            print(f"-- the database cannot be reached ({exc}): every migration follows", file=sys.stderr)
            left = MIGRATIONS
        except StoreError as exc:
            return _fail(str(exc), 1)
        if not left:
            print(f"-- schema {schema} is up to date (migration {len(MIGRATIONS)}): nothing to run")
            return 0
        sys.stdout.write(script(tuple(left), schema))
        return 0
    try:
        applied = asyncio.run(migrate(dsn, schema, max(timeout, 5.0)))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError, StoreError) as exc:
        return _fail(f"migrate failed: {exc}", 1)
    print(f"schema {schema}: " + (f"applied migrations {', '.join(map(str, applied))}" if applied
                                  else f"up to date (migration {len(MIGRATIONS)})"))
    return 0


def _copy(args: argparse.Namespace) -> int:
    from gateway.store.copy import copy, parse_source, report
    from gateway.store.errors import StoreError

    if args.target == "postgres":
        target = _configured(args.config)
        if isinstance(target, str):
            dsn_env = os.environ.get("GATEWAY_PG_DSN")
            if not dsn_env:
                return _fail(f"--to postgres: {target} (and GATEWAY_PG_DSN is not set)", 2)
            target = (dsn_env, args.schema, 60.0)
    elif args.target.startswith(("postgresql://", "postgres://")):
        target = (args.target, args.schema, 60.0)
    else:
        return _fail(f"--to: expected postgres or a postgresql:// DSN, got {args.target!r}", 2)
    dsn, schema, _ = target
    try:
        source = parse_source(args.source, args.prefix)
    except ValueError as exc:
        return _fail(str(exc), 2)
    except StoreError as exc:
        return _fail(str(exc), 1)

    async def run() -> Any:
        try:
            return await copy(source, dsn, schema)
        finally:
            await source.close()

    try:
        read, written = asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - any failure: nothing was committed, say why in one line
        return _fail(f"copy failed (nothing was written): {exc}", 1)
    print(f"copied {source.describe()} into schema {schema}; checked:")
    print(f"{'':>16}  {'source':>14}  {'postgres':>14}")
    for line in report(read, written):
        print(line)
    return 0
