"""What telemetry costs per call: CPU microseconds of the gateway process, tracing on vs off,
the access log on vs off, measured interleaved on one machine.

Three gateways of this tree over the same scripted upstream (`gateway scripted`), SQLite
store, each a governed pass-through call per request:

- `off`: no tracing, no access log (the baseline);
- `traced`: `telemetry` on at `sample_ratio: 1.0`, exporting to a real OTLP/HTTP receiver
  (tests/support/otlp.py, in this process) every span: the SERVER span, `chat`, the attempt;
- `logged`: the access log on (its default: JSON lines on stderr, here the gateway's log file).

Per round and gateway, in alternating order, the CPU time the gateway process used (user +
system, /proc) over `--requests` calls; printed per gateway as the median over rounds of µs
per call, and, against `off` measured next to it in the same round, the median of each
round's ratio and of its difference (the added CPU per call). With `traced`, the exporter's
thread is counted too: it is the same process.

Run: `.venv/bin/python benchmarks/telemetry_overhead.py [--rounds 7] [--requests 400] [--concurrency 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proxy_overhead import gateway_config, load  # noqa: E402
from tree_ab import cpu_s  # noqa: E402

from tests.support.otlp import receiving  # noqa: E402
from tests.support.procs import Proc, free_port, start_gateway  # noqa: E402

VARIANTS = ("off", "traced", "logged")
SPANS_PER_CALL = 3  # the SERVER span, `chat {model}`, the upstream attempt


def start(name: str, folder: Path, upstream: str, extra: dict[str, Any]) -> Proc:
    port = free_port()
    config = gateway_config(folder / name, port, upstream, True)
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **extra}))
    return start_gateway(["serve", "--config", str(config)], "/healthz", port, folder / name / "gateway.log",
                         cwd=ROOT, timeout=180, fresh=True)


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="gw-otel-") as tmp, contextlib.ExitStack() as running, \
            receiving() as receiver:
        folder = Path(tmp)
        up_port = free_port()
        up = start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port, folder / "upstream.log")
        running.callback(up.stop)
        extras: dict[str, dict[str, Any]] = {
            "off": {"access_log": False},
            "traced": {"access_log": False, "telemetry": {"otlp_endpoint": receiver.url, "sample_ratio": 1.0}},
            "logged": {},
        }
        gws: dict[str, Proc] = {}
        for name in VARIANTS:
            gws[name] = start(name, folder, up.url + "/v1", extras[name])
            running.callback(gws[name].stop)
        c, n = args.concurrency, args.requests
        for gw in gws.values():
            await load(gw.url, c, max(50, n // 4), "same run")  # warm
        per_call: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for i in range(args.rounds):
            order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                before = cpu_s(gws[name])
                await load(gws[name].url, c, n, "same run")
                per_call[name].append((cpu_s(gws[name]) - before) / n * 1e6)
        print(f"{args.rounds} rounds of {n} pass-through calls, c={c}; CPU of the gateway process per call "
              f"(median [min-max]); load {os.getloadavg()[0]:.1f}")
        for name in VARIANTS:
            values = per_call[name]
            line = f"{name:<7} {statistics.median(values):7.0f} us [{min(values):.0f}-{max(values):.0f}]"
            if name != "off":
                added = [v - o for v, o in zip(values, per_call["off"], strict=True)]
                ratios = [v / o for v, o in zip(values, per_call["off"], strict=True)]
                line += (f"   x{statistics.median(ratios):.3f} of off [{min(ratios):.3f}-{max(ratios):.3f}]"
                         f"   added {statistics.median(added):+6.0f} us [{min(added):+.0f}..{max(added):+.0f}]")
            print(line)
        calls = args.rounds * n + max(50, n // 4)
        with contextlib.suppress(TimeoutError):  # the exporter's last batch leaves within its delay (5 s)
            receiver.wait_for(lambda spans: len(spans) >= SPANS_PER_CALL * calls, timeout=15)
        names = collections.Counter(span.name for span in receiver.snapshot())
        print(f"spans received from `traced`: {sum(names.values())} for {calls} calls: "
              + ", ".join(f"{count} {name!r}" for name, count in names.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=1)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
