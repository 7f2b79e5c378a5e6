"""HTTP errors, each rendered in the OpenAI shape `{"error": {message, type, code, param}}`.

Handlers raise; one middleware renders. The tree (HTTP status, `error.type`):

    ApiError                         any status, any type (the base: renders itself)
    ├── BadRequest                   400 invalid_request_error
    │   ├── InvalidJSON              400  code invalid_json
    │   ├── InvalidField             400  code invalid_type | missing_field | invalid_value, param = field
    │   └── PolicyMismatch           400  code policy_mismatch (X-Policy differs from the run's)
    ├── Unauthorized                 401 authentication_error, code invalid_api_key
    ├── Forbidden                    403 permission_error, code policy_not_allowed
    ├── NotFound                     404 not_found_error, code model_not_found | run_not_found | route_not_found
    ├── MethodNotAllowed             405 invalid_request_error
    ├── RequestTimeout               408 invalid_request_error, code header_timeout | body_timeout
    │                                    (the client sent its request too slowly; the connection closes)
    ├── Conflict                     409 conflict_error (a run that cannot take calls now;
    │                                    x-should-retry: false, but true on run_busy)
    ├── PayloadTooLarge              413 invalid_request_error, code body_too_large
    ├── ClientLeft                   499 client_closed_request, code client_disconnected (nginx's
    │                                    499: the client closed its connection first; nobody reads it)
    ├── LimitExceeded                429 max_turns_exceeded | budget_exceeded | team_budget_exceeded
    │   │                                | key_budget_exceeded | user_budget_exceeded | max_duration_exceeded
    │   │                                (+ header x-should-retry: false, + top-level `run`)
    │   └── LimitApprovalPending     429 limit_approval_pending: a limit that asks a person
    │                                    waits for a grant (`kind`: the limit's own refusal)
    ├── RateLimited                  429 requests | tokens | in_flight, code rate_limit_exceeded
    │                                    (+ retry-after, retry-after-ms, x-ratelimit-*,
    │                                    x-should-retry: true; false for a call too large
    │                                    for the limit)
    ├── UpstreamFailed               502 upstream_error | 504 upstream_timeout | the upstream's 4xx
    │                                    (from providers.errors.UpstreamError, + `upstream`;
    │                                    + retry-after(-ms) when the upstream asked for a wait;
    │                                    code content_filter: + param, innererror as the upstream gave)
    ├── StoreUnavailable             503 server_error, code store_unavailable
    │                                    (+ headers retry-after, x-should-retry: true)
    ├── Overloaded                   503 server_error, code too_many_connections
    │                                    (+ headers retry-after, x-should-retry: true; the connection closes)
    └── InternalError                500 server_error

A `StoreError` that reaches the middleware is answered by `from_store_error`: a store
that failed or timed out is 503 `store_unavailable` (retryable: nothing was forwarded
upstream, since admission writes to the store first); a refusal of the store about one
run is 409 `run_conflict` (saved meanwhile by someone else, or exists) or 404
`run_not_found` (deleted meanwhile).

Every error carries the run headers when a run is known (the middleware adds them).
Requests aiohttp refuses before routing get the same shape from gateway.server.http.listener:
431 `headers_too_large`, 400 `invalid_body` (an unreadable Content-Encoding) or
`invalid_http_request`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from aiohttp import web

from gateway.harness.state import Interruption, InterruptionType, Status, public_run_id
from gateway.providers.errors import UpstreamError
from gateway.store.errors import LeaseLost, RunExists, RunNotFound, SpoolNotReady, StaleRun, StoreError

log = logging.getLogger(__name__)

LimitKind = Literal["max_turns_exceeded", "budget_exceeded", "team_budget_exceeded", "key_budget_exceeded",
                    "user_budget_exceeded", "max_duration_exceeded"]

_LIMIT_STOPS: dict[str, tuple[Status, str, InterruptionType]] = {
    "max_turns_exceeded": ("max_turns_exceeded", "max_turns", "max_turns"),
    "budget_exceeded": ("budget_exceeded", "max_budget", "max_budget"),
    "team_budget_exceeded": ("budget_exceeded", "team_budget", "max_budget"),
    "key_budget_exceeded": ("budget_exceeded", "key_budget", "max_budget"),
    "user_budget_exceeded": ("budget_exceeded", "user_budget", "max_budget"),
    "max_duration_exceeded": ("max_duration_exceeded", "max_duration", "max_duration"),
}


def limit_stop(kind: LimitKind) -> tuple[Status, str, Interruption]:
    """The status, reason and interruption a run takes when a limit refuses its call (the
    one mapping, for pass-through refusals and server-side runs alike)."""
    status, reason, interruption = _LIMIT_STOPS[kind]
    return status, reason, Interruption(interruption)


class ApiError(Exception):
    """An error answered to the client; subclasses fix the status and type."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 status: int | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers: dict[str, str] = dict(headers or {})
        self.extra: dict[str, Any] = {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}
        }
        out.update(self.extra)
        return out

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        merged = dict(self.headers)
        if headers:
            merged.update(headers)
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=merged)


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class InvalidJSON(BadRequest):
    def __init__(self, detail: str) -> None:
        super().__init__(f"request body is not valid JSON: {detail}", code="invalid_json")


