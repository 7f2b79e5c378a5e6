"""Admissions per second on one hot team's ledger, on PostgreSQL, from 64 concurrent clients.

Every admission of a team with a budget locks the team's ledger row (gw_admit: the row is
the team's mutex, so the budget is exact across replicas) until its transaction commits; a
commit waits for its WAL flush. So the row serializes the team's admissions and bookings,
and one team's rate is bounded by how fast the row changes hands. This measures it.

One run starts its own PostgreSQL cluster (durable settings: fsync on, synchronous_commit
on, as a production database) in a temporary folder, then, for each case, 64 asyncio
clients (over `--pools` pools, as several replicas would be) loop for `--seconds`: admit
a call (a claim with the team's budget and the run's turn slot, like a real pass-through
call) and book it (gw_settle), as a gateway does for every call. Cases:

    hot team, 1 ledger row   all 64 clients on one team with a budget, its ledger one row
                             (the store with LEDGER_SLOTS = 1): every admission locks it
    hot team, 8 slot rows    the same, the ledger split in 8 slot rows (the store as shipped)
    hot team, no budget      the same team without a team budget: no ledger row is locked
    hot team+key budget      8 slot rows, and every call also holds one key's budget (one row)
    64 teams, budget         each client its own team: nothing shared

Printed: admissions (each with its booking) per second, their p50/p99 latency, and the
hot team's ratio to the 64-team case. `--compare N` also prints what one gateway process
served in req/s (e.g. the figure of benchmarks/proxy_overhead.py at c=32), as the line to
beat. The ledger is checked exact at the end of each case (spent = sum of bookings).

Run: `.venv/bin/python benchmarks/pg_hot_team.py [--seconds 10] [--clients 64] [--pools 2]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.store.base import Claim, Hold, RateLimit  # noqa: E402
from gateway.store.postgres import PostgresStore  # noqa: E402


def start_cluster(durable: bool) -> tuple[str, object]:
    from tests.support import postgres

    cluster = postgres.Cluster()
    if durable:  # the Cluster's defaults are the tests' (fsync off): override them for a fair figure
        cluster.settings = "-c fsync=on -c synchronous_commit=on -c max_connections=300"
    cluster.start()
    return cluster.dsn, cluster


async def case(dsn: str, name: str, clients: int, pools: int, seconds: float, teams: int, budget: bool,
               slots: int, hold: bool = False) -> dict[str, float]:
    from gateway.harness.state import RunState

    schema = f"bench_{abs(hash(name)) % 10**8}_{os.getpid()}"
    stores = [PostgresStore(dsn, schema, pool_max=max(2, clients // pools + 1), pool_min=0, timeout_s=60)
              for _ in range(pools)]
    for store in stores:
        store.ledger_slots = slots
    await stores[0].start()
    for i in range(clients):
        await stores[0].create_run(RunState.new("m", [], run_id=f"t{i % teams}/run{i}", team=f"t{i % teams}"))
    latencies: list[float] = []
    booked = [0] * teams
    stop_at = time.monotonic() + seconds

    async def client(i: int) -> None:
        store, team = stores[i % pools], f"t{i % teams}"
        claim = Claim(team, "total", 0.000010, 1e6 if budget else None, run_id=f"{team}/run{i}", max_turns=10**9,
                      holds=(Hold("key", f"key:{team}", "total", 1e6),) if hold else ())
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            grant = await store.admit(claim)
            assert grant.reservation_id is not None, grant
            await store.settle(grant.reservation_id, 0.000007)
            latencies.append(time.perf_counter() - t0)
            booked[i % teams] += 7

    began = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.monotonic() - began
    for t in range(teams):  # exact: the ledger is the sum of the bookings, nothing left held
        spent, reserved = await stores[0].team_spend(f"t{t}", "total")
        assert round(spent * 1e6) == booked[t] and reserved == 0.0, (t, spent, booked[t], reserved)
    for s in stores:
        await s.close()
    latencies.sort()
    return {"rate": len(latencies) / elapsed, "p50": statistics.median(latencies) * 1000,
            "p99": latencies[int(len(latencies) * 0.99)] * 1000}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--pools", type=int, default=2, help="pools (replicas) the clients are spread over")
    parser.add_argument("--fast", action="store_true", help="fsync off (as the tests run it), not durable")
    parser.add_argument("--compare", type=float, help="req/s one gateway process served (the line to beat)")
    parser.add_argument("--dsn", help="an existing database instead of a cluster of its own")
    args = parser.parse_args()
    cluster = None
    dsn = args.dsn
    if dsn is None:
        dsn, cluster = start_cluster(durable=not args.fast)
    try:
        results = {}
        cases = (("hot team, 1 ledger row", 1, True, 1, False), ("hot team, 8 slot rows", 1, True, 8, False),
                 ("hot team, no budget", 1, False, 8, False), ("hot team+key budget", 1, True, 8, True),
                 (f"{args.clients} teams, budget", args.clients, True, 8, False))
        for name, teams, budget, slots, hold in cases:
            results[name] = await case(dsn, name, args.clients, args.pools, args.seconds, teams, budget, slots, hold)
            r = results[name]
            print(f"{name:<24} {r['rate']:8.0f} admissions+bookings/s   p50 {r['p50']:6.2f} ms   p99 {r['p99']:6.2f} ms",
                  flush=True)
        one, hot = results["hot team, 1 ledger row"]["rate"], results["hot team, 8 slot rows"]["rate"]
        spread = results[f"{args.clients} teams, budget"]["rate"]
        print(f"8 slot rows / 1 row: x{hot / one:.2f}   hot team (8 slots) / {args.clients} teams: x{hot / spread:.2f}"
              f"   1 row / {args.clients} teams: x{one / spread:.2f}")
        if args.compare:
            print(f"hot team / one gateway process ({args.compare:.0f} req/s): x{hot / args.compare:.2f}")
    finally:
        if cluster is not None:
            cluster.remove()  # type: ignore[attr-defined]


if __name__ == "__main__":
    tempfile.tempdir = tempfile.gettempdir()
    asyncio.run(main())
