"""GET /livez, /readyz and /healthz of a real gateway process, and readiness during a drain.

A gateway on SQLite in front of an upstream served by this test (which can hold its
answer). Ready, every check passes and `gateway_ready{check}` is 1. On SIGTERM readiness
fails first: while a call in flight holds the process up, its `/metrics` (on a listener of
its own, `metrics.listen`, which closes last) shows `gateway_ready{check="draining"} 0`,
and the call is still answered. The full-disk case (store and spool checks failing, and
recovering) is tests/faults/test_full_disk.py.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.server.test_admission import KEY, TASK, Upstream, chat, write_config
from tests.server.test_admission import upstream  # noqa: F401  (its module-scoped counting upstream)
from tests.support.procs import Proc, free_port, start_gateway


def start(folder: Path, upstream_url: str, metrics_port: int | None = None) -> Proc:
    port = free_port()
    path = write_config(folder, port, upstream_url, {"kind": "sqlite", "path": "./gateway.db"})
    if metrics_port is not None:
        config = yaml.safe_load(path.read_text())
        config["metrics"] = {"listen": f"127.0.0.1:{metrics_port}"}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return start_gateway(["serve", "--config", str(path)], "/livez", port, folder / "gateway.log")


def gauge(text: str, check: str) -> float | None:
    found = re.search(rf'^gateway_ready\{{check="{check}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else None


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_a_ready_gateway_passes_every_probe(tmp_path: Path, upstream: Upstream) -> None:
    gw = start(tmp_path / "gw", upstream.url)
    try:
        async with aiohttp.ClientSession() as session:
            assert await get(session, f"{gw.url}/livez") == (200, {"status": "alive"})
            status, body = await get(session, f"{gw.url}/readyz")
            assert status == 200 and body == {"status": "ready", "checks": {
                "draining": {"ok": True}, "store": {"ok": True}, "spool": {"ok": True}, "policies": {"ok": True},
                "mcp": {"ok": True}}}, body
            assert await get(session, f"{gw.url}/healthz") == (status, body)
            async with session.get(f"{gw.url}/metrics") as resp:
                text = await resp.text()
        assert [gauge(text, c) for c in ("draining", "store", "spool")] == [1.0, 1.0, 1.0], text
        spool = tmp_path / "gw" / "spool.jsonl"
        assert spool.stat().st_size == 0 and spool.stat().st_blocks * 512 >= 64 * 1024 * 1024  # its reserve
    finally:
        gw.stop()


async def test_a_sigterm_fails_readiness_first(tmp_path: Path, upstream: Upstream) -> None:
    metrics_port = free_port()
    gw = start(tmp_path / "gw", upstream.url, metrics_port)
    upstream.held.add("drain")
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(chat(session, gw, KEY, {"model": "drain", "messages": TASK}))
            deadline = time.monotonic() + 30
            while upstream.calls["drain"] == 0:  # the call is in flight: it holds the process up
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            gw.popen.send_signal(signal.SIGTERM)
            seen: float | None = 1.0
            while seen != 0.0:
                assert time.monotonic() < deadline, "readiness did not fail during the drain"
                async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                    seen = gauge(await resp.text(), "draining")
                await asyncio.sleep(0.02)  # polling the scrape
            upstream.held.discard("drain")
            status, _, reply = await call
        assert status == 200, reply  # the call in flight is answered all the same
        assert gw.popen.wait(30) == 0
    finally:
        upstream.held.discard("drain")
        gw.stop()
