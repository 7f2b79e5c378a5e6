"""What the gateway costs on the hot path, at every shape of traffic, next to a 30-line proxy.

One run starts real processes on loopback: the scripted upstream (`gateway scripted`), a
minimal aiohttp pass-through proxy (`MINIMAL_PROXY`, the floor), a redis-server, a
PostgreSQL cluster of its own (durable: fsync and synchronous_commit on), and gateways
(`gateway serve`) on SQLite, on Redis and on PostgreSQL, each with a team budget so that every
call is reserved and settled. It then measures a matrix of cells:

    {same run (10 turns per X-Run-Id), new run per call, no X-Run-Id}
      x {SQLite, Redis, PostgreSQL} x {c=1, c=32} x {non-streamed latency and req/s, streamed TTFB}

Each cell measures, back to back: the upstream directly, the floor proxy, the gateway.
Added latency = p50 - direct p50; a cell's figure is the gateway's added latency as a
ratio to the floor's, its req/s as a ratio to the floor's (c=32), its stream's time to
first byte minus the floor's (c=1), and the gateway's own time per call (the mean of
`gateway_overhead_seconds` over the cell). The whole matrix is repeated (`--repeat`,
default 3); the median and the spread (min-max) of every figure are printed, so noise
is visible. With `--workers 2` the matrix also measures, at c=32, a 2-worker gateway's
req/s as a ratio to the 1-worker gateway's, in the same repetition. `--compare-loops`
adds asyncio vs uvloop cells.

Targets (issue 16): added latency <= 1.5x the floor's at c=1 for same-run and new-run
calls on SQLite, <= 2x on Redis; req/s at c=32 >= 0.7x the floor's; stream TTFB <= the
floor's + 0.5 ms; --workers 2 at c=32 >= 1.6x one worker's req/s.

`--limits` adds, per store, the cost of rate limits and of route selection (issue 15): one
gateway serves a team without rate limits and one with them (requests, tokens and
max_in_flight, never reached), a model routed to one upstream and one routed over two
weighted deployments (retries, a fallback); c=1 same-run calls rotate over the four
combinations on one connection (off, limits, routed, both, in orders that make each follow
each other equally often: `williams`), so that each sees the machine at the same moments. Its figures: each combination's p50 minus the plain one's, the
median of the per-round differences (paired), and the CPU time the gateway's serving
thread (plus redis-server's, on Redis) spent on each call (from /proc/PID/schedstat, read
around every call), paired the same way. On a loaded machine a call's latency stretches
with the CPU it needs (every microsecond of work waits for a core), so the CPU figure is
the one that holds still there; on an idle one the two agree. Target: both <= plain +
0.05 ms p50. Limits never reached are far from reached: most of the limited calls are
admitted from what an earlier call of the gateway took ahead (docs/limits.md, allowances),
as they would be for a team well within its limits; calls near a limit each move the
clocks in their own admission, which costs more (not measured here).
`--limits-only` measures that cell alone.

`--profile DIR` instead runs every cell once with py-spy (extra `profile`) sampling the
gateway and prints the top functions by own time (raw stacks kept in DIR).

Run: `.venv/bin/python benchmarks/proxy_overhead.py [--quick] [--requests 1000] [--repeat 3]
[--workers 2] [--only sqlite] [--loop asyncio]`. All processes and the load generator share
the machine, so absolute numbers say more about the machine than about the gateway; the
ratios are the point, and on a shared machine even they swing: read the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT  # noqa: E402
from tests.store.conftest import _start_redis  # noqa: E402
from tests.support.procs import Proc, free_port, start_gateway, wait_http  # noqa: E402

MINIMAL_PROXY = '''
import sys
import aiohttp
from aiohttp import web

UPSTREAM = sys.argv[2] + "/chat/completions"
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def session_ctx(app):
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


async def chat(request):
    body = await request.read()
    async with request.app[SESSION].post(UPSTREAM, data=body, headers={"Content-Type": "application/json"}) as up:
        if up.content_type != "text/event-stream":
            return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


app = web.Application()
app.cleanup_ctx.append(session_ctx)
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
'''

BODY = orjson.dumps({
    "model": "scripted-plan",
    "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}],
    "tools": [t.openai() for t in FILE_TOOLS],
})
STREAM_BODY = orjson.dumps({**orjson.loads(BODY), "stream": True})
KEY = "sk-bench"
TURNS_PER_RUN = 10
LIMITED_KEY = "sk-bench-limited"
RATE_LIMITS = {"requests_per_minute": 1_000_000_000, "tokens_per_minute": 1_000_000_000, "max_in_flight": 100_000}
"""The limited team's rate limits: all three kinds, never reached."""
ROUTED_MODEL = "bench-routed"
"""A model routed over two weighted deployments (of the one scripted upstream), retries and a fallback."""
ROUTED_BODY = orjson.dumps({**orjson.loads(BODY), "model": ROUTED_MODEL})
LIMIT_VARIANTS = {"off": (KEY, BODY), "limits": (LIMITED_KEY, BODY), "routed": (KEY, ROUTED_BODY),
                  "both": (LIMITED_KEY, ROUTED_BODY)}
