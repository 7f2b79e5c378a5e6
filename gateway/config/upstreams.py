"""`upstreams:` of config.yaml: where calls go and how they get there.

    upstreams:
      - name: azure-east
        kind: azure                              # a preset: api-key header, api-version, deployment paths
        base_url: https://NAME.openai.azure.com
        api_key_env: AZURE_OPENAI_API_KEY
      - name: internal
        base_url: https://llm.corp.example/v1
        api_key_env: INTERNAL_KEY
        auth: {kind: header, name: X-Api-Key}    # bearer (default) | header | none
        headers: {X-Tenant: research, X-Secret: {env: TENANT_SECRET, required: true}}
        query: {tenant: research}
        path: {chat: /chat/completions, embeddings: /embeddings, responses: /responses, models: /models}
        tls: {ca_file: ./certs/ca.pem, cert_file: ./certs/gw.pem, key_file: ./certs/gw.key}
        proxy: http://proxy.corp.example:3128    # else HTTPS_PROXY / HTTP_PROXY unless NO_PROXY; false: never
        discover_models: true                    # GET /v1/models lists what it serves at {base_url}/models

What reading the config cannot check without making `gateway trace` or `gateway prune`
fail for an operator who may not read the gateway's key files (TLS files, variables marked
`required`) is checked by `require_upstreams` when the gateway is built to serve. Every
error is a ConfigError naming the field (docs/config.md, docs/upstreams.md).
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import ssl
import string
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

from gateway.config.fields import ConfigError, Field

__all__ = ["Auth", "EnvValue", "Paths", "TlsConfig", "UpstreamConfig", "UpstreamKind", "parse_upstreams",
           "require_upstreams"]

UpstreamKind = Literal["scripted", "openai", "local", "azure"]
UpstreamApi = Literal["chat", "responses"]
AuthKind = Literal["bearer", "header", "none"]
Endpoint = Literal["chat", "embeddings", "responses", "models"]

DEFAULT_UPSTREAM_TIMEOUT_S: Final = 60.0
LOCAL_TIMEOUT_S: Final = 180.0
"""A `local` upstream's per-call deadline unless `timeout_s` says otherwise (a CPU model's
capped answer fits well inside it, even on a loaded machine)."""
LOCAL_MAX_TOKENS: Final = 512
"""A `local` upstream's `max_tokens` cap unless `max_tokens` says otherwise."""
DEFAULT_CONNECT_TIMEOUT_S: Final = 10.0
AZURE_API_VERSION: Final = "2024-10-21"
"""The `api-version` of a `kind: azure` upstream unless `api_version` says otherwise (the GA
version of Azure OpenAI's data plane when this was written)."""
AZURE_RESPONSES_SINCE: Final = "2025-03-01-preview"
"""The first `api-version` of Azure's `/openai/responses`: Azure answers an older dated one
400 ("Responses API is enabled only for api-version 2025-03-01-preview and later")."""
MAX_HEADERS: Final = 50
MAX_QUERY: Final = 50
MAX_VALUE: Final = 8192
PLACEHOLDERS: Final = frozenset({"model", "deployment"})
"""What a `path` may name: both are the model name the upstream is asked for (a route's
`deployments[].model`, else the client's), URL-quoted."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 token)."""
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
"""What a URL written in its encoded form may hold (no spaces, quotes, braces or controls)."""
GATEWAY_HEADERS: Final = frozenset({"host", "content-type", "content-length", "transfer-encoding", "connection",
                                    "keep-alive", "te", "trailer", "upgrade", "expect", "proxy-authorization",
                                    "proxy-connection"})
"""Headers the gateway or the HTTP connection own: `headers` may not set them."""


@dataclass(frozen=True)
class EnvValue:
    """A header value read from the environment at call time (`{env: NAME}`): a secret never
    written in the config. `required`: a missing variable stops the start instead of one call."""

    env: str
    required: bool = False


HeaderValue = str | EnvValue


