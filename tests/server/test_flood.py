"""A team's flood beside a quiet team, through a real gateway: the fair share is at work.

One gateway (SQLite, `server.work_slots: 1`, so that the flood must queue) in front of an
upstream served by this test. Three calls of the `thrifty` team in flight (their upstream
holds them), then 40 calls of the `adm` team at once: every call is answered and reached the upstream once, and the flood's
calls waited for a slot of the process's own work (`gateway_work_waits_total{team="adm"}`).
Which call goes first is tests/server/test_fair_share.py's (no timing
here); how much a flood slows a quiet team, benchmarks/team_flood.py's.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import yaml

from tests.server.test_admission import KEY, TASK, THRIFTY, Upstream, chat, write_config
from tests.server.test_admission import upstream  # noqa: F401  (its module-scoped counting upstream)
from tests.support.procs import Proc, free_port, start_gateway

FLOOD = 40


def start(folder: Path, upstream_url: str) -> Proc:
    port = free_port()
    path = write_config(folder, port, upstream_url, {"kind": "sqlite", "path": "./gateway.db"})
    config = yaml.safe_load(path.read_text())
    config["server"]["work_slots"] = 1
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return start_gateway(["serve", "--config", str(path)], "/livez", port, folder / "gateway.log")


async def test_a_flood_waits_for_its_share_and_every_call_is_answered(tmp_path: Path, upstream: Upstream) -> None:
    gw = start(tmp_path / "gw", upstream.url)
    upstream.delay_s["flood"] = upstream.delay_s["quiet"] = 0.0
    try:
        upstream.held.add("quiet")  # the quiet team's calls stay in flight: two teams share the process
        async with aiohttp.ClientSession() as session:
            quiet = [asyncio.ensure_future(chat(session, gw, THRIFTY, {"model": "quiet", "messages": TASK,
                                                                       "max_tokens": 5})) for _ in range(3)]
            while upstream.calls["quiet"] < 3:
                await asyncio.sleep(0.01)  # polling: the quiet calls are forwarded
            flood = await asyncio.gather(*(chat(session, gw, KEY, {"model": "flood", "messages": TASK})
                                           for _ in range(FLOOD)))
            upstream.held.discard("quiet")
            results = [*flood, *await asyncio.gather(*quiet)]
            async with session.get(f"{gw.url}/metrics") as resp:
                metrics = await resp.text()
        assert [status for status, _, _ in results] == [200] * (FLOOD + 3), [r for r in results if r[0] != 200]
        waited = re.search(r'^gateway_work_waits_total\{team="adm"\} (\S+)$', metrics, re.MULTILINE)
        assert waited is not None and float(waited.group(1)) > 0, metrics
        assert upstream.calls["flood"] == FLOOD and upstream.calls["quiet"] == 3
    finally:
        upstream.held.discard("quiet")
        gw.stop()
