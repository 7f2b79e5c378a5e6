"""Soak: minutes of mixed traffic on each store, watching latency, memory, fds and storage.

For each store (SQLite, Redis, PostgreSQL) one run starts real processes on loopback: the
scripted upstream (`gateway scripted`), a redis-server for the Redis store (no
persistence: its memory is its storage), a PostgreSQL cluster of its own for PostgreSQL
(durable: fsync and synchronous_commit on; its storage the schema's tables and indexes),
and the gateway (`gateway serve`) with every retention of the config (runs, events,
ledgers, outbox, spend rows, audit) at a short window (`--window-s`, default 60 s, pruned
every `--window-s / 6`), so storage should stop growing once the window has passed; except
spend rows, which are of a UTC day: the current day's are kept whatever `spend_days` says. `--concurrency` workers send,
picked at random by weight:

- a client's agent loop through pass-through (3 non-streamed calls: list, read, answer),
- one streamed pass-through call that completes a run,
- a server-side run (`X-Policy: files`, the gateway runs list/read itself),
- a run that asks for approval, approved by the ops team, then resumed (3 calls).

Printed per minute: requests, errors (any non-2xx or transport error), p50/p99 latency,
the gateway's RSS and open fds, storage (SQLite file + WAL, or Redis `used_memory`, plus
the trace files) and its growth per 1,000 requests in that minute.

On PostgreSQL, at the end: every table's size (indexes and TOAST included) at the end of
each minute, its indexes, live and dead tuples and autovacuum runs, the reservations
expired at each minute's end (a call admitted and never settled or released), each table's
growth after the window per 1,000 requests, and the server's autovacuum settings.

At the end, the books: the team's ledger against the sum of every run's cost as its last
answer gave it (`X-Run-Cost-Usd`, kept by the load generator, since retention deletes the
runs themselves), to the micro-dollar; on PostgreSQL also the `spend` view, day by day against
what the runs' costs grew by that day (a day pruned by `spend_days` is named), and
each run still stored against its own rows of the view.

Run: `.venv/bin/python benchmarks/soak.py [--minutes 10] [--stores sqlite,redis,postgres]`.
Everything shares the machine; the trend over the minutes is the point, not the level.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.procs import Proc, free_port, start_gateway  # noqa: E402

KEY, OPS = "sk-soak", "sk-soak-ops"
TASK = [{"role": "user", "content": "Which file mentions a timeout?"}]
MIX = (("passthrough_loop", 4), ("streamed", 2), ("server_side", 3), ("approval", 1))


@dataclass
class Minute:
    """What the workers saw during one minute (latencies in seconds)."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""


@dataclass
class Row:
    minute: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    rss_mb: float
    fds: int
    storage_mb: float
    growth_kb_per_1k: float
    parts_mb: str
    tables: dict[str, PgTable] = field(default_factory=dict)
    """PostgreSQL: every table of the schema at the minute's end."""
    expired: int = 0
    """PostgreSQL: reservations expired at the minute's end."""


