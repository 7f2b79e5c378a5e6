"""What `store.wait_replicas: 1` adds to a call's writes: a Redis master with one replica on
this machine, the admission and the booking of a call (`Store.admit`, `Store.settle`: the
two writes of a server-side turn) made with and without WAIT, alternating, so both see the
machine at the same moments. Prints p50 and p99 of each and the difference of the p50s.

Run: `.venv/bin/python benchmarks/redis_wait.py [--calls 3000]` (needs redis-server).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.store.base import Claim  # noqa: E402
from gateway.store.redis import RedisStore  # noqa: E402
from tests.faults.support import RedisProc  # noqa: E402
from tests.faults.test_failover import wait_in_sync  # noqa: E402


async def measure(url: str, calls: int) -> dict[str, list[float]]:
    stores = {"async": RedisStore(url, "wait0:"), "wait 1": RedisStore(url, "wait1:", wait_replicas=1)}
    times: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for _ in range(calls):
            for name, store in stores.items():
                started = time.perf_counter()
                grant = await store.admit(Claim("bench", "total", 0.001, 1e9))
                assert grant.reservation_id is not None
                await store.settle(grant.reservation_id, 0.001)
                times[name].append(time.perf_counter() - started)
    finally:
        for store in stores.values():
            await store.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gw-redis-wait-"))
    master = RedisProc(folder / "master", appendonly=False)
    master.start()
    replica = RedisProc(folder / "replica", appendonly=False, args=("--replicaof", "127.0.0.1", str(master.port)))
    try:
        replica.start()
        wait_in_sync(replica)
        times = asyncio.run(measure(master.url, args.calls))
    finally:
        replica.stop()
        master.stop()
        shutil.rmtree(folder, ignore_errors=True)
    p50 = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:7s} admit + settle: p50 {p50[name]:.3f} ms, p99 {sorted(t)[int(len(t) * 0.99)] * 1000:.3f} ms")
    print(f"WAIT adds {p50['wait 1'] - p50['async']:.3f} ms at p50 to the two writes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