@dataclass(frozen=True)
class Auth:
    """How the key of `api_key_env` is sent: `bearer` (`Authorization: Bearer <key>`, the
    default), `header` (the key alone in header `header`, e.g. Azure's `api-key`) or `none`."""

    kind: AuthKind = "bearer"
    header: str = "Authorization"
    required: bool = False
    """The key's variable must be set at start (else a missing one fails each call)."""

    @property
    def prefix(self) -> str:
        return "Bearer " if self.kind == "bearer" else ""


@dataclass(frozen=True)
class Paths:
    """Where each API is, under `base_url`; `{model}` / `{deployment}` are replaced per call.
    `models` None: the upstream has no model list (discovery cannot be turned on)."""

    chat: str = "/chat/completions"
    embeddings: str = "/embeddings"
    responses: str = "/responses"
    models: str | None = "/models"

    def of(self, endpoint: Endpoint) -> str | None:
        path: str | None = getattr(self, endpoint)
        return path


AZURE_PATHS: Final = Paths(chat="/openai/deployments/{deployment}/chat/completions",
                           embeddings="/openai/deployments/{deployment}/embeddings",
                           responses="/openai/responses", models=None)


@dataclass(frozen=True)
class TlsConfig:
    """`tls:`: a private CA (`ca_file`, replacing the system's CAs for this upstream), a client
    certificate for mutual TLS (`cert_file`, `key_file` unless the key is in `cert_file`),
    or `verify: false`. Paths are absolute (taken from the config file's folder)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    verify: bool = True
    where: tuple[str, str] = field(default=("", ""), compare=False, repr=False)
    """(config file, field path of this `tls`), for the errors of `context()`."""

    @functools.cached_property
    def _context(self) -> ssl.SSLContext:
        file, at = self.where
        if not self.verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif self.ca_file is not None:
            _readable(file, f"{at}.ca_file", self.ca_file)
            try:  # only this CA: a private CA replaces the system's for this upstream
                ctx = ssl.create_default_context(cafile=str(self.ca_file))
            except ssl.SSLError as exc:
                raise ConfigError(file, f"{at}.ca_file", f"{self.ca_file} holds no usable PEM certificate "
                                  f"({_reason(exc)})") from None
        else:
            ctx = ssl.create_default_context()
        if self.cert_file is not None:
            _readable(file, f"{at}.cert_file", self.cert_file)
            if self.key_file is not None:
                _readable(file, f"{at}.key_file", self.key_file)
            try:
                ctx.load_cert_chain(str(self.cert_file), str(self.key_file) if self.key_file else None)
            except ssl.SSLError as exc:
                why = _reason(exc)
                if why == "pem lib":  # OpenSSL's word for a PEM file without the part it looked for
                    why = "no PEM certificate and private key found" + ("" if self.key_file else "; give key_file")
                raise ConfigError(file, f"{at}.cert_file", f"cannot use {self.cert_file} "
                                  f"{'with ' + str(self.key_file) + ' ' if self.key_file else ''}as the client "
                                  f"certificate and key ({why})") from None
        return ctx

    def context(self) -> ssl.SSLContext:
        """The SSL context of this upstream's connections, made once; a ConfigError naming
        the field when a file cannot be read or used."""
        return self._context


def _readable(file: str, at: str, path: Path) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(file, at, f"cannot read {path}: {(exc.strerror or str(exc)).lower()}") from None


def _reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc).lower().replace("_", " ")


@dataclass(frozen=True)
class UpstreamConfig:
    """One upstream. A `scripted` upstream is this gateway's own /scripted/v1 mount. A
    `kind: azure` one is read as its preset (auth, query and paths filled in)."""

    name: str
    kind: UpstreamKind = "openai"
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    api: UpstreamApi = "chat"
    # Tool-call repair (gateway.providers.repair) of every reply, streamed or not; on by default for kind local.
    tool_repair: bool = False
    # The most completion tokens any call may ask for (lower asks pass unchanged); None: no cap.
    max_tokens: int | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    first_byte_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    auth: Auth = field(default_factory=Auth)
    headers: tuple[tuple[str, HeaderValue], ...] = field(default=(), repr=False)
    query: tuple[tuple[str, str], ...] = ()
    paths: Paths = field(default_factory=Paths)
    tls: TlsConfig | None = None
    proxy: str | None = field(default=None, repr=False)
    """The proxy its calls go through: `proxy` of the config, else the environment's (see
    `proxy_from`); None: direct. May hold credentials: never logged."""
    proxy_from: str | None = None
    """Where `proxy` came from: "proxy" (the config) or the variable's name (HTTPS_PROXY, ...)."""
    discover_models: bool = False

    def api_key(self) -> str | None:
        """Read at call time, so a missing variable fails the call, not the start."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @property
    def own_transport(self) -> bool:
        """Whether its connections differ from the shared session's (TLS settings, a proxy)."""
        return self.tls is not None or self.proxy is not None


