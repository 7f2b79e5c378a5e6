"""Signing in to the console, and what guards its requests.

Sign-in (`POST /console/session {"key"}`) checks the key with the gateway's own `KeyRing`,
stores a console session in the store (`ConsoleSession`: by the SHA-256 of a random id,
never the id, so every replica knows it) and answers with a browser-session cookie holding
that random id, never the key: `HttpOnly` (page scripts never read it back),
`SameSite=Strict`, `Path=/console`, `Secure` over HTTPS, no expiry (gone when the browser
closes), never in a URL. A session ends at sign-out (deleted from the store: a copied cookie
is refused everywhere), after `console.session_idle_s` without a request, at
`console.session_max_s` after sign-in, and as soon as its key may no longer be used
(revoked, expired, rotated since, or gone from the config). Sign-in and sign-out are in the
audit log, written in the same store step as the session.

The answer also carries the session's CSRF token, an HMAC of the session id (every replica
computes the same one): the page keeps it in memory and sends it as `X-CSRF-Token` on every
state-changing request. A request that changes anything is refused (403
`csrf_token_invalid`) without that token, and (403 `cross_site_request`) when the browser
says it comes from another site (`Origin` of another host, `Sec-Fetch-Site: cross-site`);
sign-in itself takes only a JSON body, which no cross-site form can send.

`as_api(handler)` runs a `/v1` handler for the signed-in session: the same handler, the same
permission checks, working as the session's key (`auth.AS_TEAM`). The console has no
permission rules of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypedDict
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.config.settings import TeamConfig
from gateway.server import audit
from gateway.server import context as ctx
from gateway.server.http.auth import AS_TEAM
from gateway.server.http.errors import BadRequest, Forbidden, InvalidField, Unauthorized
from gateway.server.http.validation import json_object, read_body
from gateway.store.keys import ConsoleSession, session_hash

COOKIE: Final = "gateway_console"
CSRF_HEADER: Final = "X-CSRF-Token"
PATH: Final = "/console"
MAX_KEY_CHARS: Final = 512
MAX_SESSION_CHARS: Final = 128
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
TOUCH_EVERY_S: Final = 60.0
"""A session's idle expiry is pushed back on use, at most once a minute (a store write; and at
most once per half of its idle time)."""
_CSRF_CONTEXT: Final = b"gateway console csrf v2"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SessionJSON(TypedDict):
    """What `GET/POST /console/session` answer: who is signed in, and the CSRF token."""

    team: str
    admin: bool
    key_id: str
    manage_keys: bool
    csrf_token: str
    approver_of: list[str]


def csrf_token(session_id: str) -> str:
    """The session's CSRF token: unguessable without the session id, the same on every replica."""
    return hmac.new(session_id.encode(), _CSRF_CONTEXT, hashlib.sha256).hexdigest()


async def signed_in(request: web.Request) -> tuple[str, TeamConfig]:
    """The session's id and the view of its key's team, or 401 (not signed in, signed out,
    expired, or a key that may no longer be used)."""
    session_id = request.cookies.get(COOKIE, "")
    if not session_id:
        raise Unauthorized("not signed in to the console: sign in with your key")
    if len(session_id) > MAX_SESSION_CHARS or not session_id.isascii():
        raise Unauthorized("the console session is not valid: sign in again")
    app = request.app
    h = session_hash(session_id)
    session = await app[ctx.STORE].get_session(h)
    now = time.time()
    if session is None or not session.live(now):
        raise Unauthorized("the console session ended (signed out, or expired): sign in again")
    generation = None if session.key_id.startswith("cfg_") else session.generation
    view = await app[ctx.KEYRING].find_by_id(session.key_id, generation)
    if view is None or view.name != session.team:
        raise Unauthorized("the console session's key may no longer be used (revoked, rotated or removed): sign in "
                           "again")
    idle_s = app[ctx.LIVE].config.console.session_idle_s
    if session.idle_until - now < idle_s - min(TOUCH_EVERY_S, idle_s / 2):  # used: its idle time starts again
        await app[ctx.STORE].touch_session(h, min(now + idle_s, session.expires_at))
    return session_id, view