"""The `--limits` cell's combinations: (key, body)."""
MODES = ("same run", "new run", "no run id")
STORES = ("sqlite", "redis", "postgres")


class CpuClock:
    """The CPU time of some threads (ns), from /proc/PID/task/TID/schedstat (its first field)."""

    def __init__(self, pids: list[int]) -> None:
        self.fds = [os.open(f"/proc/{pid}/task/{pid}/schedstat", os.O_RDONLY) for pid in pids]

    def __call__(self) -> int:
        return sum(int(os.pread(fd, 128, 0).split()[0]) for fd in self.fds)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def start_proxy(port: int, upstream: str, log: Path) -> Proc:
    out = log.open("wb")
    popen = subprocess.Popen([sys.executable, "-c", MINIMAL_PROXY, str(port), upstream], stdout=out,
                             stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/chat/completions", popen, 30, log)
    return Proc(popen, url, log)


def gateway_config(folder: Path, port: int, upstream: str, team_budget: bool, store_dir: Path | None = None,
                   store: dict[str, Any] | None = None, limits: bool = False) -> Path:
    """A config with one team (`KEY`) whose calls are governed pass-through; `store`
    overrides the SQLite file in `store_dir` (or `folder`). With `limits`, also a team with
    rate limits (`LIMITED_KEY`) and a model routed over two deployments (`ROUTED_MODEL`)."""
    folder.mkdir(parents=True, exist_ok=True)
    policies = folder / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "passthrough.yaml").write_text(
        "name: passthrough\nlimits: {max_turns: 100, max_budget_usd: 10.0, budget_mode: turn}\n")
    team = {"name": "bench", "keys": [KEY], "budget_usd": 1_000_000.0 if team_budget else None,
            "budget_period": "total", "policies": ["passthrough"]}
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store or {"kind": "sqlite", "path": str((store_dir or folder) / "gateway.db")},
        "policies_dir": "./policies",
        "upstreams": [{"name": "bench", "base_url": upstream}],
        "models": [{"match": "*", "upstream": "bench", "price_in": 2.0, "price_out": 12.0}],
        "teams": [team],
    }
    if limits:
        config["upstreams"].append({"name": "bench2", "base_url": upstream})
        config["models"].insert(0, {
            "match": ROUTED_MODEL, "retries": 2, "fallbacks": ["scripted-plan"], "price_in": 2.0, "price_out": 12.0,
            "deployments": [{"upstream": "bench", "model": "scripted-plan", "weight": 3},
                            {"upstream": "bench2", "model": "scripted-plan", "weight": 1}]})
        config["teams"].append({**team, "name": "limited", "keys": [LIMITED_KEY], "rate_limits": RATE_LIMITS})
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# --- load: a bare keep-alive HTTP/1.1 client, so the load generator costs little CPU -------


