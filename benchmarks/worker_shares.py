"""Where the cores go at c=32: a 1-worker and a 2-worker gateway, and everything beside them.

Why `--workers 2` does not double the requests per second on this 2-core machine: it starts
the scripted upstream, (with `--store redis`) a redis-server, and a gateway with one worker,
then one with two, drives same-run calls at concurrency 32 with the benchmark's own load
generator (this process), and reads every process's CPU time (/proc/PID/task/*/stat) over
the measured calls. It prints req/s and the cores each part used, so the CPU per call of
the gateway with one and two workers can be compared.

Run: `.venv/bin/python benchmarks/worker_shares.py [--store sqlite|redis] [--calls 12000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proxy_overhead import gateway_config, gateway_pids, load  # noqa: E402
from tests.store.conftest import _start_redis  # noqa: E402
from tests.support.procs import Proc, free_port, wait_http  # noqa: E402


def cores_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) of every thread of `pids`."""
    ticks = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(workers: int, store: str, calls: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="shares"))
    up_port, port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up = subprocess.Popen([sys.executable, "-m", "gateway", "scripted", "--port", str(up_port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(up)
        redis: subprocess.Popen[bytes] | None = None
        config: dict[str, Any] | None = None
        if store == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                raise SystemExit("redis-server is not installed")
            redis, redis_port = _start_redis(exe, folder)
            procs.append(redis)
            config = {"kind": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"}
        path = gateway_config(folder / "gw", port, f"http://127.0.0.1:{up_port}/v1", True, store=config)
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--loop", "asyncio",
                               "--workers", str(workers)], cwd=folder / "gw",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", gw, 120, folder / "gateway.log")
        wait_http(f"http://127.0.0.1:{up_port}/healthz", up, 60, folder / "upstream.log")
        served = gateway_pids(Proc(gw, url, folder / "gateway.log"))  # the supervisor starts every worker at once
        asyncio.run(load(url, 32, 2000, "same run"))  # warm: connections, caches
        others = [redis.pid] if redis is not None else []
        before = cores_seconds([up.pid]), cores_seconds(served), time.process_time(), cores_seconds(others)
        started = time.monotonic()
        figures = asyncio.run(load(url, 32, calls, "same run"))
        wall = time.monotonic() - started
        after = cores_seconds([up.pid]), cores_seconds(served), time.process_time(), cores_seconds(others)
        used = [(b - a) / wall for a, b in zip(before, after, strict=True)]
        extra = f", redis-server {used[3]:.2f}" if redis is not None else ""
        print(f"{store} workers={workers}: {figures.rps:,.0f} req/s, gateway CPU per call "
              f"{used[1] / figures.rps * 1e6:,.0f} µs; cores used: gateway {used[1]:.2f}, upstream {used[0]:.2f}, "
              f"load generator {used[2]:.2f}{extra}", flush=True)
    finally:
        for proc in reversed(procs):
            Proc(proc, "", folder / "unused.log").stop()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--calls", type=int, default=12_000, help="measured calls per gateway")
    args = parser.parse_args()
    for workers in (1, 2):
        measure(workers, args.store, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
