"""Slow and idle clients are timed out, and a process holds at most `server.max_connections`.

Real gateway processes (tests.server.served's config: a SQLite store, the scripted
upstream) spoken to over raw sockets, as a slow or idle client would:

- `quick`: `header_timeout_s`, `body_timeout_s` and `idle_timeout_s` of about a second.
  A connection that sends nothing, 200 holding a partial request head and one sending its
  head a byte at a time are closed (the last two with a 408 `header_timeout`), a body sent
  a byte at a time is a 408 `body_timeout`, 100 idle keep-alive connections are closed; a
  stream whose chunks come further apart than every timeout, and an `events?follow=1`
  that waits longer than all of them for a person's decision, go on to their end.
- `capped`: `max_connections: 20` and long timeouts: the 21st connection is answered 503
  `too_many_connections` and closed; once one of the 20 closes, a new one is served.

The deadlines below only bound a wait for what must happen (a close, an answer); none is
a measurement. Before these settings, every one of these connections stayed open (the
only bound was aiohttp's keep-alive timer of 3630 s).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from tests.server.served import DEMO, OPS, auth, chat_body, request, write_config
from tests.support.procs import TEST_WORKERS, Proc, free_port, start_gateway

TIMEOUT_S = 1.0
CLOSE_WITHIN_S = 30.0
"""How long a test waits for the gateway to close a connection it must close (far above
the timeouts; on the main branch of old it waited in vain)."""
CAP = 20


def start(folder: Path, server: dict[str, Any]) -> Proc:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    config["server"].update(server)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start(tmp_path_factory.mktemp("quick"), {"header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S,
                                                     "idle_timeout_s": TIMEOUT_S * 1.5})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start(tmp_path_factory.mktemp("capped"), {"max_connections": CAP, "header_timeout_s": 60,
                                                      "idle_timeout_s": 120})
    yield proc
    proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(url: str) -> Conn:
    host, _, port = url.removeprefix("http://").partition(":")
    return await asyncio.open_connection(host, int(port))


async def closed_by_server(conn: Conn, timeout: float = CLOSE_WITHIN_S) -> bytes:
    """Everything the server sent until it closed the connection (fails if it did not in time)."""
    reader, writer = conn
    try:
        return await asyncio.wait_for(reader.read(), timeout)  # read() returns at EOF
    except TimeoutError:
        raise AssertionError(f"the gateway kept the connection open for {timeout:g} s") from None
    finally:
        writer.close()


def error_of(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(status, error object) of a raw HTTP/1.1 answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)["error"]


async def read_answer(reader: asyncio.StreamReader, status: bytes | None = None) -> bytes:
    """One whole 200 answer read off a kept-alive connection (its body by Content-Length)."""
    status = status or await reader.readuntil(b"\r\n")
    assert b" 200 " in status, status
    fields = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    length = int(fields.split("content-length:")[1].split("\r\n")[0])
    return await reader.readexactly(length)


def head(path: str = "/livez", method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: gateway\r\n{extra}\r\n".encode()


async def test_a_connection_that_sends_nothing_is_closed(quick: Proc) -> None:
    assert await closed_by_server(await connect(quick.url)) == b""  # nothing to answer: closed


async def test_200_partial_heads_are_answered_408_and_closed(quick: Proc) -> None:
    conns = []
    for _ in range(200):  # each sends its part as soon as it is open: on a loaded machine opening
        conns.append(conn := await connect(quick.url))  # 200 takes longer than the timeout, which
        conn[1].write(b"GET /livez HTTP/1.1\r\nHost: gatew")  # runs from each one's opening
    answers = await asyncio.gather(*(closed_by_server(c) for c in conns))
    assert {error_of(a)[0] for a in answers} == {408}
    assert {error_of(a)[1]["code"] for a in answers} == {"header_timeout"}


async def test_a_head_sent_a_byte_at_a_time_is_cut_off(quick: Proc) -> None:
    reader, writer = await connect(quick.url)
    whole = head(extra="X-Padding: " + "a" * 200 + "\r\n")
    sent = 0

    async def drip() -> None:
        nonlocal sent
        for i in range(len(whole)):
            writer.write(whole[i:i + 1])
            sent += 1
            await asyncio.sleep(0.05)  # the slow client under test: a byte every 50 ms

    dripping = asyncio.ensure_future(drip())
    try:
        answer = await closed_by_server((reader, writer))
    finally:
        dripping.cancel()
    assert sent < len(whole)
    status, error = error_of(answer)
    assert (status, error["code"]) == (408, "header_timeout"), answer


async def test_a_body_sent_a_byte_at_a_time_is_a_408(quick: Proc) -> None:
    reader, writer = await connect(quick.url)
    body = orjson.dumps(chat_body("scripted-plan"))
    writer.write(head("/v1/chat/completions", "POST", f"Authorization: Bearer {DEMO}\r\nContent-Type: "
                      f"application/json\r\nX-Policy: passthrough\r\nContent-Length: {len(body)}\r\n"))

    async def drip() -> None:
        for i in range(len(body)):
            writer.write(body[i:i + 1])
            await asyncio.sleep(0.05)

    dripping = asyncio.ensure_future(drip())
    try:
        answer = await closed_by_server((reader, writer))
    finally:
        dripping.cancel()
    status, error = error_of(answer)
    assert (status, error["code"]) == (408, "body_timeout"), answer
    async with aiohttp.ClientSession() as session, session.get(f"{quick.url}/metrics") as resp:
        assert 'gateway_request_timeouts_total{kind="body"} 0.0' not in await resp.text()


async def test_100_idle_keep_alive_connections_are_closed(quick: Proc) -> None:
    conns = [await connect(quick.url) for _ in range(100)]
    for reader, writer in conns:
        writer.write(head())
    for reader, _ in conns:
        await read_answer(reader)
    leftovers = await asyncio.gather(*(closed_by_server(c) for c in conns))
    assert set(leftovers) == {b""}  # closed without another word: an idle close


async def test_a_stream_slower_than_every_timeout_is_answered_whole(quick: Proc,
                                                                    session: aiohttp.ClientSession) -> None:
    reply = orjson.dumps({"content": "slow but steady", "tool_calls": []}).decode()
    headers = auth(DEMO, **{"X-Policy": "passthrough", "X-Scripted-Chunk-Delay-Ms": str(int(TIMEOUT_S * 2000)),
                            "X-Scripted-Reply": reply})
    started = time.monotonic()
    async with session.post(f"{quick.url}/v1/chat/completions", json={**chat_body("scripted-plan"), "stream": True},
                            headers=headers) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert text.rstrip().endswith("data: [DONE]"), text
    assert time.monotonic() - started > 2 * TIMEOUT_S * 2  # its chunks really came further apart than the timeouts


async def test_a_follower_waiting_longer_than_every_timeout_sees_the_run_end(
        quick: Proc, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{quick.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files_auto"})
    assert status == 200 and body["run"]["interruption"]["call_id"] == "c2", body
    run_id = headers["X-Run-Id"]
    ended: dict[str, Any] | None = None
    async with session.get(f"{quick.url}/v1/runs/{run_id}/events?follow=1", headers=auth()) as resp:
        kind, decided = "message", False
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = orjson.loads(line[6:])
                if kind == "end":
                    ended = data
                    break
                if data["type"] == "approval_required" and not decided:
                    decided = True
                    await asyncio.sleep(TIMEOUT_S * 3)  # the follower idles past every timeout: what is tested
                    status, _, answer = await request(session, "POST", f"{quick.url}/v1/runs/{run_id}/approvals",
                                                      key=OPS, body={"call_id": "c2", "decision": "approve"})
                    assert status == 200, answer
    assert ended is not None and ended["status"] == "completed", ended


async def test_past_max_connections_a_connection_is_refused_with_a_503(capped: Proc) -> None:
    """The cap is per process: with GATEWAY_TEST_WORKERS the kernel spreads connections over
    the workers, and the first refusal comes once the one a connection lands on is full."""
    processes = int(os.environ.get(TEST_WORKERS) or 1)
    held: list[Conn] = []
    while True:  # each served once, then kept open (idle_timeout_s is long here)
        conn = await connect(capped.url)
        conn[1].write(head())
        line = await conn[0].readuntil(b"\r\n")
        if b" 200 " not in line:
            break
        await read_answer(conn[0], line)
        held.append(conn)
        assert len(held) <= CAP * processes, "no connection was refused"
    answer = line + await closed_by_server(conn)
    assert len(held) >= CAP
    status, error = error_of(answer)
    assert (status, error["code"]) == (503, "too_many_connections"), answer
    assert b"retry-after: 1" in answer.lower()

    held.pop()[1].close()  # one closes: room for one more
    deadline = time.monotonic() + CLOSE_WITHIN_S
    while True:
        again = await connect(capped.url)
        again[1].write(head())
        line = await again[0].readuntil(b"\r\n")
        again[1].close()
        if b" 200 " in line:
            break
        assert time.monotonic() < deadline, line  # the gateway notices the close as it happens
        await asyncio.sleep(0.05)
    for _, writer in held:
        writer.close()
    async with aiohttp.ClientSession() as session, session.get(f"{capped.url}/metrics") as resp:
        assert "gateway_connections_refused_total 0.0" not in await resp.text()
