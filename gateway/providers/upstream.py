"""The client side of the proxy: chat completions to an OpenAI-compatible upstream.

One `aiohttp.ClientSession` (with a tuned connector) is shared by every upstream of the
app. Every failure becomes an `UpstreamError` the client can act on:

    timeout (connect, read, whole call)         -> 504 upstream_timeout
    connection refused / reset before an answer -> 502 upstream_unreachable
    upstream 5xx, 429, 401, 403                 -> 502 upstream_status (naming its status and message)
    upstream other 4xx                          -> same status, upstream_rejected (the request is at fault)
    body that is not a chat completion          -> 502 upstream_malformed
    body or stream cut in the middle            -> 502 upstream_cut
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gateway.config.settings import UpstreamConfig
from gateway.providers.errors import UpstreamError
from gateway.providers.repair import (
    Repair,
    is_tool_parse_failure,
    repair_completion,
    retried_without_parsing,
    tool_schemas,
    without_tool_parsing,
)
from gateway.providers.reply import MalformedReply, ParsedReply, parse_completion

__all__ = ["Upstream", "UpstreamError", "UpstreamReply", "UpstreamStream", "new_session"]

FORWARDED_PREFIX = "x-scripted-"
"""Client headers passed on to a `scripted` upstream only (its failure injection); any other
upstream never sees them."""


def new_session() -> aiohttp.ClientSession:
    """The shared client session: many keep-alive connections, DNS cached, no cookie jar."""
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=None))


@dataclass(frozen=True)
class UpstreamReply:
    """A non-streamed answer: the body as received (to pass on byte-exact) and parsed; after a
    tool-call repair (`repairs` not empty), the repaired body."""

    raw: bytes
    data: dict[str, Any]
    seconds: float
    repairs: tuple[Repair, ...] = ()


class UpstreamStream:
    """An upstream SSE answer: yields whole events (their bytes as received)."""

    def __init__(self, upstream: Upstream, response: aiohttp.ClientResponse) -> None:
        self.upstream = upstream
        self.response = response

    async def events(self) -> AsyncIterator[bytes]:
        """Each SSE event with its terminating blank line; raises UpstreamError if cut."""
        parts: list[bytes] = []
        try:
            async for line in self.response.content:
                if line in (b"\n", b"\r\n"):
                    if parts:
                        parts.append(line)
                        yield b"".join(parts)
                        parts = []
                    continue
                parts.append(line)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise self.upstream.timeout("stream stalled") from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamError("upstream_cut", f"upstream '{self.upstream.name}' cut the stream: "
                                f"{connection_problem(exc)}", self.upstream.name, self.response.status) from None
        if parts:  # a last event without its blank line
            yield b"".join(parts) + b"\n"



def connection_problem(exc: BaseException) -> str:
    """What went wrong with the connection, in words: aiohttp's messages embed the reprs of
    other exceptions (`<TransferEncodingError: 400, ...>`), which clients must not see."""
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the body ended before its declared length or last chunk"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return "the connection failed"

class Upstream:
    """One configured upstream bound to the shared session."""

    def __init__(self, config: UpstreamConfig, session: aiohttp.ClientSession,
                 base_url: Callable[[], str | None], key: str | None = None) -> None:
        """`key` is sent as the bearer key when the config names no `api_key_env` (the
        gateway's own secret for its scripted mount)."""
        self.config = config
        self.name = config.name
        self.session = session
        self._base_url = base_url
        self._key = key
        # Non-streamed: connect, then the first byte, then the whole answer, each bounded.
        # Streamed: connect, then the longest silence between events (`timeout_s`); the first
        # event's deadline (`first_byte_timeout_s`) is kept by the caller that reads it.
        self._plain_timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s,
                                                    sock_read=config.first_byte_timeout_s)
        # A local upstream's streams also get the whole-call deadline of its plain calls.
        self._stream_timeout = aiohttp.ClientTimeout(total=config.timeout_s if config.kind == "local" else None,
                                                     sock_connect=config.connect_timeout_s,
                                                     sock_read=config.timeout_s)

    @property
    def url(self) -> str:
        base = self.config.base_url or self._base_url()
        if base is None:
            raise UpstreamError("upstream_unreachable",
                                f"upstream '{self.name}' has no address yet (the gateway does not know its own URL)",
                                self.name)
        return base + "/chat/completions"

    def headers(self, client_headers: Mapping[str, str] | None = None) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.config.api_key_env:
            key = self.config.api_key()
            if not key:
                raise UpstreamError("upstream_misconfigured",
                                    f"upstream '{self.name}': environment variable {self.config.api_key_env} "
                                    "is not set", self.name)
            out["Authorization"] = f"Bearer {key}"
        elif self._key:
            out["Authorization"] = f"Bearer {self._key}"
        if client_headers and self.config.kind == "scripted":
            for name, value in client_headers.items():
                if name.lower().startswith(FORWARDED_PREFIX):
                    out[name] = value
        return out

    def timeout(self, what: str, seconds: float | None = None) -> UpstreamError:
        limit = self.config.timeout_s if seconds is None else seconds
        return UpstreamError("upstream_timeout", f"upstream '{self.name}' did not answer within {limit:g}s ({what})",
                             self.name)

    def _timed_out(self, exc: BaseException, what: str) -> UpstreamError:
        """Which of the split timeouts passed: connect, first byte (a socket read) or total."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return self.timeout("no connection", self.config.connect_timeout_s)
        if isinstance(exc, aiohttp.SocketTimeoutError):
            return self.timeout("no data", self.config.first_byte_timeout_s)
        return self.timeout(what)

    async def complete(self, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        """POST a non-streamed chat completion and return it, checked.

        With the upstream's `max_tokens` cap the request asks for no more; with `tool_repair`
        the reply's tool calls are repaired (`gateway.providers.repair`), and a 500 of an
        upstream that could not parse the model's tool call is retried once without parsing.
        """
        cfg = self.config
        if not (cfg.tool_repair or cfg.max_tokens is not None):
            return await self._post_chat(body, headers)
        request = orjson.loads(body)  # the gateway's own JSON object
        if cfg.max_tokens is not None:
            request = capped(request, cfg.max_tokens)
            body = orjson.dumps(request)
        tools = tool_schemas(request.get("tools")) if cfg.tool_repair else {}
        if not tools:
            return await self._post_chat(body, headers)
        started = time.perf_counter()
        first: tuple[Repair, ...] = ()
        try:
            reply = await self._post_chat(body, headers)
        except UpstreamError as exc:
            if not is_tool_parse_failure(exc.upstream_status or 0, exc.message):
                raise
            first = (retried_without_parsing(exc.message),)
            reply = await self._post_chat(orjson.dumps(without_tool_parsing(request)), headers)
        fixed = repair_completion(reply.data, tools)
        repairs = first + fixed.repairs
        if not repairs:
            return reply
        raw = reply.raw if fixed.data is reply.data else orjson.dumps(fixed.data)
        return UpstreamReply(raw, fixed.data, time.perf_counter() - started, repairs)

    async def _post_chat(self, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        return await self._post(self.url, body, headers, _has_message, "a chat completion (no choices[0].message)")

    async def respond(self, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        """POST a non-streamed Responses-API request (to <base>/responses), checked."""
        url = self.url.removesuffix("/chat/completions") + "/responses"
        return await self._post(url, body, headers, _has_output, "a response (no output array)")

    async def embed(self, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        """POST an embeddings request (to <base>/embeddings) and return the answer, checked."""
        url = self.url.removesuffix("/chat/completions") + "/embeddings"
        return await self._post(url, body, headers, _has_data, "an embeddings list (no data array)")

    async def _post(self, url: str, body: bytes, headers: Mapping[str, str], valid: Callable[[dict[str, Any]], bool],
                    shape: str) -> UpstreamReply:
        started = time.perf_counter()
        try:
            async with self.session.post(url, data=body, headers=headers, timeout=self._plain_timeout) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("retry-after-ms"), resp.headers.get("retry-after")
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise self._timed_out(exc, "no complete answer") from None
        except aiohttp.ClientPayloadError as exc:
            raise UpstreamError("upstream_cut", f"upstream '{self.name}' cut its answer: {connection_problem(exc)}",
                                self.name) from None
        except aiohttp.ClientConnectionError as exc:
            raise self._unreachable(exc) from None
        if status != 200:
            raise self._status_error(status, raw, retry_after)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise self._malformed(f"body is not JSON: {raw[:120]!r}") from None
        if not isinstance(data, dict) or not valid(data):
            raise self._malformed(f"body is not {shape}")
        return UpstreamReply(raw, data, time.perf_counter() - started)

    @asynccontextmanager
    async def stream(self, body: bytes, headers: Mapping[str, str],
                     path: str = "/chat/completions") -> AsyncIterator[UpstreamStream]:
        """POST a streamed chat completion (or, with `path` /responses, a streamed response);
        errors before the first byte raise here."""
        url = self.url if path == "/chat/completions" else self.url.removesuffix("/chat/completions") + path
        if self.config.max_tokens is not None and path == "/chat/completions":
            body = orjson.dumps(capped(orjson.loads(body), self.config.max_tokens))
        try:
            resp = await self.session.post(url, data=body, headers=headers, timeout=self._stream_timeout)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise self._timed_out(exc, "no response headers") from None
        except aiohttp.ClientConnectionError as exc:
            raise self._unreachable(exc) from None
        try:
            if resp.status != 200:
                try:
                    raw = await resp.read()
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    raw = b""
                raise self._status_error(resp.status, raw, (resp.headers.get("retry-after-ms"),
                                                            resp.headers.get("retry-after")))
            content_type = resp.headers.get("Content-Type", "")
            if "text/event-stream" not in content_type:
                raise self._malformed(f"asked for a stream, got Content-Type {content_type or 'none'!r}")
            yield UpstreamStream(self, resp)
        finally:
            if resp.content.at_eof():
                resp.release()  # fully read: the connection goes back to the pool
            else:
                resp.close()  # abandoned mid-body: the connection cannot be reused

    def parse(self, reply: UpstreamReply) -> ParsedReply:
        """Choice 0 of a reply, checked (`gateway.providers.reply`): 502 upstream_malformed
        naming the field when it is not a usable chat completion."""
        try:
            return parse_completion(reply.data)
        except MalformedReply as exc:
            raise UpstreamError("upstream_malformed", f"upstream '{self.name}' returned a malformed reply: "
                                f"{exc}", self.name, 200) from None

    def _unreachable(self, exc: BaseException) -> UpstreamError:
        return UpstreamError("upstream_unreachable", f"upstream '{self.name}' is unreachable: "
                                                          f"{connection_problem(exc)}", self.name)

    def _malformed(self, detail: str) -> UpstreamError:
        return UpstreamError("upstream_malformed", f"upstream '{self.name}' answered malformed: {detail}",
                             self.name, 200)

    def _status_error(self, status: int, raw: bytes,
                      retry_after: tuple[str | None, str | None] = (None, None)) -> UpstreamError:
        message = _error_message(raw)
        if status in (401, 403, 429) or status >= 500:
            return UpstreamError("upstream_status", f"upstream '{self.name}' answered {status}: {message}",
                                 self.name, status, retry_after_s=retry_after_seconds(*retry_after))
        return UpstreamError("upstream_rejected",
                             f"upstream '{self.name}' rejected the request ({status}): {message}", self.name, status)


def capped(request: dict[str, Any], cap: int) -> dict[str, Any]:
    """`request` asking for at most `cap` completion tokens (`max_tokens`, and
    `max_completion_tokens` when it is there); a lower ask is kept."""
    out = dict(request)
    for key in ("max_tokens", "max_completion_tokens"):
        asked = out.get(key)
        if isinstance(asked, int) and not isinstance(asked, bool) and 0 < asked <= cap:
            continue
        if key == "max_tokens" or key in out:
            out[key] = cap
    return out


MAX_RETRY_AFTER_S = 3600.0


def retry_after_seconds(ms: str | None, seconds: str | None) -> float | None:
    """The upstream's `retry-after-ms` or `retry-after` (seconds or an HTTP date), bounded
    to an hour; None when absent or unreadable."""
    value: float | None = None
    try:
        if ms is not None:
            value = float(ms) / 1000
        elif seconds is not None:
            value = float(seconds)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(seconds or "")
            value = when.timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    if value is None or value != value:  # NaN
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, value))


def _has_output(data: dict[str, Any]) -> bool:
    return isinstance(data.get("output"), list)


def _has_data(data: dict[str, Any]) -> bool:
    return isinstance(data.get("data"), list)


def _has_message(data: dict[str, Any]) -> bool:
    choices = data.get("choices")
    return (isinstance(choices, list) and bool(choices) and isinstance(choices[0], dict)
            and isinstance(choices[0].get("message"), dict))


def _error_message(raw: bytes) -> str:
    """The upstream's own words: error.message of an OpenAI-shaped body, else the text."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw[:300].decode("utf-8", "replace").strip()
        return text or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return raw[:300].decode("utf-8", "replace")