class RawConnection:
    """One keep-alive connection that posts a fixed body and reads a Content-Length answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def post(self, head: bytes, body: bytes) -> int:
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", raw)
        if match is None:
            raise RuntimeError(f"an answer without Content-Length: {raw[:200]!r}")
        await self.reader.readexactly(int(match.group(1)))
        return status

    def close(self) -> None:
        self.writer.close()


def request_head(path: str, body: bytes, run_id: str | None, key: str = KEY) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Authorization: Bearer {key}", f"Content-Length: {len(body)}"]
    if run_id is not None:
        lines.append(f"X-Run-Id: {run_id}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


_tags = itertools.count()


def run_ids(mode: str | None, worker: int) -> Iterator[str | None]:
    """The X-Run-Id of each call of one load worker in `mode` (None: direct or floor)."""
    tag = f"{os.getpid()}-{next(_tags)}-{worker}"
    for n in itertools.count():
        if mode == "same run":  # a client's agent loop: ten turns per run, then a new run
            yield f"b{tag}-{n // TURNS_PER_RUN}"
        elif mode == "new run":
            yield f"b{tag}-{n}"
        else:
            yield None


@dataclass
class Load:
    p50_ms: float
    p99_ms: float
    rps: float


async def load(url: str, concurrency: int, requests: int, mode: str | None) -> Load:
    """`requests` non-streamed calls from `concurrency` connections."""
    latencies: list[float] = []
    remaining = requests
    conns = [await RawConnection.open(url) for _ in range(concurrency)]

    async def worker(wid: int) -> None:
        nonlocal remaining
        ids = run_ids(mode, wid)
        conn = conns[wid]
        while remaining > 0:
            remaining -= 1
            head = request_head("/v1/chat/completions", BODY, next(ids))
            started = time.perf_counter()
            status = await conn.post(head, BODY)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"{url} answered {status} ({mode})")

    try:
        started = time.perf_counter()
        await asyncio.gather(*[worker(i) for i in range(concurrency)])
        wall = time.perf_counter() - started
    finally:
        for conn in conns:
            conn.close()
    ordered = sorted(latencies)
    return Load(statistics.median(ordered) * 1000, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
                len(latencies) / wall)


async def ttfb(url: str, n: int, mode: str | None) -> float:
    """Median time to the first streamed chunk (the upstream waits 20 ms between chunks)."""
    times = []
    ids = run_ids(mode, 0)
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                       "X-Scripted-Chunk-Delay-Ms": "20"}
            run_id = next(ids)
            if run_id is not None:
                headers["X-Run-Id"] = run_id
            started = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=STREAM_BODY, headers=headers) as resp:
                await resp.content.readuntil(b"\n\n")
                times.append(time.perf_counter() - started)
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status} to a stream ({mode})")
    return statistics.median(times) * 1000


async def own_time(url: str) -> tuple[float, float]:
    """(sum in ms, count) of gateway_overhead_seconds (handler time minus upstream time) so far."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("gateway_overhead_seconds_")}
    return values.get("gateway_overhead_seconds_sum", 0.0) * 1000, values.get("gateway_overhead_seconds_count", 0.0)


def mean_between(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / max(1.0, after[1] - before[1])


# --- the matrix -------------------------------------------------------------------------------


@dataclass
class Cell:
    name: str
    figures: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)


