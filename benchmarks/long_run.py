"""A long run's turns cost the same at the end as at the start (issue 34, item 6).

A server-side run of `--turns` turns (200), each adding what a tool-using turn adds to the
transcript: the model's call and a `--kb` KB (100) tool result, and its usage. Each turn is
saved as the driver saves it (`Store.commit_turn` with its trace line), on each store: the
in-memory one, a SQLite file in a temp folder and, when `redis-server` is installed, a
throwaway Redis server. Per turn it measures the store step's time and the bytes it wrote:
SQLite, the growth of its WAL (the checkpointer is held off for the run, so the WAL keeps
every frame written; `sqlite*` is a second run with checkpoints, as a gateway runs, for its
time); Redis, the bytes the server read from the client (`INFO stats`
`total_net_input_bytes`). A load of the whole run at the end checks it is all there.

Every turn's tool result is exactly `--kb` KB (before 2026-12-06 the first 10 turns' were
12% smaller, "line 0 " being shorter than "line 10 ", which made up most of the growth in
bytes the ratios showed). It prints, per store, the median time and bytes of the first 10
turns and of the last 10, and their ratio (last / first): flat is ~1; and the size of the
head (`RunState.head_json`, what every save rewrites) after turn 10 and after the last.
Before the transcript was stored beside the run's head, every turn rewrote the whole run, and both grew with the run (ratios of ~40
for bytes at 200 turns). It also prints this process's resident memory before, after the
runs, and once they are dropped.

`--passthrough-mb N` measures instead a real gateway (SQLite) serving a pass-through run of
20 calls whose prompt is N MB, from an upstream served here: its resident memory before,
after the run, and once the run left its run cache (60 s later), and the first and last
calls' times.

Run: `.venv/bin/python benchmarks/long_run.py [--turns 200] [--kb 100] [--stores memory,sqlite,redis]`
or `.venv/bin/python benchmarks/long_run.py --passthrough-mb 3`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from gateway.harness.state import RunState  # noqa: E402
from gateway.harness.usage import Usage  # noqa: E402
from gateway.store.base import Store  # noqa: E402
from gateway.store.memory import MemoryStore  # noqa: E402
from gateway.store import sqlite_wal  # noqa: E402
from gateway.store.sqlite import SqliteStore  # noqa: E402

EDGE = 10
"""Turns compared at each end of the run."""


def rss_mb() -> float:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def a_turn(run: RunState, i: int, kb: int) -> None:
    """What one tool-using turn adds to a run: the model's call, the tool's result, the usage."""
    call = f"call_{i:04d}"
    run.messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call, "type": "function", "function": {"name": "read_file", "arguments": f'{{"path": "f{i}.log"}}'}}]})
    run.model_call_ids.append(call)
    run.messages.append({"role": "tool", "tool_call_id": call, "name": "read_file",
                         "content": (f"line {i} " * (kb * 1024 // 7 + 1))[:kb * 1024]})  # "line 0 ": 7 chars
    run.count_turn(Usage(1000 + i * kb * 256, 40), 0.001)
    run.tool_calls += 1


async def measure(store: Store, written: Callable[[], Awaitable[int]], turns: int, kb: int,
                  run_id: str) -> tuple[list[float], list[int], list[int]]:
    run = RunState.new("scripted-plan", [{"role": "user", "content": "scan the logs"}], run_id=run_id,
                       team="bench", policy="files")
    await store.create_run(run)
    times, sizes, heads = [], [], []
    for i in range(turns):
        a_turn(run, i, kb)
        before = await written()
        started = time.perf_counter()
        await store.commit_turn(run, [{"type": "turn", "runId": run_id, "turn": i + 1}])
        times.append(time.perf_counter() - started)
        sizes.append(await written() - before)
        heads.append(len(orjson.dumps(run.head_json())))  # the head just stored
    loaded = await store.load_run(run_id)
    assert loaded is not None and loaded.to_json() == run.to_json(), "the stored run is not the run"
    return times, sizes, heads


def report(name: str, times: list[float], sizes: list[int] | None, heads: list[int] | None = None) -> None:
    first_t, last_t = statistics.median(times[:EDGE]), statistics.median(times[-EDGE:])
    line = (f"{name:7s} time/turn: first {EDGE} {first_t * 1000:7.3f} ms, last {EDGE} {last_t * 1000:7.3f} ms, "
            f"ratio {last_t / first_t:5.2f}")
    if sizes is not None:
        first_b, last_b = statistics.median(sizes[:EDGE]), statistics.median(sizes[-EDGE:])
        line += (f" | bytes/turn: first {first_b / 1024:8.1f} KB, last {last_b / 1024:8.1f} KB, "
                 f"ratio {last_b / max(first_b, 1):5.2f}")
    if heads is not None:
        line += f" | head: turn {EDGE} {heads[EDGE - 1]} B, turn {len(heads)} {heads[-1]} B"
    print(line, flush=True)


async def bench_memory(args: argparse.Namespace) -> None:
    async def nothing() -> int:
        return 0

    store = MemoryStore()
    times, _, heads = await measure(store, nothing, args.turns, args.kb, "bench/memory")
    report("memory", times, None, heads)
    await store.close()


async def bench_sqlite(args: argparse.Namespace) -> None:
    """Twice: with the WAL's checkpoints held off, so that the WAL keeps every frame each turn
    wrote (its growth is the turn's bytes), then as a gateway runs it (time only)."""
    for held in (True, False):
        folder = Path(tempfile.mkdtemp(prefix="gw-long-run-"))
        fence = sqlite_wal.FENCE_FRAMES
        try:
            if held:
                sqlite_wal.FENCE_FRAMES = 1 << 40
            store = SqliteStore(folder / "gateway.db")
            if held:
                store._wal.interval_s = 3600.0
            wal = folder / "gateway.db-wal"
            largest = [0]

            async def wal_size() -> int:
                size = wal.stat().st_size if wal.exists() else 0
                largest[0] = max(largest[0], size)
                return size

            times, sizes, _ = await measure(store, wal_size, args.turns, args.kb, "bench/sqlite")
            report("sqlite" if held else "sqlite*", times, sizes if held else None)
            if not held:
                print(f"sqlite* WAL: largest {largest[0] / 2**20:.1f} MiB after a turn "
                      f"(bound {sqlite_wal.FENCE_FRAMES * sqlite_wal.PAGE_BYTES / 2**20:.0f} MiB), "
                      f"{args.turns * args.kb / 1024:.1f} MiB of transcript written", flush=True)
            await store.close()
        finally:
            sqlite_wal.FENCE_FRAMES = fence
            shutil.rmtree(folder, ignore_errors=True)


async def bench_redis(args: argparse.Namespace) -> None:
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis   skipped: redis-server is not installed", flush=True)
        return
    import redis.asyncio as aioredis

    from gateway.store.redis import RedisStore
    from tests.support.procs import free_port

    folder = Path(tempfile.mkdtemp(prefix="gw-long-run-redis-"))
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = aioredis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                await client.ping()
                break
            except (ConnectionError, OSError, aioredis.ConnectionError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)  # readiness poll of the server this benchmark started

        async def net_in() -> int:
            return int((await client.info("stats"))["total_net_input_bytes"])

        store = RedisStore(url, "bench:", timeout_s=30.0)
        times, sizes, _ = await measure(store, net_in, args.turns, args.kb, "bench/redis")
        # net_in's own INFO command is in each figure: the same few dozen bytes every turn
        report("redis", times, sizes)
        await store.close()
    finally:
        await client.aclose()
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def bench_passthrough(megabytes: float) -> int:
    import aiohttp
    import yaml
    from aiohttp import web

    from tests.support.procs import free_port, start_gateway
    from tests.support.upstreams import in_thread

    def upstream() -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({
                "id": "c", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1000, "completion_tokens": 5, "total_tokens": 1005}})

        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/chat/completions", answer)
        return app

    folder = Path(tempfile.mkdtemp(prefix="gw-long-run-pt-"))
    try:
        with in_thread(upstream) as root:
            port = free_port()
            config = {"server": {"host": "127.0.0.1", "port": port, "max_body_bytes": 256 * 2**20},
                      "store": {"kind": "sqlite", "path": "./gateway.db"}, "policies_dir": str(ROOT / "policies"),
                      "upstreams": [{"name": "u", "kind": "openai", "base_url": root + "/v1"}],
                      "models": [{"match": "*", "upstream": "u", "price_in": 2.0, "price_out": 12.0}],
                      "teams": [{"name": "t", "keys": ["sk-t"], "budget_usd": None, "policies": ["passthrough"]}]}
            (folder / "config.yaml").write_text(yaml.safe_dump(config))
            gw = start_gateway(["serve", "--config", str(folder / "config.yaml")], "/v1/models", port,
                               folder / "gateway.log", fresh=True)
            pid = gw.popen.pid
            try:
                async with aiohttp.ClientSession() as session:
                    messages: list[dict[str, str]] = [{"role": "user", "content": "x" * int(megabytes * 2**20)}]
                    before, times = proc_rss_mb(pid), []
                    for i in range(20):
                        started = time.perf_counter()
                        async with session.post(f"{gw.url}/v1/chat/completions", headers={
                                "Authorization": "Bearer sk-t", "X-Run-Id": "big"},
                                data=orjson.dumps({"model": "m", "messages": messages})) as resp:
                            assert resp.status == 200, await resp.text()
                            await resp.read()
                        times.append(time.perf_counter() - started)
                        messages = [*messages, {"role": "assistant", "content": "ok"},
                                    {"role": "user", "content": f"and {i}?"}]
                    after = proc_rss_mb(pid)
                    await asyncio.sleep(65)  # the run cache keeps a run 60 s: what stays after is the heap's
                    later = proc_rss_mb(pid)
            finally:
                gw.stop()
        print(f"pass-through, {megabytes:g} MB prompt, 20 calls: gateway RSS {before:.0f} MB before, {after:.0f} MB "
              f"after, {later:.0f} MB 65 s later; call {times[0] * 1000:.0f} ms first, {times[-1] * 1000:.0f} ms last")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


async def main_async(args: argparse.Namespace) -> int:
    if args.passthrough_mb:
        return await bench_passthrough(args.passthrough_mb)
    print(f"{args.turns} turns, {args.kb} KB added per turn ({args.turns * args.kb / 1024:.0f} MB of transcript)",
          flush=True)
    before = rss_mb()
    benches = {"memory": bench_memory, "sqlite": bench_sqlite, "redis": bench_redis}
    for name in args.stores.split(","):
        await benches[name](args)
    after = rss_mb()
    gc.collect()
    print(f"RSS: {before:.0f} MB before, {after:.0f} MB after the runs, {rss_mb():.0f} MB once they are dropped",
          flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--kb", type=int, default=100)
    parser.add_argument("--stores", default="memory,sqlite,redis")
    parser.add_argument("--passthrough-mb", type=float, default=0.0)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
