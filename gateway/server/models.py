"""GET /v1/models and /v1/models/{model}: the models this gateway routes."""

from __future__ import annotations

import fnmatch

import orjson
from aiohttp import web

from gateway.config.settings import Config
from gateway.providers.scenarios import model_names
from gateway.server import context as ctx
from gateway.server.http.errors import NotFound


def routed_models(config: Config) -> list[tuple[str, str]]:
    """(model, upstream) for every model the config routes by name; a glob on the scripted
    upstream lists the scripted scenarios it matches (other globs cannot be listed)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    scripted = model_names()
    for route in config.models:
        upstream = config.upstreams[route.upstream]
        if not route.is_glob:
            names = [route.match]
        elif upstream.kind == "scripted":
            names = [m for m in scripted if fnmatch.fnmatchcase(m, route.match)]
        else:
            names = []
        for name in names:
            # first match wins: a name an earlier route already took is not this route's
            if name not in seen and config.route(name) is route:
                seen.add(name)
                out.append((name, route.upstream))
    return out



async def list_models(request: web.Request) -> web.Response:
    """The models this gateway routes, in the OpenAI list shape (auth required)."""
    app = request.app
    app[ctx.KEYRING].authenticate(request)
    data = [{"id": name, "object": "model", "created": 0, "owned_by": upstream}
            for name, upstream in routed_models(app[ctx.LIVE].config)]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    """One routed model (the SDKs' `models.retrieve`); 404 in the OpenAI shape otherwise."""
    app = request.app
    app[ctx.KEYRING].authenticate(request)
    name = request.match_info["model"]
    for model, upstream in routed_models(app[ctx.LIVE].config):
        if model == name:
            break
    else:
        route = app[ctx.LIVE].config.route(name)
        # a glob on the scripted upstream routes only its scenarios (all listed above)
        if route is None or app[ctx.LIVE].config.upstreams[route.upstream].kind == "scripted":
            raise NotFound(f"model '{name}' is not routed by this gateway (see GET /v1/models)",
                           code="model_not_found", param="model")
        upstream = route.upstream
    data = {"id": name, "object": "model", "created": 0, "owned_by": upstream}
    return web.Response(body=orjson.dumps(data), content_type="application/json")
