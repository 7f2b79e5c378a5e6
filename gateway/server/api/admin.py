"""The admin API: `POST /v1/admin/reload` reloads the policy files without a restart.

Only keys of teams marked `admin: true` in config.yaml may call it: no key or an unknown
one is 401, a key of any other team 403. A reload is all-or-nothing: every file must be
valid, agent executors must name policies that exist, and every policy a team of
config.yaml lists must still be there; otherwise the previous set keeps serving.

    200 {"object": "policy_reload", "loaded": [{"name", "version"}], "changed": [...], "errors": []}
    400 the OpenAI error shape (code `invalid_policy`) plus the same three fields, each
        error naming its file, line, field and problem.

`changed` lists the policies whose version changed (a removed one has version null).
New runs get the new versions; a run keeps the version it started under, resumes
included. SIGHUP does the same reload (`gateway.server.main`); both log the result. A reload through
this route is recorded in the audit log (`config.reloaded`, once, by the worker that served
it); a SIGHUP is an act of whoever sent the signal, which the log does not know.

A reload is per process: replicas each hold their own copy of the policy set, so reload
every replica (this route on each, or a SIGHUP to each). The workers of one
`gateway serve --workers N` reload together: the one that served this route has the
supervisor forward a SIGHUP to all of them, and answers once every worker serves the
files as they were when the call came (at most `workers.RELOAD_WAIT_S`); its answer then
says how many did: `"workers": {"count": N, "reloaded": K}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from gateway.config.settings import Config
from gateway.policy.decl import Policy
from gateway.policy.errors import PolicyError
from gateway.policy.registry import PolicyRegistry, ReloadResult
from gateway.server import audit
from gateway.server import context as ctx
from gateway.server.workers import RELOAD_WAIT_S, mark_reloaded, reload_every_worker
from gateway.server.http.errors import BadRequest, Forbidden

log = logging.getLogger("gateway")

RELOAD_PATH = "/v1/admin/reload"


def team_check(config: Config) -> Callable[[Mapping[str, Policy]], Sequence[PolicyError]]:
    """A registry `check` refusing a set that lacks a policy some team of the config lists."""

    def check(policies: Mapping[str, Policy]) -> list[PolicyError]:
        known = ", ".join(sorted(policies)) or "none"
        return [
            PolicyError(str(config.path), None, ("teams", i, "policies", j),
                        f"team '{team.name}' lists policy '{name}', which is not in {config.policies_dir} "
                        f"any more (would load: {known})")
            for i, team in enumerate(config.teams)
            for j, name in enumerate(team.policies)
            if name not in policies
        ]

    return check


async def reload_in_thread(app: web.Application, by: str) -> ReloadResult:
    """`reload_policies` off the event loop: a reload may start MCP servers and list their
    tools, which must not stall every request in flight. It gets a thread of its own, not
    one of a shared pool, so it never queues behind other work (tools have their own pool,
    but DNS lookups and the like use asyncio's default one). A worker of `--workers N` then
    notes that it serves the files as they were when this began."""
    read_at = time.time()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-reload")
    try:
        result = await asyncio.get_running_loop().run_in_executor(pool, reload_policies, app, by)
    finally:
        pool.shutdown(wait=False)
    if ctx.WORKER in app:
        mark_reloaded(app[ctx.WORKER], read_at)
    return result


def reload_policies(app: web.Application, by: str) -> ReloadResult:
    """Reload the app's policy folder (checked against the config) and log what happened."""
    registry = app[ctx.POLICIES]
    result = registry.reload(check=team_check(app[ctx.CONFIG]))
    if result.ok:
        log.warning("policies reloaded by %s: %s (changed: %s)", by, _versions(registry, result.loaded),
                    _versions(registry, result.changed) or "none")
    else:
        log.error("policy reload by %s refused, previous policies kept:\n%s", by,
                  "\n".join(f"  {e}" for e in result.errors))
    return result


def reload_json(registry: PolicyRegistry, result: ReloadResult) -> dict[str, Any]:
    """The answer's fields: policies served (with versions), what changed, what was wrong."""
    return {
        "object": "policy_reload",
        "loaded": [_named(registry, name) for name in result.loaded],
        "changed": [_named(registry, name) for name in result.changed],
        "errors": [{"file": e.file, "line": e.line, "field": e.field, "problem": e.problem, "message": str(e)}
                   for e in result.errors],
    }


def _named(registry: PolicyRegistry, name: str) -> dict[str, str | None]:
    return {"name": name, "version": registry.version_of(name)}


def _versions(registry: PolicyRegistry, names: Sequence[str]) -> str:
    return ", ".join(f"{n}@{registry.version_of(n) or 'removed'}" for n in names)


async def post_reload(request: web.Request) -> web.Response:
    """POST /v1/admin/reload: reload the policy files (admin teams only)."""
    app = request.app
    team = app[ctx.KEYRING].authenticate(request)
    if not team.admin:
        admins = ", ".join(t.name for t in app[ctx.CONFIG].teams if t.admin) or "none configured"
        raise Forbidden(f"team '{team.name}' may not reload policies: only teams with admin: true in the config "
                        f"may (admin teams: {admins})", code="not_an_admin")
    asked_at = time.time()
    result = await reload_in_thread(app, by=f"team {team.name}")
    body = reload_json(app[ctx.POLICIES], result)
    if not result.ok:
        count = len(result.errors)
        error = BadRequest(f"policy reload refused ({count} error{'s' if count != 1 else ''}), the previous "
                           f"policies keep serving: " + "; ".join(str(e) for e in result.errors),
                           code="invalid_policy")
        error.extra.update(body)
        raise error
    await audit.record(app[ctx.STORE], team, audit.CONFIG_RELOADED, "policies",
                       details={"changed": [[n, app[ctx.POLICIES].version_of(n)] for n in result.changed]})
    if ctx.WORKER in app:  # one of `--workers N`: the others reload too
        count, reloaded = await reload_every_worker(asked_at)
        body["workers"] = {"count": count, "reloaded": reloaded}
        if reloaded < count:
            log.warning("policy reload: %d of %d workers confirmed within %.0f s", reloaded, count, RELOAD_WAIT_S)
    return web.Response(body=orjson.dumps(body), content_type="application/json")