@dataclass
class Bench:
    args: argparse.Namespace
    upstream: Proc
    proxy: Proc
    gateways: dict[str, Proc]
    cells: dict[str, Cell] = field(default_factory=dict)
    helpers: dict[str, list[int]] = field(default_factory=dict)
    """Processes that serve a store's gateway besides itself (redis-server), by store."""

    def cell(self, name: str) -> Cell:
        return self.cells.setdefault(name, Cell(name))

    async def latency_cell(self, store: str, mode: str, c: int, profile: Path | None) -> None:
        n = self.args.requests if c == 1 else self.args.requests * 2
        gw = self.gateways[store]
        warm = max(50, n // 10)
        direct = await load(self.upstream.url, c, n, None)
        await load(self.proxy.url, c, warm, None)
        floor = await load(self.proxy.url, c, n, None)
        await load(gw.url, c, warm, mode)
        before = await own_time(gw.url)
        with sampling(gw, profile, f"{store}-{mode}-c{c}"):
            through = await load(gw.url, c, n, mode)
        own = mean_between(before, await own_time(gw.url))
        cell = self.cell(f"{store:<7} {mode:<10} c={c:<3}")
        floor_added, gw_added = floor.p50_ms - direct.p50_ms, through.p50_ms - direct.p50_ms
        cell.add("added ms", gw_added)
        cell.add("floor added ms", floor_added)
        cell.add("x floor", gw_added / floor_added if floor_added > 0 else float("inf"))
        cell.add("req/s x floor", through.rps / floor.rps)
        if c > 1:
            cell.add("req/s", through.rps)
        cell.add("own ms", own)

    async def ttfb_cell(self, store: str, mode: str, profile: Path | None) -> None:
        n = self.args.streams
        floor = await ttfb(self.proxy.url, n, None)
        with sampling(self.gateways[store], profile, f"{store}-{mode}-stream"):
            through = await ttfb(self.gateways[store].url, n, mode)
        cell = self.cell(f"{store:<7} {mode:<10} TTFB ")
        cell.add("floor + ms", through - floor)

    async def limits_cell(self, store: str) -> None:
        """c=1 same-run calls rotating over `LIMIT_VARIANTS` on one connection: each
        combination's p50 and per-round difference against the plain one ("off")."""
        gw = self.gateways[store]
        names = list(LIMIT_VARIANTS)
        orders = [[names[i] for i in order] for order in williams(len(names))]
        times, cpu = await rotated(gw, self.helpers.get(store, []), orders, self.args.requests,
                                   max(50, self.args.requests // 10))
        cell = self.cell(f"{store:<7} same run   c=1   limits/routes")
        base = statistics.median(times["off"])
        cell.add("off p50 ms", base)
        for name in ("limits", "routed", "both"):
            cell.add(f"{name} +ms", statistics.median(times[name]) - base)
            cell.add(f"{name} paired +ms", statistics.median(b - a for a, b in zip(times["off"], times[name],
                                                                                    strict=True)))
        cell.add("off cpu us", statistics.median(cpu["off"]))
        for name in ("limits", "routed", "both"):
            cell.add(f"{name} cpu +us", statistics.median(b - a for a, b in zip(cpu["off"], cpu[name], strict=True)))

    async def workers_cell(self, store: str) -> None:
        n = self.args.requests * 2
        one, many = self.gateways[store], self.gateways[f"{store}-w{self.args.workers}"]
        await load(many.url, 32, max(50, n // 10), "same run")
        a = await load(one.url, 32, n, "same run")
        b = await load(many.url, 32, n, "same run")
        self.cell(f"{store:<7} same run   c=32 workers={self.args.workers}").add("req/s x 1 worker", b.rps / a.rps)

    async def loop_cell(self, c: int) -> None:
        n = self.args.requests if c == 1 else self.args.requests * 2
        direct = await load(self.upstream.url, c, n, None)
        figures = {}
        for kind in ("asyncio", "uvloop"):
            gw = self.gateways[f"sqlite-{kind}"]
            await load(gw.url, c, max(50, n // 10), "same run")
            figures[kind] = await load(gw.url, c, n, "same run")
        cell = self.cell(f"sqlite  same run   c={c:<3} uvloop vs asyncio")
        cell.add("added ms asyncio", figures["asyncio"].p50_ms - direct.p50_ms)
        cell.add("added ms uvloop", figures["uvloop"].p50_ms - direct.p50_ms)
        cell.add("req/s uvloop/asyncio", figures["uvloop"].rps / figures["asyncio"].rps)

    async def repetition(self, profile: Path | None = None) -> None:
        for store in self.args.only:
            if self.args.limits and profile is None:
                await self.limits_cell(store)
            if self.args.limits_only:
                continue
            for c in (1, 32):
                for mode in MODES:
                    await self.latency_cell(store, mode, c, profile)
            for mode in MODES:
                await self.ttfb_cell(store, mode, profile)
            if self.args.workers > 1 and profile is None:
                await self.workers_cell(store)
        if self.args.compare_loops and profile is None:
            for c in (1, 32):
                await self.loop_cell(c)


async def rotated(gw: Proc, helpers: list[int], orders: list[list[str]], rounds: int,
                  warm: int = 0) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """c=1 same-run calls of `LIMIT_VARIANTS` on one connection, round after round in the
    orders given (round i: orders[i % len]): each name's latencies (ms) and the CPU (us) the
    gateway's serving thread and `helpers` spent on each, from the `warm`-th round on."""
    names = sorted({name for order in orders for name in order})
    ids = {name: run_ids("same run", i) for i, name in enumerate(names)}
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    conn = await RawConnection.open(gw.url)
    clock = CpuClock(gateway_pids(gw) + helpers)
    try:
        for round_ in range(warm + rounds):
            # A call's CPU carries a little of the call before it (background writes, the
            # allocator): orders that make each name follow each other equally often cancel
            # that share out of the differences.
            for name in orders[round_ % len(orders)]:
                key, body = LIMIT_VARIANTS[name]
                head = request_head("/v1/chat/completions", body, next(ids[name]), key)
                cpu_before = clock()
                started = time.perf_counter()
                status = await conn.post(head, body)
                elapsed = time.perf_counter() - started
                cpu_spent = clock() - cpu_before
                if status != 200:
                    raise RuntimeError(f"{gw.url} answered {status} ({name})")
                if round_ >= warm:
                    times[name].append(elapsed * 1000)
                    cpu[name].append(cpu_spent / 1000)
    finally:
        conn.close()
        clock.close()
    return times, cpu


class sampling:
    """py-spy sampling the gateway's process(es) while a cell runs (when profiling)."""

    def __init__(self, gw: Proc, folder: Path | None, name: str) -> None:
        self.gw, self.folder, self.name = gw, folder, name.replace(" ", "_")
        self.spies: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> None:
        if self.folder is None:
            return
        for pid in gateway_pids(self.gw):
            out = self.folder / f"{self.name}-{pid}.txt"
            self.spies.append(subprocess.Popen(
                [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                 "--rate", "250", "--format", "raw", "--nonblocking", "-o", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches asynchronously; there is no readiness signal to wait for

    def __exit__(self, *exc: object) -> None:
        for spy in self.spies:
            spy.send_signal(signal.SIGINT)
        for spy in self.spies:
            spy.wait(timeout=30)


def gateway_pids(gw: Proc) -> list[int]:
    """The gateway's serving processes: itself, or its workers."""
    children = Path(f"/proc/{gw.popen.pid}/task/{gw.popen.pid}/children")
    kids = [int(p) for p in children.read_text().split()] if children.exists() else []
    return kids or [gw.popen.pid]


IDLE = ("select (selectors", "EpollSelector.select (selectors", "_run_once (asyncio", "run_forever", "epoll",
        "run (gateway/server/http/listener", "Condition.wait (threading")
"""Leaf frames of a process (or thread) that is waiting, not working."""


OUTERMOST = ("gateway/cli.py)", "gateway/__main__.py)", "gateway/server/main.py)", "gateway/server/http/listener.py)")
"""Frames every sample of the server holds (its start-up and loop), left out of the ranking."""


def busy_stacks(folder: Path, name: str) -> Iterator[tuple[list[str], int]]:
    """(frames, samples) of a cell's raw py-spy stacks, idle ones left out."""
    for path in folder.glob(f"{name.replace(' ', '_')}-*.txt"):
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if count.isdigit() and frames and not frames[-1].startswith(IDLE):
                yield frames, int(count)


def top_entries(folder: Path, name: str, n: int = 15) -> list[tuple[str, float]]:
    """The functions with the most own samples (leaf frames) in a cell's raw stacks, as %."""
    own: Counter[str] = Counter()
    for frames, count in busy_stacks(folder, name):
        own[frames[-1]] += count
    total = sum(own.values())
    return [(fn, 100.0 * k / max(1, total)) for fn, k in own.most_common(n)]


def summary(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:7.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{med:7.2f}"


def williams(n: int) -> list[list[int]]:
    """A Williams design for an even `n`: n orders of 0..n-1 in which each item comes right after
    each other item exactly once (first order 0, 1, n-1, 2, n-2, ...; each next one shifted by 1)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    return [[(x + shift) % n for x in first] for shift in range(n)]


def verdicts(cells: dict[str, Cell], workers: int) -> list[tuple[str, bool, str]]:
    out = []
    for name, cell in cells.items():
        f = {k: statistics.median(v) for k, v in cell.figures.items()}
        store, mode = name.split()[0], " ".join(name.split()[1:3])
        if "c=1 " in name and "x floor" in f and mode in ("same run", "new run"):
            limit = 1.5 if store == "sqlite" else 2.0
            out.append((f"{name} added latency <= {limit}x floor", f["x floor"] <= limit, f"{f['x floor']:.2f}"))
        if "c=32" in name and "req/s x floor" in f:
            out.append((f"{name} req/s >= 0.7x floor", f["req/s x floor"] >= 0.7, f"{f['req/s x floor']:.2f}"))
        if "floor + ms" in f:
            out.append((f"{name} <= floor + 0.5 ms", f["floor + ms"] <= 0.5, f"+{f['floor + ms']:.2f} ms"))
        if "both +ms" in f:
            out.append((f"{name} limits and route selection <= +0.05 ms p50", f["both +ms"] <= 0.05,
                        f"{f['both +ms']:+.3f} ms (paired {f['both paired +ms']:+.3f} ms)"))
            out.append((f"{name} limits and route selection <= +50 us CPU per call", f["both cpu +us"] <= 50,
                        f"{f['both cpu +us']:+.1f} us of {f['off cpu us']:.0f} us"))
        if "req/s x 1 worker" in f:
            out.append((f"{name} >= 1.6x one worker", f["req/s x 1 worker"] >= 1.6, f"{f['req/s x 1 worker']:.2f}"))
    return out


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        folder = Path(tmp)
        up_port, proxy_port = free_port(), free_port()
        procs: list[Proc] = []
        redis_proc: subprocess.Popen[bytes] | None = None
        cluster = None
        try:
            procs.append(upstream := start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port,
                                                   folder / "upstream.log"))
            up_url = upstream.url + "/v1"
            procs.append(proxy := start_proxy(proxy_port, up_url, folder / "proxy.log"))
            store_dir = Path(tempfile.mkdtemp(prefix="gw-bench-store-", dir=args.store_dir)) if args.store_dir else None
            stores: dict[str, dict[str, Any] | None] = {}
            helpers: dict[str, list[int]] = {}
            if "sqlite" in args.only:
                stores["sqlite"] = None
            if "redis" in args.only:
                exe = shutil.which("redis-server")
                if exe is None:
                    raise SystemExit("redis-server is not installed (scripts/install-test-deps.sh)")
                redis_proc, redis_port = _start_redis(exe, folder)
                helpers["redis"] = [redis_proc.pid]
                stores["redis"] = {"kind": "redis", "url": f"redis://127.0.0.1:{redis_port}/0", "prefix": "bench:"}
            if "postgres" in args.only:
                from tests.support.postgres import Cluster

                cluster = Cluster()  # durable, as a production database: every commit waits for its flush
                cluster.settings = "-c fsync=on -c synchronous_commit=on -c max_connections=200"
                cluster.start()
                helpers["postgres"] = []  # its backends are many and come and go: not sampled
                stores["postgres"] = {"kind": "postgres", "dsn": cluster.dsn}
            variants: list[tuple[str, str, list[str]]] = []
            for store in stores:
                variants.append((store, store, ["--loop", args.loop]))
                if args.workers > 1:
                    variants.append((f"{store}-w{args.workers}", store, ["--loop", args.loop,
                                                                          "--workers", str(args.workers)]))
            if args.compare_loops:
                variants += [("sqlite-asyncio", "sqlite", ["--loop", "asyncio"]),
                             ("sqlite-uvloop", "sqlite", ["--loop", "uvloop"])]
            gateways: dict[str, Proc] = {}
            for name, store, extra in variants:
                port = free_port()
                sub = folder / name
                spec = stores.get(store)
                if spec is not None and spec["kind"] == "redis":
                    spec = {**spec, "prefix": f"bench-{name}:"}
                elif spec is not None:
                    spec = {**spec, "schema": "bench_" + name.replace("-", "_")}
                config = gateway_config(sub, port, up_url, not args.no_team_budget, store_dir and store_dir / name,
                                        spec, limits=args.limits)
                if store_dir is not None:
                    (store_dir / name).mkdir(exist_ok=True)
                procs.append(gw := start_gateway(["serve", "--config", str(config), *extra], "/healthz", port,
                                                 sub / "gateway.log", timeout=180))
                gateways[name] = gw
            bench = Bench(args, upstream, proxy, gateways, helpers=helpers)
            if args.profile:
                out = Path(args.profile)
                out.mkdir(parents=True, exist_ok=True)
                await bench.repetition(profile=out)
                print_profiles(out, args)
                return 0
            for i in range(args.repeat):
                await bench.repetition()
                print(f"repetition {i + 1}/{args.repeat} done", file=sys.stderr, flush=True)
            rss = {name: [rss_mb(pid) for pid in gateway_pids(gw)] for name, gw in gateways.items()}
        finally:
            for p in reversed(procs):
                p.stop()
            if redis_proc is not None:
                redis_proc.kill()
                redis_proc.wait()
            if cluster is not None:
                cluster.remove()
    print_matrix(bench, args)
    print("\nresident memory after the load (current / peak MB, per serving process):")
    for name, figures in rss.items():
        print(f"  {name:<16} " + ", ".join(f"{now:.0f} / {peak:.0f}" for now, peak in figures))
    return 0


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def gateway_share(folder: Path, name: str, n: int = 12) -> list[tuple[str, float]]:
    """The gateway's own functions by inclusive time (% of busy samples whose stack holds them)."""
    seen: Counter[str] = Counter()
    total = 0
    for frames, count in busy_stacks(folder, name):
        total += count
        names = {f.rsplit(":", 1)[0] + ")" for f in frames if "(gateway/" in f}
        for fn in names:
            if not fn.endswith(OUTERMOST):
                seen[fn] += count
    return [(fn, 100.0 * k / max(1, total)) for fn, k in seen.most_common(n)]


def print_profiles(folder: Path, args: argparse.Namespace) -> None:
    for store in args.only:
        for name in [f"{store}-{m}-c{c}" for c in (1, 32) for m in MODES] + [f"{store}-{m}-stream" for m in MODES]:
            print(f"\n## {name}: top own time (% of the gateway's busy samples)")
            for fn, pct in top_entries(folder, name):
                print(f"{pct:6.1f}%  {fn}")
            print(f"-- {name}: the gateway's functions by inclusive time")
            for fn, pct in gateway_share(folder, name):
                print(f"{pct:6.1f}%  {fn}")


def print_matrix(bench: Bench, args: argparse.Namespace) -> None:
    print(f"non-streamed chat completions, {args.requests} per cell at c=1 ({2 * args.requests} at c=32), "
          f"{args.streams} streams per TTFB cell, {args.repeat} repetitions (median [min-max]); team budget "
          f"{'off' if args.no_team_budget else 'on'}; --loop {args.loop}; {os.cpu_count()} CPUs shared by every "
          "process here (and whatever else runs on the machine)")
    for name, cell in bench.cells.items():
        parts = [f"{k} {summary(v)}" for k, v in cell.figures.items()]
        print(f"{name:<24} " + " | ".join(parts))
    print("\ntargets:")
    for what, ok, value in verdicts(bench.cells, args.workers):
        print(f"  {'met    ' if ok else 'NOT met'} {what}: {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1000, help="measured calls per cell at c=1 (twice at c=32)")
    parser.add_argument("--streams", type=int, default=40, help="streams per TTFB cell")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of the whole matrix")
    parser.add_argument("--quick", action="store_true", help="for iteration: 300 calls, 15 streams, one repetition")
    parser.add_argument("--only", action="append", choices=STORES, help="stores to measure (default both)")
    parser.add_argument("--workers", type=int, default=1, help="also measure a gateway with this many workers")
    parser.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto", help="the gateways' loop")
    parser.add_argument("--compare-loops", action="store_true", help="also measure asyncio vs uvloop")
    parser.add_argument("--limits", action="store_true", help="also measure rate limits and route selection "
                        "on vs off (issue 15)")
    parser.add_argument("--limits-only", action="store_true", help="measure only the --limits cell")
    parser.add_argument("--profile", help="folder: sample each cell once with py-spy and print the top functions")
    parser.add_argument("--no-team-budget", action="store_true", help="a team without a budget")
    parser.add_argument("--store-dir", help="folder for the SQLite files (e.g. /dev/shm); default: the temp folder")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.streams, args.repeat = 300, 15, 1
    args.only = args.only or list(STORES)
    args.limits = args.limits or args.limits_only
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