def parse_upstreams(section: Field, base: Path) -> dict[str, UpstreamConfig]:
    """`upstreams:` read and checked; relative TLS paths are taken from `base`."""
    out: dict[str, UpstreamConfig] = {}

    def one(at: Field) -> None:  # with a sink, an entry with an error does not hide the next one's
        upstream = _upstream(at, base)
        if upstream.name in out:
            at.get("name").invalid(f"upstream '{upstream.name}' is defined twice")
        out[upstream.name] = upstream

    section.required().each(one)
    if not out and not section.value:
        section.fail("at least one upstream is required")
    return out


def require_upstreams(file: str, upstreams: Mapping[str, UpstreamConfig]) -> None:
    """What serving needs and reading the config does not: every TLS file readable and usable,
    every variable marked `required` set; else a ConfigError naming the field."""
    for i, u in enumerate(upstreams.values()):
        at = f"upstreams[{i}]"
        if u.tls is not None:
            u.tls.context()
        if u.proxy is not None and u.proxy_from != "proxy":
            problem = proxy_problem(u.proxy)
            if problem:
                raise ConfigError(file, f"{at}.proxy", f"is not set, so the environment's {u.proxy_from} applies, "
                                  f"but it {problem.replace('must', 'should')}; fix it, or set proxy: false for "
                                  "this upstream")
        if u.auth.required and u.api_key_env and not os.environ.get(u.api_key_env):
            raise ConfigError(file, f"{at}.api_key_env", f"environment variable {u.api_key_env} is not set "
                              "(auth.required: true; it should hold the upstream's key)")
        for name, value in u.headers:
            if isinstance(value, EnvValue) and value.required and not os.environ.get(value.env):
                raise ConfigError(file, f"{at}.headers.{name}", f"environment variable {value.env} is not set "
                                  "(required: true)")


