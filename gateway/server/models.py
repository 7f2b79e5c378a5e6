"""`GET /v1/models` and `GET /v1/models/{model}`: the models this gateway routes.

A name routed without a glob is listed as it is; a glob on the scripted upstream lists the
scripted scenarios it matches. Other globs route names nobody wrote down: an upstream with
`discover_models: true` is asked what it serves (`GET {base_url}/models`, kept a minute:
`gateway.providers.discovery`), and each name it lists is shown when the config routes it
to that upstream by a glob, under the client's own name (a deployment without `model`).
An upstream that cannot answer is left out of the listing, which still answers.
`GET /v1/models/{model}` answers for exactly what the listing shows, and for a name a glob
routes to an upstream that cannot be asked (or was not asked to be).
"""

from __future__ import annotations

import asyncio
import fnmatch

import orjson
from aiohttp import web

from gateway.config.settings import Config, ModelRoute
from gateway.providers.scenarios import model_names
from gateway.server import context as ctx
from gateway.server.http.errors import NotFound
from gateway.server.http.scope import may_use_model

__all__ = ["get_model", "list_models", "routed_models"]


def routed_models(config: Config) -> list[tuple[str, str]]:
    """(model, upstream) for every model the config routes by name; a glob on the scripted
    upstream lists the scripted scenarios it matches (other globs: `discovered_models`)."""
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


def _route_of(config: Config, name: str) -> ModelRoute | None:
    """`config.route` without its memo (names from an upstream's list would crowd out the
    names clients call)."""
    return next((r for r in config.models if fnmatch.fnmatchcase(name, r.match)), None)


def _asking(config: Config, route: ModelRoute) -> list[str]:
    """The upstreams of `route` that are asked for the client's own name and list their models."""
    return [d.upstream for d in route.plan.groups[0].deployments
            if d.model is None and config.upstreams[d.upstream].discover_models]


async def discovered_models(app: web.Application) -> list[tuple[str, str]]:
    """(model, upstream) for each name a discovering upstream lists that a glob of the
    config routes to it; upstreams that cannot answer are left out."""
    config = app[ctx.LIVE].config
    asked = [name for name, u in config.upstreams.items() if u.discover_models]
    if not asked:
        return []
    discovery = app[ctx.UPSTREAMS].discovery
    lists = await asyncio.gather(*(discovery.names(u) for u in asked))
    out: list[tuple[str, str]] = []
    for upstream, names in zip(asked, lists):
        for name in names or ():
            route = _route_of(config, name)
            if route is not None and route.is_glob and upstream in _asking(config, route):
                out.append((name, upstream))
    return out


def _model(name: str, upstream: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": upstream}


async def list_models(request: web.Request) -> web.Response:
    """The models this gateway routes, in the OpenAI list shape (auth required)."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    listed = routed_models(app[ctx.LIVE].config)
    seen = {name for name, _ in listed}
    for name, upstream in await discovered_models(app):
        if name not in seen:
            seen.add(name)
            listed.append((name, upstream))
    data = [_model(name, upstream) for name, upstream in listed if may_use_model(team, name)]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    """One routed model (the SDKs' `models.retrieve`); 404 in the OpenAI shape otherwise."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    config = app[ctx.LIVE].config
    name = request.match_info["model"]
    if not may_use_model(team, name):
        raise NotFound(f"model '{name}' is not one this key may use (see GET /v1/models)", code="model_not_found",
                       param="model")
    for model, upstream in routed_models(config):
        if model == name:
            return web.Response(body=orjson.dumps(_model(name, upstream)), content_type="application/json")
    route = config.route(name)
    # a glob on the scripted upstream routes only its scenarios (all listed above)
    if route is None or config.upstreams[route.upstream].kind == "scripted":
        raise NotFound(f"model '{name}' is not routed by this gateway (see GET /v1/models)",
                       code="model_not_found", param="model")
    upstream = route.upstream
    asking = _asking(config, route)
    if asking:
        discovery = app[ctx.UPSTREAMS].discovery
        lists = await asyncio.gather(*(discovery.names(u) for u in asking))
        serving = next((u for u, names in zip(asking, lists) if names is not None and name in names), None)
        if serving is not None:
            upstream = serving
        elif all(names is not None for names in lists):  # every one that was asked said it does not
            raise NotFound(f"model '{name}' is routed by '{route.match}' to upstream "
                           f"{', '.join(repr(u) for u in asking)}, which does not list it (see GET /v1/models)",
                           code="model_not_found", param="model")
    return web.Response(body=orjson.dumps(_model(name, upstream)), content_type="application/json")
