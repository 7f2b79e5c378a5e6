"""A small HTTP proxy on loopback that notes every request it carries.

An absolute-form request (`POST http://127.0.0.1:PORT/v1/chat/completions HTTP/1.1`, what a
client sends a proxy for an http:// URL) is noted as `"POST http://..."` and passed to its
origin with `Connection: close`, so each call arrives on a connection of its own and none is
carried unnoticed behind another. A `CONNECT host:port` (an https:// URL) is noted as
`"CONNECT host:port"` and tunnelled. With `credentials`, a request without the matching
`Proxy-Authorization: Basic ...` is answered 407 (noted as `"407 ..."`).

`forward_proxy()` serves it from a thread of its own (gateway processes use it); yields
(its URL, the list of notes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

from tests.support.procs import free_port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Proxy:
    def __init__(self, credentials: tuple[str, str] | None = None) -> None:
        self.seen: list[str] = []
        self._auth = (b"Basic " + base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode())
                      if credentials else None)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        first, *lines = head.decode("latin-1").split("\r\n")
        method, target, version = first.split(" ", 2)
        fields = [line for line in lines if line]
        auth = next((f.partition(":")[2].strip().encode() for f in fields
                     if f.lower().startswith("proxy-authorization:")), None)
        if self._auth is not None and auth != self._auth:
            self.seen.append(f"407 {method} {target}")
            writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        self.seen.append(f"{method} {target}")
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
        else:
            url = urlsplit(target)
            up_reader, up_writer = await asyncio.open_connection(url.hostname, url.port or 80)
            keep = [f for f in fields if not f.lower().startswith(("connection:", "proxy-", "keep-alive:"))]
            path = url.path + (f"?{url.query}" if url.query else "")
            up_writer.write(f"{method} {path} {version}\r\n".encode("latin-1")
                            + "".join(f"{f}\r\n" for f in [*keep, "Connection: close"]).encode("latin-1") + b"\r\n")
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


@contextlib.contextmanager
def forward_proxy(credentials: tuple[str, str] | None = None, timeout: float = 30.0) -> Iterator[tuple[str, list[str]]]:
    """The proxy on a free loopback port, served by a thread of its own until the block ends."""
    proxy = Proxy(credentials)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-proxy", daemon=True)
    thread.start()
    port = free_port()

    async def up() -> asyncio.Server:
        return await asyncio.start_server(proxy.handle, "127.0.0.1", port)

    server = asyncio.run_coroutine_threadsafe(up(), loop).result(timeout)
    try:
        yield f"http://127.0.0.1:{port}", proxy.seen
    finally:
        async def down() -> None:
            server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(down(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()