class Load:
    """The workers' shared state: the current minute's figures, the stop flag."""

    def __init__(self, url: str, minutes: float) -> None:
        self.url = url
        self.started = time.monotonic()
        self.deadline = self.started + minutes * 60
        self.minutes: dict[int, Minute] = {}
        self.costs: dict[str, float] = {}
        """Each run's cost, as its latest answer said (X-Run-Cost-Usd)."""
        self.day_micros: dict[str, int] = {}
        """What the runs' costs grew by on each UTC day (micro-dollars), by when the answer
        told it: the spend rows of that day should hold as much."""

    def cost(self, run_id: str, usd: float) -> None:
        """A run's cost as an answer told it; its growth counts on today's spend."""
        before = self.costs.get(run_id, 0.0)
        if usd > before:
            self.costs[run_id] = usd
            day = time.strftime("%Y-%m-%d", time.gmtime())
            self.day_micros[day] = self.day_micros.get(day, 0) + round(usd * 1e6) - round(before * 1e6)

    def now_minute(self) -> int:
        return int((time.monotonic() - self.started) // 60)

    def record(self, seconds: float, error: str | None) -> None:
        m = self.minutes.setdefault(self.now_minute(), Minute())
        m.latencies.append(seconds)
        if error is not None:
            m.errors += 1
            m.first_error = m.first_error or error

    async def call(self, session: aiohttp.ClientSession, path: str, body: Any, key: str = KEY,
                   headers: dict[str, str] | None = None, stream: bool = False) -> tuple[dict[str, str], Any]:
        started = time.perf_counter()
        h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
        error: str | None = None
        parsed: Any = None
        resp_headers: dict[str, str] = {}
        try:
            async with session.post(self.url + path, data=orjson.dumps(body), headers=h) as resp:
                raw = await resp.read()
                resp_headers = dict(resp.headers)
                run_id, cost = resp_headers.get("X-Run-Id"), resp_headers.get("X-Run-Cost-Usd")
                if run_id and cost:
                    self.cost(run_id, float(cost))
                if resp.status >= 300:
                    error = f"{resp.status} {raw[:200]!r}"
                elif not stream:
                    parsed = orjson.loads(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.record(time.perf_counter() - started, error)
        if error is not None:
            raise RuntimeError(error)
        return resp_headers, parsed


def tool_result(call: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["id"], "content": "errors.log (120 B), access.log (80 B)"}


async def passthrough_loop(load: Load, session: aiohttp.ClientSession, n: int) -> None:
    messages: list[dict[str, Any]] = list(TASK)
    headers = {"X-Policy": "passthrough", "X-Run-Id": f"soak-{os.getpid()}-{n}"}
    for _ in range(3):
        _, body = await load.call(session, "/v1/chat/completions", {"model": "scripted-plan", "messages": messages},
                                  headers=headers)
        message = body["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return
        messages += [tool_result(c) for c in message["tool_calls"]]


FINAL_TURN = [
    *TASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "errors.log, access.log, notes.txt"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "errors.log"}'}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "worker 7 timed out after 30000 ms"},
]


async def streamed(load: Load, session: aiohttp.ClientSession, n: int) -> None:
    run_id = f"soak-s-{os.getpid()}-{n}"
    await load.call(session, "/v1/chat/completions", {"model": "scripted-plan", "messages": FINAL_TURN,
                                                      "stream": True},
                    headers={"X-Policy": "passthrough", "X-Run-Id": run_id}, stream=True)
    # A stream's headers go out before its turn is booked: its cost is read from the run after.
    async with session.get(f"{load.url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        if resp.status == 200:
            load.cost(run_id, float(orjson.loads(await resp.read())["cost_usd"]))


async def server_side(load: Load, session: aiohttp.ClientSession, n: int) -> None:
    await load.call(session, "/v1/chat/completions", {"model": "scripted-plan", "messages": TASK},
                    headers={"X-Policy": "files"})


async def approval(load: Load, session: aiohttp.ClientSession, n: int) -> None:
    headers, body = await load.call(session, "/v1/chat/completions",
                                    {"model": "scripted-destructive", "messages": TASK}, headers={"X-Policy": "files"})
    run_id = headers["X-Run-Id"]
    async with session.get(f"{load.url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        run = orjson.loads(await resp.read())
    call_id = run["interruption"]["call_id"]
    await load.call(session, f"/v1/runs/{run_id}/approvals", {"call_id": call_id, "decision": "approve"}, key=OPS)
    await load.call(session, f"/v1/runs/{run_id}/resume", {})


KINDS = {"passthrough_loop": passthrough_loop, "streamed": streamed, "server_side": server_side,
         "approval": approval}


async def worker(load: Load, session: aiohttp.ClientSession, wid: int) -> None:
    rng = random.Random(wid)
    names = [name for name, weight in MIX for _ in range(weight)]
    n = 0
    while time.monotonic() < load.deadline:
        n += 1
        try:
            await KINDS[rng.choice(names)](load, session, wid * 1_000_000 + n)
        except RuntimeError:
            pass  # counted by `call`


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def storage_parts(folder: Path, redis_port: int | None, pg: str | None = None) -> dict[str, int]:
    """Bytes of each part of the storage: the trace files, and the SQLite file and its WAL
    (the WAL is reused after checkpoints: it grows to a high-water mark, then stays),
    Redis's used_memory, or the PostgreSQL schema's tables (with their indexes and TOAST)."""
    parts = {"trace": sum(p.stat().st_size for p in folder.glob("trace.jsonl*"))}
    if pg is not None:
        parts.update(pg_sizes(pg))
    elif redis_port is None:
        parts["db"] = sum(p.stat().st_size for p in folder.glob("gateway.db"))
        parts["wal"] = sum(p.stat().st_size for p in folder.glob("gateway.db-wal"))
    else:
        client = redis.Redis(host="127.0.0.1", port=redis_port)
        try:
            parts["redis"] = int(client.info("memory")["used_memory"])
        finally:
            client.close()
    return parts


PG_TABLES = ("runs", "events", "transcripts", "spend_rows", "reservations", "outbox")
"""The tables shown each minute (every table is in the end-of-soak table)."""


@dataclass
class PgTable:
    """One table of the schema at one moment: bytes with its indexes and TOAST, of which
    indexes, live and dead tuples (the statistics collector's estimate) and autovacuum runs."""

    total: int
    indexes: int
    live: int
    dead: int
    autovacuums: int


def pg_tables(dsn: str) -> tuple[dict[str, PgTable], int]:
    """Every table of the gateway schema, and how many reservations have expired (calls
    admitted and never settled or released)."""
    import asyncpg

    async def read() -> tuple[dict[str, PgTable], int]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT c.relname, pg_total_relation_size(c.oid), pg_indexes_size(c.oid),"
                " COALESCE(s.n_live_tup, 0), COALESCE(s.n_dead_tup, 0), COALESCE(s.autovacuum_count, 0)"
                " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
                " WHERE n.nspname = 'gateway' AND c.relkind = 'r'")
            expired = await conn.fetchval("SELECT count(*) FROM gateway.reservations"
                                          " WHERE expires_at <= extract(epoch FROM clock_timestamp())")
        finally:
            await conn.close()
        return {str(r[0]): PgTable(*(int(x) for x in r[1:])) for r in rows}, int(expired)

    return _run_sync(read())  # type: ignore[no-any-return]


def pg_settings(dsn: str) -> str:
    """The server's version and the autovacuum settings that decide when dead rows' space is reused."""
    import asyncpg

    async def read() -> str:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch("SELECT name, setting, unit FROM pg_settings WHERE name IN ('server_version',"
                                    " 'autovacuum', 'autovacuum_naptime', 'autovacuum_vacuum_threshold',"
                                    " 'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_insert_threshold',"
                                    " 'autovacuum_vacuum_cost_limit', 'autovacuum_vacuum_cost_delay') ORDER BY name")
        finally:
            await conn.close()
        return ", ".join(f"{r[0]} {r[1]}{r[2] or ''}" for r in rows)

    return _run_sync(read())  # type: ignore[no-any-return]


def pg_sizes(dsn: str) -> dict[str, int]:
    """The gateway schema's biggest tables, bytes each (the rest summed as `other`)."""
    tables, _ = pg_tables(dsn)
    big = {k: v.total for k, v in tables.items() if k in PG_TABLES}
    big["other"] = sum(v.total for k, v in tables.items() if k not in big)
    return big


def _run_sync(coro: Any) -> Any:
    """A coroutine run to its end on a loop of its own (the soak's loop is busy with the load)."""
    import threading

    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(coro)))
    thread.start()
    thread.join()
    return out[0]


async def books(kind: str, store_config: dict[str, Any], folder: Path, load: Load) -> str:
    """The ledger against the sum of the runs' costs (and, on PostgreSQL, the spend view)."""
    from gateway.store import open_store

    config = dict(store_config)
    if kind == "sqlite":
        config["path"] = str(folder / "gateway.db")
    store = open_store(config)
    try:
        spent, reserved = await store.team_spend("soak", "total")
        runs = round(sum(load.costs.values()) * 1e6)
        line = (f"books: ledger {round(spent * 1e6)} micro-USD (reserved {round(reserved * 1e6)}), sum of the "
                f"{len(load.costs)} runs' costs {runs}: {'equal' if round(spent * 1e6) == runs else 'DIFFERENT'}")
        if kind == "postgres":
            import asyncpg

            conn = await asyncpg.connect(config["dsn"])
            try:
                days = {str(r[0]): int(r[1]) for r in await conn.fetch(
                    "SELECT to_char(day, 'YYYY-MM-DD'), sum(cost_micros) FROM gateway.spend WHERE team = 'soak'"
                    " GROUP BY 1")}
                wrong = await conn.fetchval(
                    "SELECT count(*) FROM gateway.runs r JOIN (SELECT run, sum(cost_micros) AS c FROM gateway.spend"
                    " GROUP BY run) s ON s.run = r.id WHERE r.cost_micros <> s.c")
            finally:
                await conn.close()
            # Spend rows of a day before today are pruned once that day is `spend_days` (the
            # window) old: the view holds the days kept, each as much as the runs' costs grew by
            # that day (an answer given just after midnight for a call booked just before may
            # count on the next day).
            kept = [f"{day} {days[day]} against {load.day_micros.get(day, 0)}: "
                    f"{'equal' if days[day] == load.day_micros.get(day, 0) else 'DIFFERENT'}" for day in sorted(days)]
            pruned = [f"{day} ({micros})" for day, micros in sorted(load.day_micros.items()) if day not in days]
            line += (f"; spend view by day: {', '.join(kept) or 'none'}"
                     + (f"; pruned by spend_days: {', '.join(pruned)}" if pruned else "")
                     + f"; runs stored whose cost differs from their spend rows: {wrong}")
        return line
    finally:
        await store.close()


def write_config(folder: Path, port: int, upstream: str, store: dict[str, Any], window_s: float) -> Path:
    policies = folder / "policies"
    policies.mkdir(parents=True)
    for name in ("passthrough", "files"):
        shutil.copy(ROOT / "policies" / f"{name}.yaml", policies / f"{name}.yaml")
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store,
        "policies_dir": "./policies",
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "up", "base_url": upstream}],
        "models": [{"match": "*", "upstream": "up", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "soak", "keys": [KEY], "budget_usd": 1_000_000.0, "budget_period": "total",
             "policies": ["passthrough", "files"]},
            {"name": "ops", "keys": [OPS], "budget_usd": None, "policies": ["passthrough"]},
        ],
        # Every retention the config has, at the window (spend rows are of a UTC day: the
        # current day's stay whatever spend_days says).
        "retention": {name: window_s / 86_400 for name in ("runs_days", "events_days", "ledger_days", "outbox_days",
                                                            "spend_days", "audit_days")}
                     | {"trace_file_max_mb": 5, "trace_file_keep": 2, "interval_s": window_s / 6},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    popen = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--dir", str(folder)], stdout=(folder / "redis.log").open("wb"),
                             stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # readiness poll
    client.close()
    return popen, port


