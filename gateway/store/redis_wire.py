"""The Redis store's round trips: its Lua scripts (and a few commands) on connections of its own.

Through `redis.asyncio.Redis` a command goes through the Script wrapper, `execute_command`
(retry wrapper, observability records), a pool checkout and release (a lock each, events),
`pack_command` (an encoder call per argument) and, for the write, an `asyncio.wait_for`,
which is a task of its own, then a second deadline for the read. A `Lane` keeps redis-py's
connections (`Connection`: connect, HELLO/AUTH, SSL, `read_response` and its parser, the
errors) but drives them itself: idle connections in a list, the EVALSHA of a script packed
from a head it prepared once, one deadline (`asyncio.timeout`) for the whole round trip, so
the write needs no task. Measured on the 2-core machine, FIGURES in a loop on one server,
10 alternating rounds of 2,000: 140 µs of CPU per command through `register_script`, 75 µs
through a lane; a pass-through call makes two or three.

What the client did that matters here is kept: a deadline on every round trip (a frozen
server is a `redis.exceptions.TimeoutError` after `timeout_s`), no retries (a command that
timed out may have run), a connection that failed in any way is closed and never reused
(its reply may still be on its way), an idle one that the server closed meanwhile is
reconnected before use (as the pool does), and NOSCRIPT (a restarted server, SCRIPT FLUSH)
loads the script and runs it again: NOSCRIPT means it did not run.

With `Wait` (`store.wait_replicas`), a write goes with a `WAIT` in the same round trip (one
send, two replies): it returns once that many replicas have it, and a write they did not
all confirm within the wait's timeout is `Unconfirmed`, which the store reports as a
failed write (the master has it; a failover may lose it).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any, Final

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | bytes


def _bulk(value: Arg) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack(*args: Arg) -> bytes:
    """A command as RESP sends it: an array of bulk strings."""
    return b"*%d\r\n%s" % (len(args), b"".join([_bulk(a) for a in args]))


class Unconfirmed(RedisError):
    """A write that fewer replicas than `store.wait_replicas` confirmed within the wait.
    `reply`: what the master answered (it made the write)."""

    def __init__(self, message: str, reply: Any = None) -> None:
        super().__init__(message)
        self.reply = reply


class Wait:
    """How many replicas must confirm each write (`WAIT replicas timeout`), and how long
    they have, packed once."""

    __slots__ = ("replicas", "timeout_ms", "packed")

    def __init__(self, replicas: int, timeout_s: float) -> None:
        self.replicas = replicas
        self.timeout_ms = max(1, round(timeout_s * 1000))
        self.packed = pack("WAIT", str(replicas), str(self.timeout_ms))


class Script:
    """A Lua script as a `Lane` runs it: its text, its SHA1, EVALSHA's packed head (the
    command, the SHA1 and the number of keys, `keys`, which lead the arguments) and its
    SCRIPT LOAD, packed. `writes`: whether replicas must confirm it (`Wait`); a script that
    only reads (or writes only what a later call makes again, as reclaiming expired holds)
    says False."""

    __slots__ = ("text", "sha", "head", "load", "writes")

    def __init__(self, text: str, keys: int = 0, *, writes: bool = True) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        self.head = _bulk("EVALSHA") + _bulk(self.sha) + _bulk(str(keys))
        self.load = pack("SCRIPT", "LOAD", text)
        self.writes = writes

    def packed(self, args: Sequence[Arg]) -> bytes:
        """EVALSHA of this script with `args` (keys first)."""
        return b"*%d\r\n%s%s" % (len(args) + 3, self.head, b"".join([_bulk(a) for a in args]))


class Lane:
    """Round trips on connections made as `pool` makes them but without their own socket
    deadlines (the lane sets one for the whole round trip), kept idle here between calls.
    One connection per command in flight, as the pool: at concurrency 32, 32 connections."""

    def __init__(self, pool: ConnectionPool, timeout_s: float, wait: Wait | None = None) -> None:
        self._pool = pool
        self._kwargs: Final = {**pool.connection_kwargs, "socket_timeout": None}
        self._timeout_s = timeout_s
        self._wait = wait
        self._idle: list[AbstractConnection] = []
        self._closed = False

    async def run(self, script: Script, args: Sequence[Arg]) -> Any:
        """EVALSHA of `script` with `args`; its reply as redis-py parses it (a Lua error is a
        `ResponseError`, a lost server `ConnectionError`, no answer in time `TimeoutError`,
        a write the replicas did not confirm `Unconfirmed`)."""
        return await self._exchange(script.packed(args), script.load, script.writes)

    async def command(self, *args: Arg, writes: bool = False) -> Any:
        """One plain command (e.g. HGET) with the lane's deadline and connections; `writes`:
        replicas must confirm it, as a script's."""
        return await self._exchange(pack(*args), None, writes)

    async def _exchange(self, packed: bytes, load: bytes | None, writes: bool) -> Any:
        wait = self._wait if writes else None
        conn = self._idle.pop() if self._idle else self._pool.connection_class(**self._kwargs)
        unconfirmed: Unconfirmed | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._pool.ensure_connection(conn)  # reconnects one the server closed while idle
                try:
                    reply, unconfirmed = await _round_trip(conn, packed, wait)
                except NoScriptError:  # a restarted or flushed server: the script did not run
                    if load is None:
                        raise
                    await _round_trip(conn, load, None)
                    reply, unconfirmed = await _round_trip(conn, packed, wait)
        except BaseException as exc:
            await conn.disconnect(nowait=True)  # its reply may still come: never reused
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"Timeout: no answer within {self._timeout_s:g} s") from exc
            raise
        if self._closed:
            await conn.disconnect()
        else:
            self._idle.append(conn)
        if unconfirmed is not None:
            raise unconfirmed
        return reply

    async def drop_idle(self) -> None:
        """Close the idle connections (the server was lost: they are as dead as the one that failed)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect(nowait=True)

    async def close(self) -> None:
        """Close the idle connections; those in use are closed when their round trip ends."""
        self._closed = True
        await self.drop_idle()


async def _round_trip(conn: AbstractConnection, packed: bytes, wait: Wait | None) -> tuple[Any, Unconfirmed | None]:
    """One command (and, with `wait`, its WAIT in the same send); its reply, and whether the
    replicas left it unconfirmed. Both replies are read whatever the first is, so the
    connection stays in step."""
    if wait is None:
        await conn.send_packed_command(packed, check_health=False)
        return await conn.read_response(), None
    await conn.send_packed_command(packed + wait.packed, check_health=False)
    try:
        reply = await conn.read_response()
    finally:
        acked = await conn.read_response()
    if int(acked) < wait.replicas:
        return reply, Unconfirmed(f"the write was confirmed by {int(acked)} of the {wait.replicas} replicas "
                                  f"store.wait_replicas asks for, within {wait.timeout_ms} ms", reply)
    return reply, None
