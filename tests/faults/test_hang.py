"""No hung call on the Redis store: server-side runs at concurrency 16, each answered.

The run's background work (the cancel watcher polling Redis, the lease keeper) once
held the answer back: cancelling a task that awaits redis-py can be swallowed, and the
driver awaited those tasks without a deadline. A call that takes longer than
`CALL_TIMEOUT_S` (a run takes ~0.1 s) counts as hung and fails the test.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp

from tests.faults.support import FILES_HEADERS, RedisProc, chat, serve

# The hang this guards against struck 10 of 800 calls: 400 calls miss it with a chance
# of (1 - 10/800)^400 < 1%.
CALLS = int(os.environ.get("GATEWAY_HANG_CALLS", "400"))
CONCURRENCY = 16
CALL_TIMEOUT_S = 20.0


async def test_server_side_calls_on_redis_never_hang(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    # Without the append-only file: with `appendfsync always` a busy disk (the rest of the
    # suite) froze the server for over the 2 s store deadline now and then, and a call was
    # answered 503 store_unavailable, rightly: a store stall is not the hang this is about.
    # For the same reason the store's deadline is 10 s (still well under CALL_TIMEOUT_S): on
    # a machine at load 20 a Redis round trip passed the default 2 s without any disk.
    redis_proc = RedisProc(tmp_path / "redis", appendonly=False)
    redis_proc.start()
    gw = serve(tmp_path / "gw", {"kind": "redis", "url": redis_proc.url, "timeout_s": 10})
    try:
        queue = iter(range(CALLS))
        statuses: dict[int, int] = {}
        hung: list[int] = []

        async def worker() -> None:
            for i in queue:
                try:
                    status, _, body = await chat(session, gw.url, headers=FILES_HEADERS, timeout_s=CALL_TIMEOUT_S)
                except TimeoutError:
                    hung.append(i)
                    continue
                statuses[status] = statuses.get(status, 0) + 1
                assert status == 200, body

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        print(f"\n{CALLS} calls at c={CONCURRENCY}: {len(hung)} hung, statuses {statuses}")
        assert hung == [], f"{len(hung)} of {CALLS} calls hung past {CALL_TIMEOUT_S}s"
        assert statuses == {200: CALLS}
    finally:
        gw.stop()
        redis_proc.stop()