async def soak(kind: str, args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix=f"gw-soak-{kind}-") as tmp:
        folder = Path(tmp)
        up_port, gw_port = free_port(), free_port()
        upstream = start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port, folder / "upstream.log")
        procs: list[Proc] = [upstream]
        redis_proc: subprocess.Popen[bytes] | None = None
        redis_port: int | None = None
        cluster = None
        dsn: str | None = None
        try:
            if kind == "redis":
                redis_proc, redis_port = start_redis(folder)
                store: dict[str, Any] = {"kind": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"}
            elif kind == "postgres":
                from tests.support.postgres import Cluster

                cluster = Cluster()
                cluster.settings = "-c fsync=on -c synchronous_commit=on -c max_connections=100"
                cluster.start()
                dsn = cluster.dsn
                store = {"kind": "postgres", "dsn": dsn}
            else:
                store = {"kind": "sqlite", "path": "./gateway.db"}
            config = write_config(folder, gw_port, upstream.url + "/v1", store, args.window_s)
            gateway = start_gateway(["serve", "--config", str(config)], "/healthz", gw_port, folder / "gateway.log")
            procs.append(gateway)
            load = Load(gateway.url, args.minutes)
            rows: list[Row] = []
            last_storage = sum(storage_parts(folder, redis_port, dsn).values())
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
                tasks = [asyncio.ensure_future(worker(load, session, i)) for i in range(args.concurrency)]
                minute = 0
                while minute < math.ceil(args.minutes):
                    await asyncio.wait(tasks, timeout=max(0.0, load.started + 60 * (minute + 1) - time.monotonic()))
                    parts = storage_parts(folder, redis_port, dsn)
                    tables, expired = pg_tables(dsn) if dsn is not None else ({}, 0)
                    storage = sum(parts.values())
                    m = load.minutes.get(minute, Minute())
                    lat = sorted(m.latencies)
                    n = len(lat)
                    rows.append(Row(minute + 1, n, m.errors,
                                    statistics.median(lat) * 1000 if lat else 0.0,
                                    lat[min(n - 1, int(0.99 * n))] * 1000 if lat else 0.0,
                                    rss_mb(gateway.popen.pid), fds(gateway.popen.pid), storage / 1e6,
                                    (storage - last_storage) / 1024 / n * 1000 if n else 0.0,
                                    " ".join(f"{k} {v / 1e6:.1f}" for k, v in parts.items()), tables, expired))
                    if m.first_error:
                        print(f"  [{kind}] minute {minute + 1}: first error: {m.first_error}", file=sys.stderr)
                    last_storage = storage
                    minute += 1
                await asyncio.gather(*tasks)
            print(f"  [{kind}] " + await books(kind, store, folder, load), file=sys.stderr, flush=True)
            if dsn is not None:
                print(f"  [{kind}] {pg_settings(dsn)}", file=sys.stderr, flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
            if cluster is not None:
                cluster.remove()
    return rows


def print_tables(rows: list[Row]) -> None:
    """Each table's size (MB, indexes and TOAST included) at the end of each minute, and at
    the end its indexes, live and dead tuples and autovacuum runs; then expired reservations."""
    names = sorted(rows[-1].tables, key=lambda t: -rows[-1].tables[t].total)
    print(f"{'table':<17}" + "".join(f"{'m' + str(r.minute):>7}" for r in rows)
          + f"{'idx MB':>8}{'live':>9}{'dead':>8}{'autovac':>8}")
    for name in names:
        last = rows[-1].tables[name]
        sizes = "".join(f"{(r.tables[name].total if name in r.tables else 0) / 1e6:>7.2f}" for r in rows)
        print(f"{name:<17}{sizes}{last.indexes / 1e6:>8.2f}{last.live:>9}{last.dead:>8}{last.autovacuums:>8}")
    print(f"{'expired reserv.':<17}" + "".join(f"{r.expired:>7}" for r in rows))


async def main_async(args: argparse.Namespace) -> int:
    for kind in args.stores.split(","):
        rows = await soak(kind, args)
        total = sum(r.requests for r in rows)
        errors = sum(r.errors for r in rows)
        print(f"\n{kind}: {args.minutes:g} min, c={args.concurrency}, retention window {args.window_s:g} s "
              f"(pruned every {args.window_s / 6:g} s); {total} requests, {errors} errors "
              f"({os.cpu_count()} CPUs shared by every process)")
        print(f"{'min':>4}{'requests':>10}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}{'RSS MB':>8}{'fds':>6}"
              f"{'storage MB':>12}{'KB/1k req':>11}  parts MB")
        for r in rows:
            print(f"{r.minute:>4}{r.requests:>10}{r.errors:>8}{r.p50_ms:>9.1f}{r.p99_ms:>9.1f}{r.rss_mb:>8.1f}"
                  f"{r.fds:>6}{r.storage_mb:>12.2f}{r.growth_kb_per_1k:>11.1f}  {r.parts_mb}")
        window_minutes = int(args.window_s // 60) + 1
        after = [r for r in rows if r.minute > window_minutes]
        if after:
            print(f"after the window (minutes {after[0].minute}-{after[-1].minute}): storage growth "
                  f"{sum(r.growth_kb_per_1k * r.requests for r in after) / max(1, sum(r.requests for r in after)):.1f}"
                  f" KB per 1,000 requests (first minute: {rows[0].growth_kb_per_1k:.1f})")
        if rows and rows[-1].tables:
            print_tables(rows)
            if after and window_minutes <= len(rows):
                base, n = rows[window_minutes - 1].tables, sum(r.requests for r in after)
                growth = {t: (v.total - (base[t].total if t in base else 0)) / 1024 / max(1, n) * 1000
                          for t, v in rows[-1].tables.items()}
                grew = ", ".join(f"{t} {g:+.1f}" for t, g in sorted(growth.items(), key=lambda x: -abs(x[1]))
                                 if abs(g) >= 0.05)
                print(f"growth of each table after the window, KB per 1,000 requests: {grew}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="soak length per store")
    parser.add_argument("--stores", default="sqlite,redis", help="comma-separated: sqlite, redis, postgres")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=60.0, help="retention window of the soak (runs, events)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
