"""The reload watch through a store outage (gateway.server.reload_watch): two real replicas on
a real redis-server that the test stops for several poll periods and starts again (same port,
append-only file). Each replica logs once that it cannot read the reload mark and once that
it can again, keeps serving, and a reload on A afterwards still reaches B."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp

from gateway.server.reload_watch import RELOAD_POLL_S
from tests.faults.support import RedisProc
from tests.server.test_reload_replicas import Replica, log_says, new_key, reload, serves, status
from tests.support.procs import free_port

DOWN = "reload watch: cannot read the store's reload mark"
BACK = "reload watch: the store's reload mark can be read again"


async def test_the_watch_outlives_a_store_outage_and_logs_once_each_way(redis_proc: RedisProc,
                                                                         session: aiohttp.ClientSession,
                                                                         tmp_path: Path) -> None:
    store = {"kind": "redis", "url": redis_proc.url, "prefix": "outage:", "timeout_s": 0.5}
    replicas = [Replica(tmp_path / name, free_port(), store) for name in ("a", "b")]
    try:
        for r in replicas:
            r.start()
        a, b = replicas
        redis_proc.stop()
        for r in replicas:
            await log_says(r, DOWN, r.workers)
        time.sleep(3 * RELOAD_POLL_S)  # the outage lasts several polls: the condition under test, not a wait
        redis_proc.start()
        for r in replicas:
            await log_says(r, BACK, r.workers)
            assert r.log().count(DOWN) == r.workers  # once per process, however many polls failed
            assert r.proc is not None and r.proc.popen.poll() is None

        key = new_key()
        for r in replicas:
            r.write((key,))
        assert await status(session, b, key) == 401
        code, body = await reload(session, a)
        assert code == 200, body
        await serves(session, b, key)
    finally:
        for r in replicas:
            if r.proc is not None:
                r.proc.stop()
