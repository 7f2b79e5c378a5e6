"""`POST /v1/chat/completions`: authenticate, key the call to its run, then one of two modes.

- A policy with tools runs the loop in the gateway: `server_side.handle_server_side`.
- A policy without tools is governed pass-through: `passthrough.pass_through` checks (and
  reserves) the run's turn cap and budget and the team's budget before anything is
  forwarded, and books the turn before the client sees the end of the answer.
"""

from __future__ import annotations

from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.server import context as ctx
from gateway.server.chat.passthrough import pass_through
from gateway.server.chat.server_side import handle_server_side
from gateway.server.http.chat_request import parse_chat_request
from gateway.server.http.errors import NotFound
from gateway.server.http.scope import call_user, require_model
from gateway.server.http.validation import read_body
from gateway.server.runs.fair_share import Share
from gateway.server.runs.keying import ServerSideRun, resolve_call


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """The route handler: every refusal here happens before the store is touched."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    raw = await read_body(request, app[ctx.LIVE].config.server.max_body_bytes)
    share = request[ctx.SHARE] = Share(app[ctx.FAIR_SHARE], team.name)
    await share.take()  # the gateway's own work for the call, in its team's share (given back while forwarded)
    try:
        return await _serve(request, team, raw, share)
    finally:
        share.close()


async def _serve(request: web.Request, team: TeamConfig, raw: bytes, share: Share) -> web.StreamResponse:
    app = request.app
    chat = parse_chat_request(raw)
    request[ctx.MODEL] = chat.model
    route = app[ctx.LIVE].config.route(chat.model)
    if route is None:
        raise NotFound(f"model '{chat.model}' is not routed by this gateway (see GET /v1/models)",
                       code="model_not_found", param="model")
    require_model(team, chat.model)
    call = await resolve_call(app[ctx.STORE], app[ctx.POLICIES], team, request.headers, chat, route,
                              defer_create=True, cache=app[ctx.RUN_CACHE],
                              user=call_user(team, chat.body, request.headers))
    request[ctx.RUN] = call.run
    if call.policy.server_side:
        share.give_back()  # a run driven here is not one step of work: it takes its turns as calls
        return await handle_server_side(request, call)
    try:
        return await pass_through(request, call)
    except ServerSideRun:  # a blind call's run is stored under a server-side policy
        share.give_back()
        return await handle_server_side(request, call)

