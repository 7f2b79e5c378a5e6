"""Signing in to the console, and what guards its requests.

Sign-in (`POST /console/session {"key"}`) checks the team key with the gateway's own
`KeyRing` and answers with a browser-session cookie holding it: `HttpOnly` (page scripts
never read it back), `SameSite=Strict`, `Path=/console`, `Secure` over HTTPS, no expiry
(gone when the browser closes), never in a URL. The answer also carries the session's
CSRF token, an HMAC of the key (so every replica computes the same one, with no state):
the page keeps it in memory and sends it as `X-CSRF-Token` on every state-changing
request. A request that changes anything is refused (403 `csrf_token_invalid`) without
that token, and (403 `cross_site_request`) when the browser says it comes from another
site (`Origin` of another host, `Sec-Fetch-Site: cross-site`); sign-in itself takes only
a JSON body, which no cross-site form can send.

`as_api(handler)` runs a handler of the runs API for the signed-in team: the same
handler, the same permission checks (`run_access`), with the cookie's key as its
`Authorization` header. The console has no permission rules of its own.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Final, TypedDict
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.server import context as ctx
from gateway.config.settings import TeamConfig
from gateway.server.http.errors import BadRequest, Forbidden, InvalidField, Unauthorized
from gateway.server.http.validation import read_body
from gateway.server.http.validation import json_object

COOKIE: Final = "gateway_console"
CSRF_HEADER: Final = "X-CSRF-Token"
PATH: Final = "/console"
MAX_KEY_CHARS: Final = 512
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_CSRF_CONTEXT: Final = b"gateway console csrf v1"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SessionJSON(TypedDict):
    """What `GET/POST /console/session` answer: who is signed in, and the CSRF token."""

    team: str
    admin: bool
    csrf_token: str
    approver_of: list[str]


def csrf_token(key: str) -> str:
    """The session's CSRF token: unguessable without the key, the same on every replica."""
    return hmac.new(key.encode(), _CSRF_CONTEXT, hashlib.sha256).hexdigest()


def signed_in(request: web.Request) -> tuple[str, TeamConfig]:
    """The session's key and team, or 401 (not signed in, or a key the config no longer has)."""
    key = request.cookies.get(COOKIE, "")
    if not key:
        raise Unauthorized("not signed in to the console: sign in with your team key")
    team = request.app[ctx.KEYRING].team(key)
    if team is None:
        raise Unauthorized("the console session's key is no longer valid: sign in again")
    return key, team


def refuse_cross_site(request: web.Request) -> None:
    """403 when the browser says the request comes from another site."""
    origin = request.headers.get("Origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc != request.host):
        raise Forbidden("cross-site request refused: the console accepts changes only from its own pages",
                        code="cross_site_request")
    if request.headers.get("Sec-Fetch-Site") == "cross-site":
        raise Forbidden("cross-site request refused: the console accepts changes only from its own pages",
                        code="cross_site_request")


def check_csrf(request: web.Request, key: str) -> None:
    """A state-changing console request must come from a console page of this session."""
    refuse_cross_site(request)
    given = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode(), csrf_token(key).encode()):
        raise Forbidden(f"missing or wrong {CSRF_HEADER} header: changes go through the console's own pages",
                        code="csrf_token_invalid")


def as_api(handler: Handler) -> Handler:
    """`handler` (a runs API handler) for the signed-in team, CSRF-checked when it changes state."""

    async def console_call(request: web.Request) -> web.StreamResponse:
        key, _ = signed_in(request)
        if request.method not in SAFE_METHODS:
            check_csrf(request, key)
        headers = CIMultiDict(request.headers)
        headers["Authorization"] = f"Bearer {key}"
        api_request = request.clone(headers=headers)
        try:
            return await handler(api_request)
        finally:
            run = api_request.get(ctx.RUN)
            if run is not None:
                request[ctx.RUN] = run  # the access log and metrics name the run as for the API

    console_call.__doc__ = f"The console's `{handler.__name__}`: {handler.__doc__ or ''}"
    return console_call


def _session_json(request: web.Request, key: str, team: TeamConfig) -> SessionJSON:
    policies = request.app[ctx.POLICIES]
    approver_of = [n for n in policies.names() if (p := policies.get(n)) is not None
                   and team.name in p.approval.approvers]
    return {"team": team.name, "admin": team.admin, "csrf_token": csrf_token(key), "approver_of": approver_of}


def json_answer(data: object, status: int = 200) -> web.Response:
    """A JSON answer of the console's own routes."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def sign_in(request: web.Request) -> web.Response:
    """POST /console/session {"key"}: check the key, set the session cookie."""
    refuse_cross_site(request)
    if request.content_type != "application/json":
        raise BadRequest("sign in with a JSON body {\"key\": \"...\"} (Content-Type: application/json)",
                         code="invalid_content_type")
    raw = await read_body(request, request.app[ctx.LIVE].config.server.max_body_bytes)
    body = json_object(raw, "a JSON object")
    key = body.get("key")
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_CHARS:
        raise InvalidField("key", f"key must be your team's gateway key (a string of at most {MAX_KEY_CHARS} "
                                  "characters)")
    key = key.strip()
    team = request.app[ctx.KEYRING].team(key)
    if team is None:
        raise Unauthorized("invalid key: no team has this key")
    response = json_answer(_session_json(request, key, team))
    response.set_cookie(COOKIE, key, path=PATH, httponly=True, samesite="Strict", secure=request.secure)
    return response


async def whoami(request: web.Request) -> web.Response:
    """GET /console/session: the signed-in team and the CSRF token (401: not signed in)."""
    key, team = signed_in(request)
    return json_answer(_session_json(request, key, team))


async def sign_out(request: web.Request) -> web.Response:
    """DELETE /console/session: forget the session cookie."""
    key, _ = signed_in(request)
    check_csrf(request, key)
    response = json_answer({"signed_out": True})
    response.del_cookie(COOKIE, path=PATH)
    return response
