"""A gateway asked to stop (SIGTERM) ends its endless streams (the console inbox, a
followed run's trace) at once, instead of waiting for a client that may never write
again: aiohttp's graceful shutdown waits for open requests up to a minute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.server.served import DEMO, OPS, Served, chat_body, poll, request
from tests.server.test_console_http import sign_in

STOPS_WITHIN_S = 5.0
"""aiohttp's shutdown timeout is 60 s; the SSE keepalive comes every 15 s."""


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Served]:
    served = Served.start(tmp_path)
    try:
        yield served
    finally:
        served.proc.stop()


async def _stop_while(served: Served, response: aiohttp.ClientResponse) -> tuple[float, bytes]:
    """SIGTERM the gateway while `response` streams; the seconds it took to exit, and what
    the stream carried until it ended."""
    started = time.monotonic()
    served.proc.popen.terminate()
    body = await asyncio.wait_for(response.content.read(), STOPS_WITHIN_S * 4)
    await asyncio.get_running_loop().run_in_executor(None, served.proc.popen.wait, STOPS_WITHIN_S * 4)
    return time.monotonic() - started, body


async def test_an_open_console_inbox_does_not_hold_the_shutdown(gateway: Served) -> None:
    client, _ = await sign_in(gateway, OPS)
    async with client:
        async with client.get(f"{gateway.url}/console/api/inbox/events") as response:
            assert response.status == 200
            assert b"event: snapshot" in await response.content.readuntil(b"\n\n")
            took, _ = await _stop_while(gateway, response)
    assert took < STOPS_WITHIN_S
    assert gateway.proc.popen.returncode == 0


async def test_a_followed_run_waiting_for_a_decision_does_not_hold_the_shutdown(gateway: Served) -> None:
    async with aiohttp.ClientSession() as session:
        status, _, body = await request(session, "POST", f"{gateway.url}/v1/chat/completions",
                                        body=chat_body("scripted-destructive"),
                                        headers={"X-Run-Id": "follow-1", "X-Policy": "files_auto"})
        assert status == 200 and body["run"]["interruption"] is not None, body  # waits for a decision that resumes it
        async with session.get(f"{gateway.url}/v1/runs/follow-1/events?follow=1",
                               headers={"Authorization": f"Bearer {DEMO}"}) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            took, _ = await _stop_while(gateway, response)
    assert took < STOPS_WITHIN_S
    assert gateway.proc.popen.returncode == 0


async def test_a_stop_lets_the_call_in_flight_finish_and_says_so(gateway: Served) -> None:
    async with aiohttp.ClientSession() as session:
        call = asyncio.ensure_future(request(session, "POST", f"{gateway.url}/v1/chat/completions",
                                             body=chat_body("scripted-plan"),
                                             headers={"X-Policy": "passthrough", "X-Scripted-Latency-Ms": "1500"}))

        async def in_flight() -> bool:
            async with session.get(f"{gateway.url}/metrics") as resp:
                return "gateway_runs_active 1.0" in await resp.text()

        await poll(in_flight)
        gateway.proc.popen.terminate()
        status, _, body = await call
    assert status == 200, body  # drained, not cut
    await asyncio.get_running_loop().run_in_executor(None, gateway.proc.popen.wait, STOPS_WITHIN_S * 4)
    assert gateway.proc.popen.returncode == 0
    # One line for the whole gateway, whatever its number of workers (--workers N: the
    # supervisor's, summing what each worker drained).
    [line] = [line for line in gateway.proc.output().splitlines() if "gateway: stopped" in line]
    assert f"gateway: stopped (pid {gateway.proc.popen.pid}" in line, line
    assert "having drained 1 request in flight" in line, line
