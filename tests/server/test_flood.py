"""A team's flood beside a quiet team, through a real gateway: the fair share is at work.

One gateway (SQLite, `server.work_slots: 1`, so that the flood must queue) in front of an
upstream served by this test. Three calls of the `thrifty` team in flight (their upstream
holds them), then 40 calls of the `adm` team at once: every call is answered and reached the upstream once, and the flood's
calls waited for a slot of the process's own work (`gateway_work_waits_total{team="adm"}`).
And a client that stops reading a stream whose rest is written after its booking does not
keep its team's slot: the team's next call is answered meanwhile.
Which call goes first is tests/server/test_fair_share.py's (no timing
here); how much a flood slows a quiet team, benchmarks/team_flood.py's.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web

from tests.server.test_admission import KEY, TASK, THRIFTY, Upstream, chat, write_config
from tests.server.test_admission import upstream  # noqa: F401  (its module-scoped counting upstream)
from tests.support.procs import Proc, free_port, start_gateway
from tests.support.upstreams import serving

FLOOD = 40


def start(folder: Path, upstream_url: str, tool_repair: bool = False) -> Proc:
    port = free_port()
    path = write_config(folder, port, upstream_url, {"kind": "sqlite", "path": "./gateway.db"})
    config = yaml.safe_load(path.read_text())
    config["server"]["work_slots"] = 1
    config["upstreams"][0]["tool_repair"] = tool_repair
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # One process whatever GATEWAY_TEST_WORKERS says: the share is each process's own.
    return start_gateway(["serve", "--config", str(path), "--workers", "1"], "/livez", port, folder / "gateway.log")


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


TAIL_CHUNKS = 128
"""64 KiB of the stalled answer each: 8 MiB written after its booking, more than the kernel
buffers between the gateway and a client that reads nothing."""


@dataclass
class TailUpstream:
    """`stalled`: a stream whose answer starts with `{` (held by the tool repair until the
    turn is booked, then written whole); `quiet`: answered once `release` is set; any other
    model at once."""

    url: str = ""
    calls: Counter[str] = field(default_factory=Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body["model"]
        self.calls[model] += 1
        usage = {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18}
        if model == "quiet":
            await self.release.wait()
        if model != "stalled":
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": model,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "ok"}}],
                                      "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        await response.write(event({"role": "assistant", "content": "{"}))
        for _ in range(TAIL_CHUNKS):
            await response.write(event({"content": "a" * 65536}))
        await response.write(event({}, "stop"))
        await response.write(b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                       "model": model, "choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def stalled_stream(gw: Proc, key: str, body: dict[str, Any]) -> tuple[socket.socket, asyncio.StreamWriter]:
    """A streamed call sent by a client that then reads nothing (a receive buffer of a few KiB)."""
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    _, writer = await asyncio.open_connection(sock=sock)
    raw = orjson.dumps(body)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    await writer.drain()
    return sock, writer


async def test_a_client_that_stops_reading_after_its_booking_holds_no_slot(tmp_path: Path) -> None:
    """A streamed answer's rest written after its turn is booked (here: the tool repair's
    held text, 8 MiB) to a client that reads nothing: the booking's slot is given back as
    soon as the turn is booked, so the team's next call, beside another team's call in
    flight, is answered while that write still waits."""
    tail = TailUpstream()
    async with serving(tail.handle) as url:
        gw = start(tmp_path / "gw", url, tool_repair=True)
        writer: asyncio.StreamWriter | None = None
        try:
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            _, writer = await stalled_stream(gw, KEY, {"model": "stalled", "messages": TASK, "stream": True,
                                                       "tools": tools})
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 30
                while not re.search(r'^gateway_turns_total\{[^}]*team="adm"\} 1', await metrics_text(session, gw), re.M):
                    assert time.monotonic() < deadline, "the stalled stream's turn was never booked"
                    await asyncio.sleep(0.05)  # polling: the turn is booked, its rest being written
                quiet = asyncio.ensure_future(chat(session, gw, THRIFTY, {"model": "quiet", "messages": TASK,
                                                                          "max_tokens": 5}))
                while tail.calls["quiet"] < 1:
                    await asyncio.sleep(0.01)  # polling: another team's call in flight, the process shared
                status, _, reply = await asyncio.wait_for(
                    chat(session, gw, KEY, {"model": "next", "messages": TASK}), 20)
                assert status == 200 and reply["run"]["turns"] == 1, reply
                tail.release.set()
                assert (await quiet)[0] == 200
        finally:
            tail.release.set()
            if writer is not None:
                writer.close()
            gw.stop()


async def metrics_text(session: aiohttp.ClientSession, gw: Proc) -> str:
    async with session.get(f"{gw.url}/metrics") as resp:
        return await resp.text()