def refuse_cross_site(request: web.Request) -> None:
    """403 when the browser says the request comes from another site."""
    origin = request.headers.get("Origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc != request.host):
        raise Forbidden("cross-site request refused: the console accepts changes only from its own pages",
                        code="cross_site_request")
    if request.headers.get("Sec-Fetch-Site") == "cross-site":
        raise Forbidden("cross-site request refused: the console accepts changes only from its own pages",
                        code="cross_site_request")


def check_csrf(request: web.Request, session_id: str) -> None:
    """A state-changing console request must come from a console page of this session."""
    refuse_cross_site(request)
    given = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), csrf_token(session_id).encode()):
        raise Forbidden(f"missing or wrong {CSRF_HEADER} header: changes go through the console's own pages",
                        code="csrf_token_invalid")


def as_api(handler: Handler) -> Handler:
    """`handler` (a `/v1` handler) for the signed-in session, CSRF-checked when it changes state."""

    async def console_call(request: web.Request) -> web.StreamResponse:
        session_id, view = await signed_in(request)
        if request.method not in SAFE_METHODS:
            check_csrf(request, session_id)
        headers = CIMultiDict(request.headers)
        headers.popall("Authorization", None)  # the session's key decides, nothing the page sends
        api_request = request.clone(headers=headers)
        api_request[AS_TEAM] = view
        try:
            return await handler(api_request)
        finally:
            run = api_request.get(ctx.RUN)
            if run is not None:
                request[ctx.RUN] = run  # the access log and metrics name the run as for the API

    console_call.__doc__ = f"The console's `{handler.__name__}`: {handler.__doc__ or ''}"
    return console_call


def _session_json(request: web.Request, session_id: str, team: TeamConfig) -> SessionJSON:
    policies = request.app[ctx.POLICIES]
    approver_of = [n for n in policies.names() if (p := policies.get(n)) is not None
                   and team.name in p.approval.approvers]
    caller = team.caller
    return {"team": team.name, "admin": team.admin, "key_id": "" if caller is None else caller.key_id,
            "manage_keys": bool(caller and caller.manage_keys), "csrf_token": csrf_token(session_id),
            "approver_of": approver_of}


def json_answer(data: object, status: int = 200) -> web.Response:
    """A JSON answer of the console's own routes."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def sign_in(request: web.Request) -> web.Response:
    """POST /console/session {"key"}: check the key, store a session, set its cookie."""
    refuse_cross_site(request)
    if request.content_type != "application/json":
        raise BadRequest("sign in with a JSON body {\"key\": \"...\"} (Content-Type: application/json)",
                         code="invalid_content_type")
    app = request.app
    raw = await read_body(request, app[ctx.LIVE].config.server.max_body_bytes)
    body = json_object(raw, "a JSON object")
    key = body.get("key")
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_CHARS:
        raise InvalidField("key", f"key must be your gateway key (a string of at most {MAX_KEY_CHARS} characters)")
    key = key.strip()
    keyring = app[ctx.KEYRING]
    team = await keyring.find(key)
    if team is None:
        raise Unauthorized(keyring.refusal(key).replace("API key", "key"))
    caller = team.caller
    session_id = secrets.token_urlsafe(32)
    now = time.time()
    console = app[ctx.LIVE].config.console
    session = ConsoleSession(session_hash(session_id), team.name, "" if caller is None else caller.key_id,
                             0 if caller is None else caller.generation, now,
                             now + min(console.session_idle_s, console.session_max_s), now + console.session_max_s)
    await app[ctx.STORE].put_session(session, [audit.entry(team, audit.SIGNED_IN, "console", concerns=team.name)])
    response = json_answer(_session_json(request, session_id, team))
    response.set_cookie(COOKIE, session_id, path=PATH, httponly=True, samesite="Strict", secure=request.secure)
    return response


async def whoami(request: web.Request) -> web.Response:
    """GET /console/session: the signed-in team and the CSRF token (401: not signed in)."""
    session_id, team = await signed_in(request)
    return json_answer(_session_json(request, session_id, team))


async def sign_out(request: web.Request) -> web.Response:
    """DELETE /console/session: end the session (deleted from the store) and its cookie."""
    session_id, team = await signed_in(request)
    check_csrf(request, session_id)
    await request.app[ctx.STORE].delete_session(session_hash(session_id),
                                                [audit.entry(team, audit.SIGNED_OUT, "console", concerns=team.name)])
    response = json_answer({"signed_out": True})
    response.del_cookie(COOKIE, path=PATH)
    return response
