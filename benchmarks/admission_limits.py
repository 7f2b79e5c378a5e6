"""What rate limits add to the admission and the booking of a call, measured in-process.

`proxy_overhead.py` measures limits on vs off over HTTP (three processes on loopback), where
the figure is a few hundredths of a millisecond under a p50 of milliseconds, and a loaded
machine's jitter hides it. This benchmark measures only the code the limits change, with
the real parts: the governor (`admit_turn`, `booking`) and a SQLite store in a temp
folder (`Store.admit` and `Store.commit_turn`), for a team with a budget and the same team
with `rate_limits` (requests, tokens and max_in_flight, never reached), calls alternating
between the two so both see the machine at the same moments. It prints the p50 of each
and the median of the paired differences (target: <= 0.05 ms).

Run: `.venv/bin/python benchmarks/admission_limits.py [--calls 20000] [--store-dir /dev/shm]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.config.rates import RateLimits  # noqa: E402
from gateway.config.settings import Defaults, TeamConfig  # noqa: E402
from gateway.harness.state import RunState  # noqa: E402
from gateway.harness.usage import Price, Usage  # noqa: E402
from gateway.server.runs.governor import Ask, Governor  # noqa: E402
from gateway.store.sqlite import SqliteStore  # noqa: E402
from gateway.tokens import get_counter  # noqa: E402
from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT  # noqa: E402

PRICE = Price(2.0, 12.0)
MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]
TURNS_PER_RUN = 10


async def one(governor: Governor, store: SqliteStore, run: RunState, team: TeamConfig) -> float:
    """Admit, then book, one call of `run` (what a pass-through call does around its upstream)."""
    started = time.perf_counter()
    adm = await governor.admit_turn(run, team, Ask(PRICE, MESSAGES, max_tokens=64))
    usage = Usage(adm.prompt_tokens or 0, 20)
    booking = governor.booking(adm, PRICE.cost(usage), usage.total_tokens)
    run.turns += 1
    await store.commit_turn(run, [], booking)
    return time.perf_counter() - started


async def main_async(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="gw-limits-", dir=args.store_dir))
    store = SqliteStore(folder / "gateway.db")
    governor = Governor(store, get_counter(), Defaults(), owner="bench", ttl_s=15.0)
    off = TeamConfig("bench", ("sk-a",), ("passthrough",), budget_usd=1_000_000.0, budget_period="total")
    on = replace(off, name="limited", rate_limits=RateLimits(60.0, 1_000_000_000, 1_000_000_000, 100_000))
    runs: dict[str, RunState] = {}
    times: dict[str, list[float]] = {"off": [], "on": []}
    warm = args.calls // 10
    try:
        for i in range(args.calls + warm):
            label, team = (("off", off), ("on", on))[i % 2]
            key = f"{label}-{i // (2 * TURNS_PER_RUN)}"
            run = runs.get(key)
            if run is None:
                run = runs[key] = RunState.new("bench", list(MESSAGES), run_id=f"{team.name}/{key}", team=team.name,
                                               policy="passthrough")
                await store.create_run(run)
            elapsed = await one(governor, store, run, team)
            if i >= warm:
                times[label].append(elapsed)
    finally:
        await store.close()
    p50_off, p50_on = (statistics.median(times[k]) * 1000 for k in ("off", "on"))
    paired = statistics.median(b - a for a, b in zip(times["off"], times["on"], strict=False)) * 1000
    print(f"admission + booking in-process (governor + SQLite in {args.store_dir or 'the temp folder'}), "
          f"{len(times['on'])} calls each, alternating")
    print(f"p50 limits off {p50_off:.4f} ms, on {p50_on:.4f} ms -> {p50_on - p50_off:+.4f} ms; "
          f"median paired difference {paired:+.4f} ms (target <= 0.05)")
    return 0 if paired <= 0.05 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="measured calls per side")
    parser.add_argument("--store-dir", help="folder for the SQLite file (e.g. /dev/shm); default: a temp folder")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
