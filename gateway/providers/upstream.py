"""The client side of the proxy: chat completions (and embeddings, Responses, the model
list) to an OpenAI-compatible upstream.

An upstream's calls go through the session `gateway.providers.transport` gives it (the
shared one unless it has TLS settings or a proxy). Where each call goes (`url`: `base_url`,
the API's `path` with `{model}`/`{deployment}` filled in, the `query`) and every header it
carries (`headers`: auth, configured headers, the scripted test headers) are decided here
and only here. Every failure becomes an `UpstreamError` the client can act on:

    timeout (connect, read, whole call)         -> 504 upstream_timeout
    connection refused / reset before an answer -> 502 upstream_unreachable (TLS problems named)
    a variable it needs is not set              -> 502 upstream_misconfigured (naming the variable)
    upstream 5xx, 429, 401, 403                 -> 502 upstream_status (naming its status and message)
    upstream 4xx with error.code content_filter -> same status, content_filter (its param, innererror)
    upstream other 4xx                          -> same status, upstream_rejected (the request is at fault)
    body that is not a chat completion          -> 502 upstream_malformed
    body or stream cut in the middle            -> 502 upstream_cut
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import orjson
from yarl import URL

from gateway.config.upstreams import PLACEHOLDERS, Endpoint, EnvValue, UpstreamConfig
from gateway.providers.errors import UpstreamError
from gateway.providers.transport import new_session
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


UNREACHABLE = (aiohttp.ClientConnectionError, aiohttp.ClientHttpProxyError)
"""Failures to reach the upstream at all (a proxy's refusal to open a tunnel is a response error)."""
MAX_MODELS = 1000
"""Model names taken from one upstream's list (`list_models`); the rest are left out."""
MAX_MODELS_BYTES = 1 << 20
"""The largest model list read from an upstream."""
MAX_MODEL_NAME = 256
MAX_ERROR_DETAIL = 8192
"""The most bytes of an upstream's `innererror` passed on with a content-filter refusal."""


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
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        return f"the proxy refused to open the connection ({exc.status} {exc.message})"
    if isinstance(exc, aiohttp.ClientProxyConnectionError):
        return f"cannot connect to its proxy {exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert = exc.certificate_error
        why = getattr(cert, "verify_message", None) or getattr(cert, "reason", None) or "not trusted"
        return (f"the TLS certificate of {exc.host}:{exc.port} is not trusted ({str(why).lower()}); "
                "tls.ca_file names the CA that signed it")
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        reason = getattr(exc.os_error, "reason", None) or "no reason given"
        return (f"the TLS handshake with {exc.host}:{exc.port} failed ({str(reason).lower().replace('_', ' ')}); "
                "is it an https:// server?")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return "the connection failed"


def _dropped(exc: BaseException) -> bool:
    """The server closed or reset the connection before answering."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or (
        isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE))


class Upstream:
    """One configured upstream bound to its session (`gateway.providers.transport`)."""

    def __init__(self, config: UpstreamConfig, session: aiohttp.ClientSession,
                 base_url: Callable[[], str | None], key: str | None = None,
                 proxy: str | None = None, proxy_headers: Mapping[str, str] | None = None,
                 propagate: Callable[[MutableMapping[str, str]], None] | None = None) -> None:
        """`key` is sent as the bearer key when the config names no `api_key_env` (the
        gateway's own secret for its scripted mount); `proxy`: the proxy its calls go
        through, `proxy_headers` the credentials sent to that proxy only; `propagate` adds
        the trace context of the attempt in progress to a call's headers (telemetry on)."""
        self.config = config
        self._propagate = propagate
        self.name = config.name
        self.session = session
        # Without a proxy, the session's own method: the calls of such an upstream take the same path as ever.
        # Its credentials go in the CONNECT of an https:// call, or with each request an http:// one sends the proxy.
        tunnelled = (config.base_url or "").startswith("https://")
        self._request = (functools.partial(session.request, proxy=proxy,
                                           proxy_headers=proxy_headers if tunnelled else None) if proxy
                         else session.request)
        self._base_url = base_url
        self._key = key
        self._urls: dict[Endpoint, str] | None = None  # made once the base is known
        self._templated = frozenset(e for e in ("chat", "embeddings", "responses")
                                    if any("{" + p + "}" in (config.paths.of(e) or "") for p in PLACEHOLDERS))
        # Every header but the secrets read at call time, made once.
        self._static: dict[str, str] = {"Content-Type": "application/json"}
        self._static.update((n, v) for n, v in config.headers if isinstance(v, str))
        if proxy and proxy_headers and not tunnelled:
            self._static.update(proxy_headers)
        self._from_env = tuple((n, v.env) for n, v in config.headers if isinstance(v, EnvValue))
        self._key_env = config.api_key_env if config.auth.kind != "none" else None
        self._key_header, self._key_prefix = config.auth.header, config.auth.prefix
        self._scripted = config.kind == "scripted"
        self._tls = config.tls is not None  # a private endpoint: a dropped connection may be a refused client
        self._calls = 0  # calls using the session now (`retire`)
        self._when_idle: Callable[[], object] | None = None
        # Non-streamed: connect, then the first byte, then the whole answer, each bounded.
        # Streamed: connect, then the longest silence between events (`timeout_s`); the first
        # event's deadline (`first_byte_timeout_s`) is kept by the caller that reads it.
        self._plain_timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s,
                                                    sock_read=config.first_byte_timeout_s)
        # A local upstream's streams also get the whole-call deadline of its plain calls.
        self._stream_timeout = aiohttp.ClientTimeout(total=config.timeout_s if config.kind == "local" else None,
                                                     sock_connect=config.connect_timeout_s,
                                                     sock_read=config.timeout_s)

    def retire(self, when_idle: Callable[[], object]) -> None:
        """Call `when_idle` once none of this upstream's calls uses its session (now if none
        does): a config reload replaced it, and the calls it was given finish on it first."""
        if self._calls == 0:
            when_idle()
        else:
            self._when_idle = when_idle

    def _call_ended(self) -> None:
        self._calls -= 1
        if self._calls == 0 and self._when_idle is not None:
            when_idle, self._when_idle = self._when_idle, None
            when_idle()

    def _make_urls(self) -> dict[Endpoint, str]:
        base = self.config.base_url or self._base_url()
        if base is None:
            raise UpstreamError("upstream_unreachable",
                                f"upstream '{self.name}' has no address yet (the gateway does not know its own URL)",
                                self.name)
        query = "?" + urlencode(self.config.query, quote_via=quote) if self.config.query else ""
        paths = self.config.paths
        urls: dict[Endpoint, str] = {e: base + (paths.of(e) or "") + query
                                     for e in ("chat", "embeddings", "responses", "models")}
        self._urls = urls
        return urls

    def url(self, endpoint: Endpoint = "chat", model: str = "") -> str | URL:
        """Where a call of `endpoint` goes: base_url, the API's path (its `{model}` /
        `{deployment}` the URL-quoted `model`, which a glob route takes from the client) and
        the query."""
        url = (self._urls or self._make_urls())[endpoint]
        if endpoint not in self._templated:
            return url
        name = quote(model, safe="")
        if name in ("", ".", ".."):  # never a path of its own: not even empty, "." or ".." resolve elsewhere
            name = name.replace(".", "%2E") or "%20"
        return URL(url.replace("{model}", name).replace("{deployment}", name), encoded=True)

    def headers(self, client_headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """Every header of a call to this upstream (the one place they are made): its auth,
        its configured headers (secrets read from the environment now, never logged), and
        for a scripted upstream the client's `X-Scripted-*` headers. A variable that is not
        set fails the call (502 upstream_misconfigured naming it)."""
        out = dict(self._static)
        if self._key_env:
            key = os.environ.get(self._key_env)
            if not key:
                raise self._misconfigured(f"environment variable {self._key_env} is not set (it should hold the "
                                          "upstream's key)")
            if "\n" in key or "\r" in key:
                raise self._misconfigured(f"environment variable {self._key_env} holds a line break")
            out[self._key_header] = self._key_prefix + key
        elif self._key:
            out["Authorization"] = f"Bearer {self._key}"
        for name, variable in self._from_env:
            value = os.environ.get(variable)
            if not value:
                raise self._misconfigured(f"environment variable {variable} (header {name}) is not set")
            if "\n" in value or "\r" in value:
                raise self._misconfigured(f"environment variable {variable} (header {name}) holds a line break")
            out[name] = value
        if client_headers and self._scripted:
            for name, value in client_headers.items():
                if name.lower().startswith(FORWARDED_PREFIX):
                    out[name] = value
        if self._propagate is not None:  # traceparent: the upstream's spans are children of this attempt's
            self._propagate(out)
        return out

    @property
    def address(self) -> tuple[str | None, int | None]:
        """(host, port) its calls go to, as far as known (the scripted mount: once the gateway knows its own)."""
        parts = urlsplit(self.config.base_url or self._base_url() or "")
        try:
            return parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return parts.hostname, None

    def _misconfigured(self, problem: str) -> UpstreamError:
        return UpstreamError("upstream_misconfigured", f"upstream '{self.name}': {problem}", self.name)

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

    async def complete(self, body: bytes, headers: Mapping[str, str], model: str = "") -> UpstreamReply:
        """POST a non-streamed chat completion (asking for `model`) and return it, checked.

        With the upstream's `max_tokens` cap the request asks for no more; with `tool_repair`
        the reply's tool calls are repaired (`gateway.providers.repair`), and a 500 of an
        upstream that could not parse the model's tool call is retried once without parsing.
        """
        cfg = self.config
        url = self.url("chat", model)
        if not (cfg.tool_repair or cfg.max_tokens is not None):
            return await self._post_chat(url, body, headers)
        request = orjson.loads(body)  # the gateway's own JSON object
        if cfg.max_tokens is not None:
            request = capped(request, cfg.max_tokens)
            body = orjson.dumps(request)
        tools = tool_schemas(request.get("tools")) if cfg.tool_repair else {}
        if not tools:
            return await self._post_chat(url, body, headers)
        started = time.perf_counter()
        first: tuple[Repair, ...] = ()
        try:
            reply = await self._post_chat(url, body, headers)
        except UpstreamError as exc:
            if not is_tool_parse_failure(exc.upstream_status or 0, exc.message):
                raise
            first = (retried_without_parsing(exc.message),)
            reply = await self._post_chat(url, orjson.dumps(without_tool_parsing(request)), headers)
        fixed = repair_completion(reply.data, tools)
        repairs = first + fixed.repairs
        if not repairs:
            return reply
        raw = reply.raw if fixed.data is reply.data else orjson.dumps(fixed.data)
        return UpstreamReply(raw, fixed.data, time.perf_counter() - started, repairs)

    async def _post_chat(self, url: str | URL, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        return await self._post(url, body, headers, _has_message, "a chat completion (no choices[0].message)")

    async def respond(self, body: bytes, headers: Mapping[str, str], model: str = "") -> UpstreamReply:
        """POST a non-streamed Responses-API request (to its responses path), checked."""
        return await self._post(self.url("responses", model), body, headers, _has_output,
                                "a response (no output array)")

    async def embed(self, body: bytes, headers: Mapping[str, str], model: str = "") -> UpstreamReply:
        """POST an embeddings request (to its embeddings path) and return the answer, checked."""
        return await self._post(self.url("embeddings", model), body, headers, _has_data,
                                "an embeddings list (no data array)")

    async def _post(self, url: str | URL, body: bytes, headers: Mapping[str, str],
                    valid: Callable[[dict[str, Any]], bool], shape: str) -> UpstreamReply:
        started = time.perf_counter()
        self._calls += 1
        try:
            async with self._request("POST", url, data=body, headers=headers, timeout=self._plain_timeout) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("retry-after-ms"), resp.headers.get("retry-after")
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise self._timed_out(exc, "no complete answer") from None
        except aiohttp.ClientPayloadError as exc:
            raise UpstreamError("upstream_cut", f"upstream '{self.name}' cut its answer: {connection_problem(exc)}",
                                self.name) from None
        except UNREACHABLE as exc:
            raise self._unreachable(exc) from None
        finally:
            self._call_ended()
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
    async def stream(self, body: bytes, headers: Mapping[str, str], endpoint: Endpoint = "chat",
                     model: str = "") -> AsyncIterator[UpstreamStream]:
        """POST a streamed chat completion (or, with `endpoint` responses, a streamed
        response); errors before the first byte raise here."""
        url = self.url(endpoint, model)
        if self.config.max_tokens is not None and endpoint == "chat":
            body = orjson.dumps(capped(orjson.loads(body), self.config.max_tokens))
        self._calls += 1
        try:
            resp = await self._request("POST", url, data=body, headers=headers, timeout=self._stream_timeout)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            self._call_ended()
            raise self._timed_out(exc, "no response headers") from None
        except UNREACHABLE as exc:
            self._call_ended()
            raise self._unreachable(exc) from None
        except BaseException:
            self._call_ended()
            raise
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
            self._call_ended()

    async def list_models(self, timeout_s: float) -> list[str]:
        """The model names the upstream lists at its models path (`GET {base_url}/models`, the
        OpenAI list shape), at most MAX_MODELS of them from at most MAX_MODELS_BYTES; an
        UpstreamError when it cannot be asked or answers something else."""
        url = self.url("models")
        headers = self.headers()
        del headers["Content-Type"]
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.config.connect_timeout_s))
        self._calls += 1
        try:
            async with self._request("GET", url, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise self._status_error(resp.status, await resp.content.read(4096))
                if (resp.content_length or 0) > MAX_MODELS_BYTES:
                    raise self._malformed(f"its model list is larger than {MAX_MODELS_BYTES} bytes")
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    raw += chunk
                    if len(raw) > MAX_MODELS_BYTES:
                        raise self._malformed(f"its model list is larger than {MAX_MODELS_BYTES} bytes")
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise self.timeout("its model list", timeout_s) from None
        except UNREACHABLE as exc:
            raise self._unreachable(exc) from None
        finally:
            self._call_ended()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise self._malformed("its model list is not JSON") from None
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise self._malformed("its model list has no data array")
        names: list[str] = []
        for item in items:
            name = item.get("id") if isinstance(item, dict) else None
            if (isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME and name.isprintable()
                    and name not in names):
                names.append(name)
                if len(names) == MAX_MODELS:
                    break
        return names

    def parse(self, reply: UpstreamReply) -> ParsedReply:
        """Choice 0 of a reply, checked (`gateway.providers.reply`): 502 upstream_malformed
        naming the field when it is not a usable chat completion."""
        try:
            return parse_completion(reply.data)
        except MalformedReply as exc:
            raise UpstreamError("upstream_malformed", f"upstream '{self.name}' returned a malformed reply: "
                                f"{exc}", self.name, 200) from None

    def _unreachable(self, exc: BaseException) -> UpstreamError:
        problem = connection_problem(exc)
        if self._tls and _dropped(exc):  # TLS 1.3 refuses a client certificate after the handshake: no words
            problem += ("; an HTTPS server that wants a client certificate refuses a missing or untrusted one so "
                        "(tls.cert_file, tls.key_file)")
        return UpstreamError("upstream_unreachable", f"upstream '{self.name}' is unreachable: {problem}", self.name)

    def _malformed(self, detail: str) -> UpstreamError:
        return UpstreamError("upstream_malformed", f"upstream '{self.name}' answered malformed: {detail}",
                             self.name, 200)

    def _status_error(self, status: int, raw: bytes,
                      retry_after: tuple[str | None, str | None] = (None, None)) -> UpstreamError:
        error = _error_object(raw)
        message = _error_message(raw, error)
        if status in (401, 403, 407, 429) or status >= 500:  # 407: its proxy wants credentials
            return UpstreamError("upstream_status", f"upstream '{self.name}' answered {status}: {message}",
                                 self.name, status, retry_after_s=retry_after_seconds(*retry_after))
        if error is not None and error.get("code") == "content_filter":
            return UpstreamError("content_filter", f"upstream '{self.name}' refused the request with its content "
                                 f"filter ({status}): {message}", self.name, status, detail=_filter_detail(error))
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


def _error_object(raw: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-shaped error body, if it is one."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else None


def _filter_detail(error: Mapping[str, Any]) -> dict[str, Any]:
    """What a content-filter refusal passes on to the client: its `param` and `innererror`
    (Azure's content_filter_result), as the upstream gave them, when small enough."""
    out: dict[str, Any] = {}
    if isinstance(error.get("param"), str) and len(error["param"]) <= MAX_MODEL_NAME:
        out["param"] = error["param"]
    inner = error.get("innererror")
    if isinstance(inner, dict) and len(orjson.dumps(inner)) <= MAX_ERROR_DETAIL:
        out["innererror"] = inner
    return out


def _error_message(raw: bytes, error: Mapping[str, Any] | None = None) -> str:
    """The upstream's own words: error.message of an OpenAI-shaped body, else the text."""
    if error is not None and error.get("message"):
        return str(error["message"])
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
