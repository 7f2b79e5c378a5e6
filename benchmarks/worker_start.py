"""What `gateway serve --workers N` costs to start, against one gateway process started alike.

The supervisor loads the tokenizer once and forks its workers (gateway/server/workers.py),
so N workers should cost little more than one process: the figures are ratios to a
single `gateway serve` measured in the same run, on the README's config with a SQLite
store in a temporary folder. For each N (1 is the baseline), `--runs` starts of a fresh
interpreter print:
- `ready`: the start -> the "serving" line (median seconds, and the ratio to N=1);
- `cpu`: CPU seconds of the supervisor and its workers per start (and the ratio);
- `pss`: the proportional set size of the whole server once it serves (MB, and the ratio):
  pages the workers share with the supervisor are counted once.

Run: `.venv/bin/python benchmarks/worker_start.py [--workers 2 4] [--runs 5]`.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pss_kb(pid: int) -> int:
    """The PSS of `pid` and its children (kB), from /proc (Linux)."""
    pids = [pid, *(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    total = 0
    for each in pids:
        for line in Path(f"/proc/{each}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def _config(folder: Path) -> Path:
    text = (ROOT / "config.yaml").read_text()
    for old, new in (("port: 8080", "port: 0"), ("./gateway.db", str(folder / "gateway.db")),
                     ("./policies", str(ROOT / "policies")), ("./runs", str(folder / "runs")),
                     ("./trace.jsonl", str(folder / "trace.jsonl"))):
        text = text.replace(old, new)
    path = folder / "config.yaml"
    path.write_text(text)
    return path


def _start(config: Path, workers: int) -> tuple[float, float, int]:
    """(seconds to serving, CPU seconds, PSS kB) of one start of `--workers workers`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--workers",
                             str(workers)], cwd=ROOT, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    for line in proc.stderr:
        if b"serving on" in line:
            break
    else:
        raise SystemExit(f"--workers {workers} did not start")
    ready = time.monotonic() - began
    pss = _pss_kb(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return ready, cpu, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/smaps_rollup"):
        raise SystemExit("needs Linux /proc")
    with tempfile.TemporaryDirectory(prefix="gw-workers-") as folder:
        config = _config(Path(folder))
        rows: dict[int, tuple[float, float, float]] = {}
        for n in [1, *args.workers]:
            starts = [_start(config, n) for _ in range(args.runs)]
            rows[n] = (statistics.median(s[0] for s in starts), statistics.median(s[1] for s in starts),
                       statistics.median(s[2] for s in starts) / 1024)
        base = rows[1]
        print(f"{'workers':>8} {'ready s':>8} {'x':>5} {'cpu s':>7} {'x':>5} {'pss MB':>7} {'x':>5}")
        for n, (ready, cpu, pss) in rows.items():
            print(f"{n:>8} {ready:8.2f} {ready / base[0]:5.2f} {cpu:7.2f} {cpu / base[1]:5.2f} {pss:7.1f} "
                  f"{pss / base[2]:5.2f}")


if __name__ == "__main__":
    main()