def _upstream(at: Field, base: Path) -> UpstreamConfig:
    at.keys_only({"name", "kind", "base_url", "api_key_env", "timeout_s", "api", "connect_timeout_s",
                  "first_byte_timeout_s", "tool_repair", "max_tokens", "auth", "headers", "query", "path",
                  "api_version", "tls", "proxy", "discover_models"})
    name = at.get("name").required().nonempty_str()
    kind: UpstreamKind = at.get("kind").choice(("scripted", "openai", "local", "azure"), "openai")
    local, azure = kind == "local", kind == "azure"
    base_url = _base_url(at.get("base_url"), kind)
    timeout = at.get("timeout_s").optional_number(LOCAL_TIMEOUT_S if local else DEFAULT_UPSTREAM_TIMEOUT_S,
                                                  positive=True)
    auth, key_env = _auth(at, azure)
    query = _query(at.get("query"))
    version_at = at.get("api_version")
    api: UpstreamApi = at.get("api").choice(("chat", "responses"), "chat")
    if azure:
        if any(k.lower() == "api-version" for k, _ in query):
            at.get("query").fail("kind azure sets api-version from api_version; give it there")
        version = _text(version_at, AZURE_API_VERSION)
        dated = re.match(r"\d{4}-\d{2}-\d{2}", version)
        if api == "responses" and dated is not None and dated.group() < AZURE_RESPONSES_SINCE[:10]:
            version_at.fail(f"api: responses needs api_version {AZURE_RESPONSES_SINCE} or later (Azure answers "
                            f"/openai/responses 400 for an older one), got '{version}'"
                            + (" (the default)" if version_at.missing else ""))
        query = (("api-version", version), *query)
    elif not version_at.missing:
        version_at.fail(f"is for kind azure; for a {kind} upstream add it to query (query: {{api-version: ...}})")
    paths = _paths(at.get("path"), AZURE_PATHS if azure else Paths())
    discover_at = at.get("discover_models")
    discover = discover_at.optional_bool(False)
    if discover and paths.models is None:
        discover_at.fail("kind azure lists base models, not your deployments; set path.models if this upstream "
                         "has a list of the names it serves")
    tls = _tls(at.get("tls"), base, base_url)
    proxy, proxy_from = _proxy(at.get("proxy"), base_url)
    return UpstreamConfig(
        name=name, kind=kind, base_url=base_url, api_key_env=key_env, timeout_s=timeout,
        api=api,
        connect_timeout_s=min(timeout, at.get("connect_timeout_s").optional_number(DEFAULT_CONNECT_TIMEOUT_S,
                                                                                   positive=True)),
        first_byte_timeout_s=min(timeout, at.get("first_byte_timeout_s").optional_number(timeout, positive=True)),
        tool_repair=at.get("tool_repair").optional_bool(local),
        max_tokens=_max_tokens(at.get("max_tokens"), LOCAL_MAX_TOKENS if local else None),
        auth=auth, headers=_headers(at.get("headers"), auth), query=query, paths=paths, tls=tls,
        proxy=proxy, proxy_from=proxy_from, discover_models=discover,
    )


def _base_url(at: Field, kind: UpstreamKind) -> str | None:
    url = at.optional_str_or_none()
    if url is None:
        if kind != "scripted":
            example = "https://NAME.openai.azure.com" if kind == "azure" else "http://127.0.0.1:8081/v1"
            at.fail(f"is required for an upstream of kind {kind} (e.g. {example})")
        return None
    if not url.startswith(("http://", "https://")):
        at.fail(f"must start with http:// or https://, got {url!r}")
    parts = urlsplit(url)
    if not parts.hostname or parts.query or parts.fragment or "?" in url or "#" in url:
        at.fail(f"must be a URL with a host and no query or fragment (give query parameters in query:), got {url!r}")
    if not _URL_CHARS.fullmatch(url):
        at.fail(f"must be written URL-encoded (no spaces, quotes or braces), got {url!r}")
    url = url.rstrip("/")
    if kind == "azure" and url.endswith("/openai"):
        at.fail("is the resource's endpoint without /openai (https://NAME.openai.azure.com): the preset adds the "
                "/openai/deployments/... paths")
    return url


def _text(at: Field, default: str) -> str:
    """A string value; a YAML date or number gets a hint to quote it."""
    if at.missing or at.value is None:
        return default
    if isinstance(at.value, (datetime.date, int, float)) and not isinstance(at.value, bool):
        at.fail(f"must be a string; quote it (\"{at.value}\")")
    value = at.nonempty_str()
    if len(value) > MAX_VALUE or any(c in value for c in "\r\n\0"):
        at.fail(f"must be at most {MAX_VALUE} characters with no line breaks")
    return value


def _env_name(at: Field) -> str:
    name = at.nonempty_str()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        at.fail(f"must be an environment variable name (letters, digits, '_'), got {name!r}")
    return name


