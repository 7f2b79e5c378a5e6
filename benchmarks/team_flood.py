"""One team's flood beside a quiet team: the quiet team's latency, quiet and flooded, as a ratio.

Issue 34 item 4: a team without rate limits at ~1,300 req/s from 14 clients raised another
team's p50 from 1.4 ms to 15.1 ms. This starts the scripted upstream (`gateway scripted`)
and one gateway (SQLite, one worker) with two teams, `flood` and `quiet`, neither with rate
limits. Each round measures the quiet team's p50 over `--calls` sequential same-run calls
(one connection) alone, then again while `--flooders` connections of the flood team call
as fast as the gateway answers them (from a process of their own, so the two load
generators do not share a core's event loop). It prints, per round and as the median over
`--rounds`, the quiet p50 alone, flooded, their ratio, and the flood's req/s. On this
shared machine the absolute figures swing with the load; the ratio is the point.

Run: `.venv/bin/python benchmarks/team_flood.py [--rounds 5] [--calls 400] [--flooders 14]
[--work-slots N] [--tree DIR]` (`--work-slots`: the gateway's `server.work_slots`, 0 turns
the fair share off; `--tree`: measure the gateway of another source tree, e.g. a worktree
of main, with this tree's load generators).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proxy_overhead import BODY, RawConnection, request_head  # noqa: E402
from tests.support.procs import Proc, free_port, start_gateway  # noqa: E402

QUIET, FLOOD = "sk-quiet", "sk-flood"


def config(folder: Path, port: int, upstream: str, work_slots: int | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "policies").mkdir(exist_ok=True)
    (folder / "policies" / "passthrough.yaml").write_text(
        "name: passthrough\nlimits: {max_turns: 1000000, max_budget_usd: 1000000.0, budget_mode: turn}\n")
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": str(folder / "gateway.db")},
        "policies_dir": "./policies",
        "upstreams": [{"name": "bench", "base_url": upstream}],
        "models": [{"match": "*", "upstream": "bench", "price_in": 2.0, "price_out": 12.0}],
        "teams": [{"name": "quiet", "keys": [QUIET], "budget_usd": 1_000_000.0, "budget_period": "total",
                   "policies": ["passthrough"]},
                  {"name": "flood", "keys": [FLOOD], "budget_usd": 1_000_000.0, "budget_period": "total",
                   "policies": ["passthrough"]}],
    }
    if work_slots is not None:
        data["server"]["work_slots"] = work_slots
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def quiet_p50(url: str, calls: int, tag: str) -> float:
    """The quiet team's p50 (ms) over `calls` sequential calls of one run per 10 calls."""
    conn = await RawConnection.open(url)
    times = []
    try:
        for n in range(calls):
            head = request_head("/v1/chat/completions", BODY, f"quiet-{tag}-{n // 10}", QUIET)
            started = time.perf_counter()
            status = await conn.post(head, BODY)
            times.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"the quiet team's call answered {status}")
    finally:
        conn.close()
    return statistics.median(times) * 1000


def flood(url: str, flooders: int, stop: Any, counted: Any) -> None:
    """In a process of its own: `flooders` connections of the flood team, each calling as
    soon as its last call is answered (new run every 10 calls), until `stop` is set."""

    async def main() -> None:
        conns = [await RawConnection.open(url) for _ in range(flooders)]

        async def one(i: int) -> None:
            n = 0
            while not stop.is_set():
                head = request_head("/v1/chat/completions", BODY, f"flood-{os.getpid()}-{i}-{n // 10}", FLOOD)
                await conns[i].post(head, BODY)
                n += 1
                with counted.get_lock():
                    counted.value += 1

        await asyncio.gather(*(one(i) for i in range(flooders)))
        for conn in conns:
            conn.close()

    asyncio.run(main())


async def round_(url: str, calls: int, flooders: int, tag: str) -> tuple[float, float, float]:
    alone = await quiet_p50(url, calls, f"{tag}a")
    ctx = multiprocessing.get_context("spawn")
    stop, counted = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=flood, args=(url, flooders, stop, counted), daemon=True)
    proc.start()
    try:
        while counted.value < flooders * 20:  # the flood is under way
            await asyncio.sleep(0.05)
        before, started = counted.value, time.perf_counter()
        flooded = await quiet_p50(url, calls, f"{tag}f")
        rps = (counted.value - before) / (time.perf_counter() - started)
    finally:
        stop.set()
        proc.join(30)
    return alone, flooded, rps


async def main_async(args: argparse.Namespace) -> None:
    tree = Path(args.tree).resolve() if args.tree else ROOT
    with tempfile.TemporaryDirectory(prefix="flood-") as tmp:
        folder = Path(tmp)
        up_port, port = free_port(), free_port()
        up = start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port, folder / "upstream.log",
                           fresh=True)
        gw: Proc | None = None
        try:
            path = config(folder / "gw", port, up.url + "/v1", args.work_slots)
            gw = start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gw.log", cwd=tree,
                               env={"PYTHONPATH": str(tree)}, fresh=True)
            await quiet_p50(gw.url, 200, "warm")
            slots = "default" if args.work_slots is None else args.work_slots
            print(f"gateway of {tree} (work_slots {slots}); {args.flooders} flooders; {args.calls} quiet calls per phase; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            rows = []
            for r in range(args.rounds):
                alone, flooded, rps = await round_(gw.url, args.calls, args.flooders, str(r))
                rows.append((alone, flooded, rps))
                print(f"round {r + 1}: quiet p50 {alone:.2f} ms alone, {flooded:.2f} ms flooded "
                      f"(x{flooded / alone:.2f}); flood {rps:.0f} req/s", flush=True)
            ratios = [f / a for a, f, _ in rows]
            print(f"median: quiet p50 {statistics.median(a for a, _, _ in rows):.2f} ms alone, "
                  f"{statistics.median(f for _, f, _ in rows):.2f} ms flooded, ratio x{statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}]; flood {statistics.median(r for _, _, r in rows):.0f} req/s; "
                  f"load {os.getloadavg()[0]:.1f}")
        finally:
            if gw is not None:
                gw.stop()
            up.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="the quiet team's calls per phase")
    parser.add_argument("--flooders", type=int, default=14)
    parser.add_argument("--tree", help="the source tree whose gateway to measure (default: this one)")
    parser.add_argument("--work-slots", type=int, help="server.work_slots (default: the config's default; 0: off)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
