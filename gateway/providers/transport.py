"""How the gateway's connections to its upstreams are made: the client sessions.

One `aiohttp.ClientSession` (a tuned connector, no cookie jar, no environment lookups) is
shared by every upstream whose connections are the default ones: its calls take exactly
the path they took before upstreams could have TLS settings or a proxy. An upstream with
`tls` or a proxy (`proxy`, or HTTPS_PROXY/HTTP_PROXY from the environment, resolved once
when the config is read: aiohttp's `trust_env` would look the environment up again on every
call, on a thread) gets a session of its own (with that SSL context; its calls name the
proxy), so its calls run the same code with different connections. `Sessions.close` closes those at shutdown
(the shared one belongs to whoever made it: the app); `Sessions.retire` one whose upstream a
config reload replaced, once that upstream's last call ended (`Upstream.retire`).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp

from gateway.config.upstreams import UpstreamConfig

__all__ = ["Sessions", "Transport", "new_session", "split_proxy"]


def new_session(ssl_context: ssl.SSLContext | bool = True) -> aiohttp.ClientSession:
    """A client session: many keep-alive connections, DNS cached, no cookie jar; with the SSL
    context of an upstream that has one."""
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60,
                                     enable_cleanup_closed=False, ssl=ssl_context)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=None))


@dataclass(frozen=True)
class Transport:
    """How one upstream's calls are sent: its session and, through a proxy, the proxy's URL
    (without credentials) and the headers only the proxy gets (`Proxy-Authorization`)."""

    session: aiohttp.ClientSession
    proxy: str | None = None
    proxy_headers: Mapping[str, str] | None = None


def split_proxy(url: str) -> tuple[str, Mapping[str, str] | None]:
    """A proxy URL without its credentials, and the `Proxy-Authorization` header they make
    (aiohttp does not read them from the URL)."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, None
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    auth = "Basic " + base64.b64encode(pair).decode("ascii")
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")), {"Proxy-Authorization": auth}


class Sessions:
    """The sessions of one set of upstreams: `shared` for the default ones, one of its own for
    each upstream with `tls` or a proxy (made here, closed by `close`)."""

    def __init__(self, shared: aiohttp.ClientSession) -> None:
        self.shared = shared
        self._own: list[aiohttp.ClientSession] = []
        self._closing: set[asyncio.Future[None]] = set()  # held until done (the loop keeps weak references)

    def for_upstream(self, config: UpstreamConfig) -> Transport:
        """How `config`'s calls are sent (the shared session unless it has tls or a proxy)."""
        if not config.own_transport:
            return Transport(self.shared)
        proxy, proxy_headers = split_proxy(config.proxy) if config.proxy is not None else (None, None)
        session = new_session(config.tls.context() if config.tls is not None else True)
        self._own.append(session)
        return Transport(session, proxy, proxy_headers)

    def retire(self, session: aiohttp.ClientSession) -> None:
        """Close `session` now (on the running loop) if it is one of this set's own; the shared
        one stays open."""
        if session not in self._own:
            return
        self._own.remove(session)
        closing = asyncio.ensure_future(session.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def connections(self) -> tuple[int, int]:
        """(in use, idle) connections of these sessions to the upstreams, now."""
        in_use = idle = 0
        for session in (self.shared, *self._own):
            connector = session.connector
            # aiohttp keeps no public count: its connector's own bookkeeping, read without a change
            in_use += len(getattr(connector, "_acquired", ()))
            idle += sum(len(c) for c in getattr(connector, "_conns", {}).values())
        return in_use, idle

    async def close(self) -> None:
        for session in self._own:
            await session.close()
        self._own.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