def _auth(at: Field, azure: bool) -> tuple[Auth, str | None]:
    """`auth:` and the key's variable (`api_key_env`, at the top or inside `auth`)."""
    auth_at = at.get("auth")
    auth_at.keys_only({"kind", "name", "api_key_env", "required"})
    kind: AuthKind = auth_at.get("kind").choice(("bearer", "header", "none"), "header" if azure else "bearer")
    top, inner = at.get("api_key_env"), auth_at.get("api_key_env")
    if not top.missing and not inner.missing:
        inner.fail("is given twice (also api_key_env of the upstream); give it once")
    key_at = inner if not inner.missing else top
    key_env = _env_name(key_at) if not key_at.missing and key_at.value is not None else None
    name_at = auth_at.get("name")
    if kind == "header":
        header = "api-key" if name_at.missing and azure else name_at.required().nonempty_str()
        if not _TOKEN.fullmatch(header) or header.lower() in GATEWAY_HEADERS:
            name_at.fail(f"must be a header name the gateway does not set itself, got {header!r}")
    elif not name_at.missing:
        name_at.fail(f"is for auth kind header (kind {kind} sends "
                     f"{'no key' if kind == 'none' else 'Authorization: Bearer <key>'})")
    else:
        header = "Authorization"
    if kind == "none" and key_env is not None:
        key_at.fail("auth kind none sends no key; remove api_key_env or pick auth kind bearer or header")
    if azure and kind != "none" and key_env is None:
        top.fail("is required for kind azure (the variable holding the resource's key), unless auth: {kind: none}")
    required = auth_at.get("required").optional_bool(False)
    if required and key_env is None:
        auth_at.get("required").fail("needs api_key_env (the variable that must be set)")
    return Auth(kind, header, required), key_env


def _headers(at: Field, auth: Auth) -> tuple[tuple[str, HeaderValue], ...]:
    items = at.mapping()
    if len(items) > MAX_HEADERS:
        at.fail(f"at most {MAX_HEADERS} headers")
    out: list[tuple[str, HeaderValue]] = []
    for name in items:
        h = at.get(name)
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            h.fail(f"is not a valid header name, got {name!r}")
        lower = name.lower()
        if lower in GATEWAY_HEADERS:
            h.fail("is set by the gateway or the connection; it cannot be configured")
        if auth.kind != "none" and lower == auth.header.lower():
            h.fail(f"is where auth sends the key ({auth.kind}); set auth: {{kind: none}} to send your own")
        if any(lower == seen.lower() for seen, _ in out):
            h.fail("is given twice (header names are case-insensitive)")
        if isinstance(h.value, dict):
            h.keys_only({"env", "required"})
            out.append((name, EnvValue(_env_name(h.get("env").required()), h.get("required").optional_bool(False))))
        else:
            out.append((name, _text(h.required(), "")))
    return tuple(out)


def _query(at: Field) -> tuple[tuple[str, str], ...]:
    items = at.mapping()
    if len(items) > MAX_QUERY:
        at.fail(f"at most {MAX_QUERY} parameters")
    out: list[tuple[str, str]] = []
    for name in items:
        if not isinstance(name, str) or not name.strip():
            at.fail(f"parameter names must be non-empty strings, got {name!r}")
        out.append((name, _text(at.get(name).required(), "")))
    return tuple(out)


def _path(at: Field, default: str | None, placeholders: bool = True) -> str | None:
    if at.missing:
        return default
    if at.value is None:
        return None
    path = at.nonempty_str()
    if not path.startswith("/") or "?" in path or "#" in path:
        at.fail(f"must start with / and hold no query or fragment (give those in query:), got {path!r}")
    try:
        names = {n for _, n, spec, conv in string.Formatter().parse(path) if n is not None or spec or conv}
    except ValueError:
        at.fail(f"has an unmatched brace: {path!r}")
    allowed = PLACEHOLDERS if placeholders else frozenset()
    if not names <= allowed:
        at.fail(f"may name {', '.join('{' + p + '}' for p in sorted(allowed)) or 'no placeholder'}, "
                f"got {', '.join(sorted(str(n) for n in names - allowed))}")
    if not _URL_CHARS.fullmatch(re.sub(r"\{(model|deployment)\}", "", path)):
        at.fail(f"must be written URL-encoded (no spaces or quotes), got {path!r}")
    return path


