"""What issued keys and several budgets add to a call, measured in-process with the real parts.

1. Authentication: `KeyRing.authenticate` of a real aiohttp request carrying a config key
   and one carrying a store key (the keyring synced from a store holding `--keys` issued
   keys), alternating, each timed in batches; prints the p50 per call of each and the
   median of the paired differences (target: a store key adds <= 0.02 ms over a config
   key). A store key's lookup never touches the store: the sync runs beside the calls.
2. Admission + booking (`Governor.admit_turn`, `Store.commit_turn`) of a call held to one
   budget (the team's) and of a call held to four (the run's, the key's, the user's and
   the team's), alternating, on SQLite (a temp folder, or `--store-dir`) and, with
   `--redis-url`, on Redis; prints the p50 of each and the median paired difference.
3. Spend rows: the same admission and booking (team budget only) on two SQLite stores in
   one folder, one of them not writing the booking's spend row (what every call pays for
   `GET /v1/spend`), alternating.

Run: `.venv/bin/python benchmarks/keys_budgets.py [--calls 20000] [--keys 1000] [--store-dir /dev/shm]
      [--redis-url redis://127.0.0.1:6379/0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiohttp.test_utils import make_mocked_request  # noqa: E402

from gateway.config.keys import Caller, ConfigKey, key_scope_of  # noqa: E402
from gateway.config.settings import Defaults, TeamConfig  # noqa: E402
from gateway.harness.state import Limits, RunState  # noqa: E402
from gateway.harness.usage import Price, Usage  # noqa: E402
from gateway.server.http.auth import KeyRing  # noqa: E402
from gateway.server.runs.governor import Ask, Governor  # noqa: E402
from gateway.store.base import Store  # noqa: E402
from gateway.store.keys import KeyRecord, new_key_id, new_secret, secret_hash, visible_prefix  # noqa: E402
from gateway.store.memory import MemoryStore  # noqa: E402
from gateway.store.redis import RedisStore  # noqa: E402
from gateway.store.sqlite import SqliteStore  # noqa: E402
from gateway.tokens import get_counter  # noqa: E402
from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT  # noqa: E402

PRICE = Price(2.0, 12.0)
MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]
TURNS_PER_RUN = 10
BATCH = 50
"""Lookups per timing: one lookup is a microsecond or two, near the timer's own cost."""


def _summary(label: str, times: dict[str, list[float]], a: str, b: str, unit_ms: float = 1000.0) -> str:
    pa, pb = (statistics.median(times[k]) * unit_ms for k in (a, b))
    paired = [y - x for x, y in zip(times[a], times[b], strict=False)]
    diff = statistics.median(paired) * unit_ms
    q1, q3 = (statistics.quantiles(paired, n=4)[i] * unit_ms for i in (0, 2))
    return (f"{label}: p50 {a} {pa:.4f} ms, {b} {pb:.4f} ms; paired difference median {diff:+.4f} ms "
            f"(interquartile {q1:+.4f} to {q3:+.4f}), {len(paired)} pairs")


async def authentication(calls: int, keys: int) -> str:
    team = TeamConfig("bench", ("sk-config-key",), ("passthrough",), config_keys=(ConfigKey("sk-config-key"),))
    store = MemoryStore()
    secret = ""
    for i in range(keys):
        s = new_secret()
        await store.put_key(KeyRecord(new_key_id(), "bench", f"k{i}", visible_prefix(s), secret_hash(s), time.time(),
                                      budget_usd=5.0, models=("gpt-*",), rate_limits={"requests_per_minute": 600}),
                            None)
        secret = secret or s
    ring = KeyRing([team], store)
    await ring.sync()
    requests = {"config": make_mocked_request("POST", "/v1/chat/completions",
                                              headers={"Authorization": "Bearer sk-config-key"}),
                "store": make_mocked_request("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"})}
    times: dict[str, list[float]] = {"config": [], "store": []}
    warm = calls // 10
    for i in range(calls + warm):
        label = ("config", "store")[i % 2]
        request = requests[label]
        started = time.perf_counter()
        for _ in range(BATCH):
            await ring.authenticate(request)
        elapsed = (time.perf_counter() - started) / BATCH
        if i >= warm:
            times[label].append(elapsed)
    assert (await ring.authenticate(requests["store"])).caller is not None
    return _summary(f"authentication ({keys} store keys in the keyring)", times, "config", "store")


