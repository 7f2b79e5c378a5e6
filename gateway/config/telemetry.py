"""`telemetry:` (OpenTelemetry traces over OTLP/HTTP) and `access_log:` (one line per request).

Both are read here, validated like the rest of the config (a bad value is one line naming
the field path, exit 2), and documented in docs/config.md and docs/telemetry.md.

- `telemetry` is off unless `otlp_endpoint` is set. `headers_env` names a variable holding
  the exporter's headers (`key=value,key2=value2`, the form of OTEL_EXPORTER_OTLP_HEADERS;
  values URL-decoded): it must be set at start, and its values (tokens) never leave the
  exporter. `sample_ratio` samples new traces (a client's sampled flag decides for its own).
- `access_log` is on by default, as JSON lines on stderr; `file` writes them to a file
  rotated past `max_mb` instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from gateway.config.fields import Field

AccessLogFormat = Literal["json", "logfmt"]
ACCESS_LOG_FORMATS: tuple[AccessLogFormat, ...] = ("json", "logfmt")
DEFAULT_SERVICE_NAME = "gateway"
DEFAULT_CONTENT_MAX_CHARS = 4096
MAX_RESOURCE_ATTRIBUTES = 64
MAX_HEADERS = 32
TRACES_PATH = "/v1/traces"
DEFAULT_EXCLUDED_ROUTES = ("/healthz", "/livez", "/readyz", "/metrics")
"""Routes the access log leaves out unless `exclude_routes` says otherwise: probes and scrapes,
which would outnumber every other line."""
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")


@dataclass(frozen=True)
class TelemetryConfig:
    """`telemetry:`; `otlp_endpoint` None means tracing is off. Each field is named as in the
    file, so a reload names a changed one by its path (`telemetry.otlp_endpoint`)."""

    otlp_endpoint: str | None = None
    """Where spans are POSTed (the configured address, with `/v1/traces` added to a bare host)."""
    headers_env: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)  # read from headers_env
    service_name: str = DEFAULT_SERVICE_NAME
    sample_ratio: float = 1.0
    resource: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    capture_content: bool = False
    content_max_chars: int = DEFAULT_CONTENT_MAX_CHARS

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


@dataclass(frozen=True)
class AccessLogConfig:
    """`access_log:`: one structured line per request, on stderr or in a rotated file."""

    enabled: bool = True
    format: AccessLogFormat = "json"
    file: Path | None = None
    max_mb: float = 100.0
    keep: int = 5
    exclude_routes: frozenset[str] = frozenset(DEFAULT_EXCLUDED_ROUTES)


def parse_telemetry(at: Field) -> TelemetryConfig:
    """Validate `telemetry:` (absent or null: off)."""
    if at.missing or at.value is None:
        return TelemetryConfig()
    at.keys_only({"otlp_endpoint", "headers_env", "service_name", "sample_ratio", "resource", "capture_content",
                  "content_max_chars"})
    endpoint = _endpoint(at.get("otlp_endpoint"))
    headers_env = at.get("headers_env").optional_str_or_none()
    headers: dict[str, str] = {}
    if headers_env is not None:
        raw = os.environ.get(headers_env)
        if raw is None:
            at.get("headers_env").fail(f"environment variable {headers_env} is not set (it should hold the "
                                       "exporter's headers, e.g. 'authorization=Bearer%20TOKEN,x-team=ops')")
        headers = _headers(at.get("headers_env"), headers_env, raw)
    ratio_at = at.get("sample_ratio")
    ratio = ratio_at.optional_number(1.0, nonnegative=True)
    if ratio > 1:
        ratio_at.invalid(f"must be from 0 to 1 (the share of new traces recorded), got {ratio:g}")
        ratio = 1.0
    return TelemetryConfig(
        otlp_endpoint=endpoint, headers_env=headers_env, headers=headers,
        service_name=at.get("service_name").optional_str(DEFAULT_SERVICE_NAME),
        sample_ratio=ratio, resource=_resource(at.get("resource")),
        capture_content=at.get("capture_content").optional_bool(False),
        content_max_chars=at.get("content_max_chars").optional_int(DEFAULT_CONTENT_MAX_CHARS, low=1,
                                                                     high=1_000_000),
    )


def _endpoint(at: Field) -> str | None:
    raw = at.optional_str_or_none()
    if raw is None:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        at.fail(f"must be an http:// or https:// URL of an OTLP/HTTP receiver (e.g. http://127.0.0.1:4318), "
                f"without a query, got {raw!r}")
    try:
        parts.port  # noqa: B018 (a port out of range raises)
    except ValueError:
        at.fail(f"has a port that is not one (1 to 65535), got {raw!r}")
    if parts.path in ("", "/"):
        return raw.rstrip("/") + TRACES_PATH
    return raw


def _headers(at: Field, name: str, raw: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = unquote(key.strip())
        if not sep or not _HEADER_NAME.match(key):
            # never the value: it is a secret
            at.fail(f"environment variable {name} must hold 'name=value' pairs separated by commas; an item "
                    f"{'has no =' if not sep else 'has a name that is not an HTTP header name'}")
        headers[key] = unquote(value.strip())
    if len(headers) > MAX_HEADERS:
        at.fail(f"environment variable {name} holds more than {MAX_HEADERS} headers")
    return headers


def _resource(at: Field) -> dict[str, str | int | float | bool]:
    out: dict[str, str | int | float | bool] = {}
    items = at.mapping()
    if len(items) > MAX_RESOURCE_ATTRIBUTES:
        at.fail(f"has {len(items)} attributes; at most {MAX_RESOURCE_ATTRIBUTES}")
    for key, value in items.items():
        where = at.get(str(key))
        if not isinstance(key, str) or not key.strip() or len(key) > 255:
            where.fail("must be named by a non-empty string of at most 255 characters")
        if not isinstance(value, (str, int, float, bool)) or (isinstance(value, str) and len(value) > 4096):
            where.fail("must be a string (at most 4096 characters), a number or true/false")
        out[key] = value
    return out


def parse_access_log(at: Field, base: Path) -> AccessLogConfig:
    """Validate `access_log:` (absent: on, JSON, stderr; `false`: off)."""
    if at.missing:
        return AccessLogConfig()
    if at.value is False or at.value is None:
        return AccessLogConfig(enabled=False)
    at.keys_only({"enabled", "format", "file", "max_mb", "keep", "exclude_routes"})
    file = at.get("file").optional_str_or_none()
    exclude_at = at.get("exclude_routes")
    exclude = frozenset(DEFAULT_EXCLUDED_ROUTES)
    if not exclude_at.missing and exclude_at.value is not None:
        routes = []
        for item in exclude_at.list_of():
            route = item.nonempty_str()
            if not route.startswith("/"):
                item.fail(f"must be a route template starting with / (e.g. /metrics), got {route!r}")
            routes.append(route)
        exclude = frozenset(routes)
    return AccessLogConfig(
        enabled=at.get("enabled").optional_bool(True),
        format=at.get("format").choice(ACCESS_LOG_FORMATS, "json"),
        file=base / file if file else None,
        max_mb=at.get("max_mb").optional_number(100.0, positive=True),
        keep=at.get("keep").optional_int(5, low=0, high=1000),
        exclude_routes=exclude,
    )