def _paths(at: Field, preset: Paths) -> Paths:
    """`path: /chat/path` (the chat path) or `path: {chat, embeddings, responses, models}`."""
    if at.missing:
        return preset
    if isinstance(at.value, str):
        chat = _path(at, preset.chat)
        assert chat is not None
        return Paths(chat, preset.embeddings, preset.responses, preset.models)
    at.keys_only({"chat", "embeddings", "responses", "models"})
    def one(key: str, default: str) -> str:
        got = _path(at.get(key), default)
        if got is None:
            at.get(key).fail("must be a path (only models may be null)")
        return got

    return Paths(one("chat", preset.chat), one("embeddings", preset.embeddings), one("responses", preset.responses),
                 _path(at.get("models"), preset.models, placeholders=False))


def _tls(at: Field, base: Path, base_url: str | None) -> TlsConfig | None:
    if at.missing or at.value is None:
        return None
    at.keys_only({"ca_file", "cert_file", "key_file", "verify"})
    if base_url is None or not base_url.startswith("https://"):
        at.fail("applies to an https:// base_url")

    def path(key: str) -> Path | None:
        value = at.get(key).optional_str_or_none()
        return base / value if value else None

    tls = TlsConfig(path("ca_file"), path("cert_file"), path("key_file"), at.get("verify").optional_bool(True),
                    where=(at.file, at.path))
    if tls.key_file is not None and tls.cert_file is None:
        at.get("key_file").fail("needs cert_file (the client certificate the key belongs to)")
    if not tls.verify and tls.ca_file is not None:
        at.get("verify").fail("false turns checking off; a ca_file would not be used: give one or the other")
    if tls == TlsConfig():
        return None  # all defaults: the shared session's connections are the same
    return tls


def _proxy(at: Field, base_url: str | None) -> tuple[str | None, str | None]:
    """The proxy of an upstream: `proxy` (a URL, or false for none) wins over the environment;
    without it, HTTPS_PROXY (or HTTP_PROXY for an http:// base_url) unless NO_PROXY names the host."""
    if base_url is None:  # this process's own mount
        if not at.missing and at.value not in (None, False):
            at.fail("needs a base_url (the scripted mount is this process itself)")
        return None, None
    if at.value is False:
        return None, None
    if not at.missing and at.value is not None:
        url = at.nonempty_str()
        problem = proxy_problem(url)
        if problem:
            at.fail(problem)
        return url, "proxy"
    scheme = urlsplit(base_url).scheme
    proxies = urllib.request.getproxies_environment()
    from_env = proxies.get(scheme)
    host = urlsplit(base_url).netloc.rpartition("@")[2]
    # urllib's reading of NO_PROXY (the one aiohttp's trust_env uses); not in typeshed
    if not from_env or urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return None, None
    variable = next((v for v in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY") if os.environ.get(v) == from_env),
                    f"{scheme.upper()}_PROXY")
    return from_env, variable  # checked by require_upstreams: reading the config must not fail on the environment


def proxy_problem(url: str) -> str | None:
    """What is wrong with a proxy URL (never echoing it: it may hold a password), or None."""
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        return "must be an http:// or https:// proxy URL with a valid port"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// proxy URL (got a {parts.scheme or 'scheme-less'} one)"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "must be an http:// or https:// proxy URL without a path"
    return None


def _max_tokens(at: Field, default: int | None) -> int | None:
    """`max_tokens`: a whole number >= 1, or null for no cap."""
    if at.missing:
        return default
    if at.value is None:
        return None
    return at.optional_int(1, low=1, high=1_000_000)