async def admission(store: Store, where: str, calls: int) -> str:
    governor = Governor(store, get_counter(), Defaults(), owner="bench", ttl_s=15.0)
    tag = uuid.uuid4().hex[:6]
    key = Caller("key_bench", "bench", "store", key_scope_of("key_bench"))
    one_budget = TeamConfig(f"one-{tag}", ("sk-a",), ("passthrough",), budget_usd=1e6, budget_period="total",
                            caller=key)
    four = replace(one_budget, name=f"four-{tag}", user_budget_usd=1e6, user_budget_period="week",
                   caller=replace(key, budget_usd=1e6))
    runs: dict[str, RunState] = {}
    times: dict[str, list[float]] = {"one": [], "four": []}
    warm = calls // 10
    for i in range(calls + warm):
        label, team = (("one", one_budget), ("four", four))[i % 2]
        name = f"{label}-{i // (2 * TURNS_PER_RUN)}"
        run = runs.get(name)
        if run is None:
            limits = Limits(max_turns=1000, max_budget_usd=1e6 if label == "four" else None)
            run = runs[name] = RunState.new("bench", list(MESSAGES), run_id=f"{team.name}/{name}", team=team.name,
                                           policy="passthrough", limits=limits)
            await store.create_run(run)
        started = time.perf_counter()
        adm = await governor.admit_turn(run, team, Ask(PRICE, MESSAGES, max_tokens=64, model="bench",
                                                       user="ana" if label == "four" else None))
        usage = Usage(adm.prompt_tokens or 0, 20)
        booking = governor.booking(adm, PRICE.cost(usage), usage.total_tokens)
        run.turns += 1
        await store.commit_turn(run, [], booking)
        if i >= warm:
            times[label].append(time.perf_counter() - started)
        if label == "four" and i == warm:
            assert len(adm.holds) == 2, adm.holds  # the key's and the user's, besides the run's and the team's
    return _summary(f"admission + booking, {where}", times, "one", "four")


class _NoSpendRows(SqliteStore):
    """The SQLite store as it was before spend rows: a booking writes the team's ledger only."""

    @classmethod
    def _book(cls, db: Any, team: str, period: str, micros: int, attribution: Any) -> None:
        cls._ledger(db, team, period, micros)


async def spend_rows(folder: Path, calls: int) -> str:
    stores = {"with": SqliteStore(folder / "with.db"), "without": _NoSpendRows(folder / "without.db")}
    governors = {k: Governor(s, get_counter(), Defaults(), owner="bench", ttl_s=15.0) for k, s in stores.items()}
    team = TeamConfig("spend", ("sk-a",), ("passthrough",), budget_usd=1e6, budget_period="total")
    runs: dict[str, RunState] = {}
    times: dict[str, list[float]] = {"without": [], "with": []}
    warm = calls // 10
    try:
        for i in range(calls + warm):
            label = ("without", "with")[i % 2]
            store, governor = stores[label], governors[label]
            name = f"{label}-{i // (2 * TURNS_PER_RUN)}"
            run = runs.get(name)
            if run is None:
                run = runs[name] = RunState.new("bench", list(MESSAGES), run_id=f"spend/{name}", team="spend",
                                                policy="passthrough")
                await store.create_run(run)
            started = time.perf_counter()
            adm = await governor.admit_turn(run, team, Ask(PRICE, MESSAGES, max_tokens=64, model="bench"))
            usage = Usage(adm.prompt_tokens or 0, 20)
            run.turns += 1
            await store.commit_turn(run, [], governor.booking(adm, PRICE.cost(usage), usage.total_tokens))
            if i >= warm:
                times[label].append(time.perf_counter() - started)
    finally:
        for store in stores.values():
            await store.close()
    return _summary("spend rows, SQLite", times, "without", "with")


async def main_async(args: argparse.Namespace) -> int:
    print(await authentication(args.calls, args.keys))
    folder = Path(tempfile.mkdtemp(prefix="gw-keys-", dir=args.store_dir))
    sqlite = SqliteStore(folder / "gateway.db")
    try:
        print(await admission(sqlite, f"SQLite in {args.store_dir or 'the temp folder'}", args.calls))
    finally:
        await sqlite.close()
    print(await spend_rows(folder, args.calls))
    if args.redis_url:
        redis = RedisStore(args.redis_url, prefix=f"bench-{uuid.uuid4().hex[:6]}:")
        try:
            print(await admission(redis, f"Redis at {args.redis_url}", args.calls // 4))
        finally:
            await redis.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--store-dir", default=None)
    parser.add_argument("--redis-url", default=None)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
