"""Two source trees of the gateway, measured interleaved on one machine: before vs after a change.

On a shared machine the load swings between two runs of `proxy_overhead.py` more than a
change moves the figures. This starts a gateway from each tree (`--base`, e.g. a
`git worktree` or `git archive` of main, and this tree) over the same scripted upstream,
for each store, and measures them in alternation, `--rounds` times per cell: the CPU time
the gateway process used (the least noisy figure on a loaded machine), its own time
(`gateway_overhead_seconds`), p50 latency and req/s. It prints, per cell, the median over
rounds of this tree's figure as a ratio to the base's taken right next to it.

With `--limits`, the cell is instead proxy_overhead's `--limits` one for each tree: c=1
same-run calls alternating a plain one and one of a team with rate limits on a routed model
("both"), on one connection; per round and tree, the median over its pairs of the CPU the
gateway's serving thread (and redis-server, on Redis) spent on "both" minus on the plain
call, and the same for latency; printed per tree, with this tree's as a ratio to the base's.

Run: `.venv/bin/python benchmarks/tree_ab.py --base /tmp/main-tree [--rounds 5] [--requests 300] [--limits]
[--this-config '{"access_log": false}']` (`--this-config`: config sections for this tree's gateway only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proxy_overhead import gateway_config, load, mean_between, own_time, rotated  # noqa: E402

from tests.store.conftest import _start_redis  # noqa: E402
from tests.support.procs import Proc, free_port, start_gateway  # noqa: E402

MODES = ("same run", "new run")


def start(tree: Path, name: str, folder: Path, upstream: str, store: dict[str, Any] | None,
          limits: bool = False, extra: dict[str, Any] | None = None) -> Proc:
    port = free_port()
    config = gateway_config(folder / name, port, upstream, True, store=store, limits=limits)
    if extra:  # top-level config sections for this gateway only (e.g. {"access_log": false})
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **extra}))
    # fresh: a gateway forked from the test zygote runs the code the zygote imported (this
    # tree's), whatever `tree` is; a new interpreter imports `tree`'s own.
    return start_gateway(["serve", "--config", str(config)], "/healthz", port, folder / name / "gateway.log",
                         cwd=tree, env={"PYTHONPATH": str(tree)}, timeout=180, fresh=True)


def cpu_s(proc: Proc) -> float:
    """CPU time (user + system) the gateway process has used so far: unlike wall-clock
    figures, barely moved by what else the machine runs."""
    fields = Path(f"/proc/{proc.popen.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cell(base: Proc, this: Proc, mode: str, c: int, n: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"cpu/call": [], "own": [], "p50": [], "req/s": []}
    for gw in (base, this):
        await load(gw.url, c, max(50, n // 5), mode)  # warm
    for i in range(rounds):
        figures = {}
        for gw in ((base, this) if i % 2 == 0 else (this, base)):  # alternate who goes first
            before, cpu = await own_time(gw.url), cpu_s(gw)
            result = await load(gw.url, c, n, mode)
            figures[gw.url] = (cpu_s(gw) - cpu, mean_between(before, await own_time(gw.url)), result.p50_ms,
                               result.rps)
        b, t = figures[base.url], figures[this.url]
        for k, key in enumerate(out):
            out[key].append(t[k] / b[k])
    return out


async def limits_pairs(gw: Proc, helpers: list[int], n: int) -> tuple[float, float]:
    """`n` pairs (plain, "both", in alternating order) on one connection: the medians of
    "both" minus plain, CPU (us: the gateway's serving thread and `helpers`) and latency (ms)."""
    ms, cpu = await rotated(gw, helpers, [["off", "both"], ["both", "off"]], n)
    return (statistics.median(b - a for a, b in zip(cpu["off"], cpu["both"], strict=True)),
            statistics.median(b - a for a, b in zip(ms["off"], ms["both"], strict=True)))


async def limits_cell(base: Proc, this: Proc, helpers: list[int], n: int, rounds: int) -> str:
    out: dict[str, list[tuple[float, float]]] = {base.url: [], this.url: []}
    for gw in (base, this):
        await limits_pairs(gw, helpers, max(50, n // 5))  # warm
    for i in range(rounds):
        for gw in ((base, this) if i % 2 == 0 else (this, base)):
            out[gw.url].append(await limits_pairs(gw, helpers, n))
    parts = []
    for tag, gw in (("base", base), ("this", this)):
        cpu = [c for c, _ in out[gw.url]]
        ms = [m for _, m in out[gw.url]]
        parts.append(f"{tag} both +{statistics.median(cpu):.1f} us [{min(cpu):.1f}-{max(cpu):.1f}] "
                     f"+{statistics.median(ms):.3f} ms")
    ratios = [t[0] / b[0] for b, t in zip(out[base.url], out[this.url], strict=True) if b[0] > 0]
    return " | ".join(parts) + (f" | cpu x{statistics.median(ratios):.2f}" if ratios else "")


def stop_redis(popen: subprocess.Popen[bytes]) -> None:
    popen.kill()
    popen.wait()


async def main_async(args: argparse.Namespace) -> None:
    base_tree = Path(args.base).resolve()
    with tempfile.TemporaryDirectory(prefix="gw-ab-") as tmp, contextlib.ExitStack() as running:
        folder = Path(tmp)
        up_port = free_port()
        up = start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port, folder / "upstream.log")
        running.callback(up.stop)
        stores: dict[str, dict[str, Any] | None] = {"sqlite": None}
        helpers: dict[str, list[int]] = {}  # what serves a store's gateway besides itself
        exe = shutil.which("redis-server")
        if exe is not None and not args.sqlite_only:
            redis_proc, redis_port = _start_redis(exe, folder)
            running.callback(stop_redis, redis_proc)
            helpers["redis"] = [redis_proc.pid]
            stores["redis"] = {"kind": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"}
        print(f"this tree ({ROOT}) / base ({base_tree}); median [min-max] over {args.rounds} alternating rounds; "
              f"load {os.getloadavg()[0]:.1f}")
        for store, spec in stores.items():
            gws = []
            for tree, tag in ((base_tree, "base"), (ROOT, "this")):
                s = None if spec is None else {**spec, "prefix": f"ab-{tag}:"}
                gw = start(tree, f"{store}-{tag}", folder, up.url + "/v1", s, limits=args.limits,
                           extra=json.loads(args.this_config) if tag == "this" else None)
                running.callback(gw.stop)
                gws.append(gw)
            if args.limits:
                print(f"{store:<7} same run  c=1   limits/routes "
                      f"{await limits_cell(gws[0], gws[1], helpers.get(store, []), args.requests, args.rounds)}",
                      flush=True)
                continue
            for c in (1, 32):
                for mode in MODES:
                    n = args.requests * (2 if c == 32 else 1)
                    figures = await cell(gws[0], gws[1], mode, c, n, args.rounds)
                    shown = " | ".join(f"{k} x{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
                                       for k, v in figures.items())
                    print(f"{store:<7} {mode:<9} c={c:<3} {shown}", flush=True)
        print(f"load {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", required=True, help="the other source tree (e.g. main)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="calls per round at c=1 (twice at c=32)")
    parser.add_argument("--sqlite-only", action="store_true")
    parser.add_argument("--limits", action="store_true", help="the cost of rate limits and route selection instead")
    parser.add_argument("--this-config", default="{}",
                        help='top-level config sections (JSON) for this tree\'s gateway only, e.g. \'{"access_log": false}\'')
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
