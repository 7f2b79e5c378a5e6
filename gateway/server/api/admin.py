"""The admin API: `POST /v1/admin/reload` reloads config.yaml and the policy files without
a restart (`gateway.server.reload`).

Only keys of teams marked `admin: true` in config.yaml may call it: no key or an unknown
one is 401, a key of any other team 403. A reload is all-or-nothing: the config file must
be valid (every error of it is listed), every policy file too, agent executors must name
policies that exist, and every policy a team of the new config lists must be there;
otherwise the previous config and policies keep serving.

    200 {"object": "policy_reload", "loaded": [{"name", "version"}], "changed": [...],
         "config": {"changed": [...], "restart_required": [...]}, "errors": []}
    400 the OpenAI error shape (code `invalid_config` or `invalid_policy`) plus the same
        fields, each error naming its file, line (null for the config), field and problem.

`changed` lists the policies whose version changed (a removed one has version null);
`config.changed` the config fields served anew (`teams`, `models`, `upstreams`, `webhooks`,
`defaults`, `console`), `config.restart_required` the fields the file changed that take effect at the
next start (e.g. `server.port`). New runs get the new policy versions; a run keeps the
version it started under, resumes included. SIGHUP does the same reload
(`gateway.server.main`); both log the result. A reload through this route is recorded in
the audit log (`config.reloaded`, once, by the worker that served it, as the caller's act); a
SIGHUP's as the gateway's own act (no team, no key, `details.by: "SIGHUP"`: the log does not
know who sent the signal), once per signal however many workers reload.

Each process holds its own copy. A reload that served is announced in the store
(`reload_watch.announce`): every other replica sharing it then reloads its own files, after
this answer and without being told (`gateway.server.reload_watch`); the answer speaks for
this server only. The workers of one `gateway serve --workers N` reload together: the one
that served this route has the supervisor forward a SIGHUP to all of them, and answers once
every worker serves the files as they were when the call came (at most
`workers.RELOAD_WAIT_S`); its answer then says how many did: `"workers": {"count": N,
"reloaded": K}`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from aiohttp import web

from gateway.policy.registry import PolicyRegistry
from gateway.server import context as ctx
from gateway.server.reload import Reloaded, record_reload, reload
from gateway.server.reload_watch import announce
from gateway.server.workers import RELOAD_WAIT_S, reload_every_worker
from gateway.server.http.errors import BadRequest, Forbidden

log = logging.getLogger("gateway")

RELOAD_PATH = "/v1/admin/reload"


def reload_json(registry: PolicyRegistry, done: Reloaded) -> dict[str, Any]:
    """The answer's fields: policies served (with versions), what changed, what was wrong."""
    result = done.policies
    return {
        "object": "policy_reload",
        "loaded": [_named(registry, name) for name in result.loaded],
        "changed": [_named(registry, name) for name in result.changed],
        "config": {"changed": list(done.changed), "restart_required": list(done.restart_required)},
        "errors": [{"file": e.file, "line": None, "field": e.path or "(document)", "problem": e.problem,
                    "message": str(e)} for e in done.config_errors]
        + [{"file": e.file, "line": e.line, "field": e.field, "problem": e.problem, "message": str(e)}
           for e in result.errors],
    }


def _named(registry: PolicyRegistry, name: str) -> dict[str, str | None]:
    return {"name": name, "version": registry.version_of(name)}


async def post_reload(request: web.Request) -> web.Response:
    """POST /v1/admin/reload: reload config.yaml and the policy files (admin teams only)."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    if not team.admin:
        admins = ", ".join(t.name for t in app[ctx.LIVE].config.teams if t.admin) or "none configured"
        raise Forbidden(f"team '{team.name}' may not reload policies or the config: only teams with admin: true "
                        f"in the config may (admin teams: {admins})", code="not_an_admin")
    asked_at = time.time()
    done = await reload(app, by=f"team {team.name}")
    body = reload_json(app[ctx.POLICIES], done)
    if not done.ok:
        errors = [*done.config_errors, *done.policies.errors]
        count = len(errors)
        what = "config" if done.config_errors else "policy"
        error = BadRequest(f"reload refused ({count} {what} error{'s' if count != 1 else ''}), the previous config "
                           f"and policies keep serving: " + "; ".join(str(e) for e in errors),
                           code="invalid_config" if done.config_errors else "invalid_policy")
        error.extra.update(body)
        raise error
    await announce(app)  # every replica sharing the store reloads its own files too
    await record_reload(app, done, team, by=f"team {team.name}")
    if ctx.WORKER in app:  # one of `--workers N`: the others reload too
        count, reloaded = await reload_every_worker(asked_at)
        body["workers"] = {"count": count, "reloaded": reloaded}
        if reloaded < count:
            log.warning("reload: %d of %d workers confirmed within %.0f s", reloaded, count, RELOAD_WAIT_S)
    return web.Response(body=orjson.dumps(body), content_type="application/json")