class InvalidField(BadRequest):
    """A field of the request is missing, of the wrong type or out of range; `param` names it."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message, code=code, param=param)


class PolicyMismatch(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="policy_mismatch", param="X-Policy")


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"


class Conflict(ApiError):
    """The run cannot take this call now. SDKs retry a 409 unless told not to: the header
    says whether a retry can succeed (false unless the raiser says otherwise)."""

    status = 409
    type = "conflict_error"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("x-should-retry", "false")


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, limit: int, size: int | None = None) -> None:
        got = f" ({size} bytes)" if size is not None else ""
        super().__init__(f"request body is too large{got}: the limit is {limit} bytes (server.max_body_bytes)",
                         code="body_too_large")


class ClientLeft(ApiError):
    """The client closed its connection while the call waited for its upstream
    (`gateway.server.http.leaving`): the upstream call was stopped. Answered 499 for the
    log and `gateway_requests_total`; nobody is there to read it."""

    status = 499
    type = "client_closed_request"

    def __init__(self, message: str = "the client closed its connection before the answer") -> None:
        super().__init__(message, code="client_disconnected")


class LimitExceeded(ApiError):
    """A governed call refused before anything was forwarded: do not retry as is."""

    status = 429

    def __init__(self, kind: LimitKind, message: str, run: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, code=kind, type=kind, headers={"x-should-retry": "false"})
        self.kind: LimitKind = kind
        if run is not None:
            self.extra["run"] = dict(run)


class LimitApprovalPending(LimitExceeded):
    """A pass-through call refused because its run reached a limit that asks a person
    (`on_exceed: ask`) and waits for a grant: retrying as is cannot help until someone
    grants more. `kind` is the refusal the limit itself makes."""

    def __init__(self, kind: LimitKind, message: str) -> None:
        super().__init__(kind, message)
        self.code = self.type = "limit_approval_pending"


class RateLimited(ApiError):
    """A team's or key's rate limit refused the call before anything was forwarded: retry
    after `retry_after_s` (the headers say so, OpenAI's way). Always 429, unlike a
    LimitExceeded: the run goes on, and SDKs back off by themselves."""

    status = 429

    def __init__(self, kind: str, message: str, retry_after_s: float | None, headers: Mapping[str, str]) -> None:
        super().__init__(message, code="rate_limit_exceeded", type=kind, headers=headers)
        self.retry_after_s = retry_after_s
        """None: the call can never pass (larger than the limit)."""


class UpstreamFailed(ApiError):
    """An upstream failed (`providers.errors.UpstreamError`): 504 on a timeout, the upstream's
    own 4xx when it rejected the request, 502 otherwise; its name and status in `upstream`."""

    def __init__(self, exc: UpstreamError) -> None:
        if exc.code == "upstream_timeout":
            status = 504
        elif (exc.code in ("upstream_rejected", "content_filter") and exc.upstream_status is not None
              and 400 <= exc.upstream_status < 500):
            status = exc.upstream_status
        else:
            status = 502
        detail = exc.detail or {}
        headers: dict[str, str] = {}
        if exc.retry_after_s is not None:  # what the upstream (or the route's cooldown) asked to wait
            headers = {"retry-after-ms": str(int(exc.retry_after_s * 1000)),
                       "retry-after": str(max(1, math.ceil(exc.retry_after_s)))}
        super().__init__(exc.message, code=exc.code, status=status, param=detail.get("param"), headers=headers,
                         type="upstream_timeout" if status == 504 else "upstream_error")
        self.innererror = detail.get("innererror")
        self.upstream = exc.upstream
        self.upstream_status = exc.upstream_status
        self.extra["upstream"] = {"name": exc.upstream, "status": exc.upstream_status}

    def body(self) -> dict[str, Any]:
        out = super().body()
        if self.innererror is not None:  # a content filter's verdict, as the upstream gave it (Azure's shape)
            out["error"]["innererror"] = self.innererror
        return out


def upstream_failed(exc: UpstreamError) -> ApiError:
    """The answer to an upstream's failure (the one mapping from upstream failures to HTTP)."""
    return UpstreamFailed(exc)


STORE_RETRY_AFTER_S = 1
"""What a 503 `store_unavailable` asks the client to wait before retrying (`retry-after`)."""


class StoreUnavailable(ApiError):
    """The store failed or did not answer in time: retry shortly (nothing was done upstream)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="store_unavailable",
                         headers={"retry-after": str(STORE_RETRY_AFTER_S), "x-should-retry": "true"})


class RequestTimeout(ApiError):
    """The client did not send its request head, or its body, within the server's timeout."""

    status = 408
    type = "invalid_request_error"

    def __init__(self, message: str, code: Literal["header_timeout", "body_timeout"]) -> None:
        super().__init__(message, code=code, headers={"Connection": "close"})


class Overloaded(ApiError):
    """This process holds as many connections as it may (`server.max_connections`)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="too_many_connections",
                         headers={"retry-after": "1", "x-should-retry": "true", "Connection": "close"})


def from_store_error(exc: StoreError) -> ApiError:
    """The answer to a store failure: 409 for a refusal about one run, else 503 (retryable)."""
    if isinstance(exc, RunNotFound):
        return NotFound(f"run {public_run_id(exc.run_id)} no longer exists (it was deleted while this call used it)",
                        code="run_not_found")
    if isinstance(exc, (StaleRun, RunExists)):
        return Conflict(f"run {public_run_id(exc.run_id)} changed while this call used it; retry the call",
                        code="run_conflict")
    if isinstance(exc, SpoolNotReady):
        return StoreUnavailable("this gateway process cannot take calls now: the spool, where it keeps a paid turn "
                                "its store cannot take, has no room set aside (a full disk?); nothing was forwarded, "
                                "retry in a moment (GET /readyz says when it is ready)")
    if isinstance(exc, LeaseLost):
        return Conflict(f"run {public_run_id(exc.run_id)} is driven by another gateway replica now (this one stalled "
                        "past its lease); read the run to follow it", code="run_conflict")
    # The store's own words name hosts and files: they go to the log (the caller's, once per
    # failure of the store: `ctx.STORE_HEALTH`), not to clients.
    return StoreUnavailable("the gateway's store is unavailable; retry in a moment")


class InternalError(ApiError):
    status = 500
    type = "server_error"


def from_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's own errors (unknown route, wrong method, body too big) in our shape."""
    if exc.status == 404:
        return NotFound(f"no route for this path: {exc.reason}", code="route_not_found")
    if exc.status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", None) or ())
        return MethodNotAllowed(f"method not allowed; allowed: {', '.join(allowed)}", code="method_not_allowed",
                                headers={"Allow": ", ".join(allowed)})  # RFC 9110 asks a 405 for it
    if exc.status == 413:
        return ApiError(exc.text or "request body is too large", status=413, type="invalid_request_error",
                        code="body_too_large")
    kind = "invalid_request_error" if 400 <= exc.status < 500 else "server_error"
    return ApiError(exc.text or exc.reason, status=exc.status, type=kind, code=None)
