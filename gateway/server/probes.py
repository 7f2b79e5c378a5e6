"""GET /livez, /readyz and /healthz: is the process alive, and may it take calls
(docs/http-api.md#probes).

- `/livez`: 200 while the process serves HTTP (its event loop runs); no store is asked.
  A failing liveness probe means: restart the process.
- `/readyz`: 200 `{"status": "ready", "checks": {...}}` when every readiness check passes
  (`gateway.server.http.readiness`), else 503 in the OpenAI error shape (code `not_ready`,
  naming each failing check) with the same `status` and `checks`. A failing readiness probe
  means: send no calls here for now (they would be refused); the process recovers by itself.
- `/healthz`: the same as `/readyz` (its older name).

The checks added here: `store` (the store answers a read now, with its own deadline, and
took this process's last write: `ctx.STORE_HEALTH`), `spool` (its reserve is intact and
every spooled record is written: no call is admitted otherwise), `policies` (every team's
policies are loaded) and `mcp` (every MCP server of a loaded policy answers a `ping` within
`MCP_PROBE_S`, unless its `mcp:` entry says `optional: true`; one that is down is started
again by the check, within its backoff: a server over HTTP that went away is otherwise
noticed only by the next call of its tools). `draining` comes with `Readiness` (it fails
first, `server.shutdown_delay_s` before the listener closes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from gateway.mcp.hub import McpUnavailable
from gateway.server import context as ctx
from gateway.server.http.errors import ApiError
from gateway.server.http.readiness import Check, Readiness
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

PROBE_RUN_ID = "healthz-probe"
MCP_PROBE_S = 1.0
"""How long an MCP server has to answer the readiness check's `ping` (or to start)."""


def setup(app: web.Application, readiness: Readiness) -> None:
    """Add the checks of `app` (store, spool, policies, MCP servers) to `readiness`, and keep
    the gauges of those that track a condition (store, spool) current."""

    async def store() -> Check:
        health = app[ctx.STORE_HEALTH]
        try:
            await app[ctx.STORE].load_run(PROBE_RUN_ID)
        except StoreError as exc:
            health.fail(str(exc))  # its words name hosts and files: the log has them
            return Check(False, "the store does not answer")
        if not health.ok:
            return Check(False, "the store does not take this process's writes (see the log)")
        return Check(True)

    async def spool() -> Check:
        spool = app[ctx.SPOOL]
        if spool.intact:
            return Check(True)
        return Check(False, "the spool's reserve is not intact (a full disk?): calls are refused until it is")

    async def policies() -> Check:
        registry = app[ctx.POLICIES]
        missing = sorted({name for team in app[ctx.LIVE].config.teams for name in team.policies if name not in registry})
        if missing:
            return Check(False, f"policies named by teams are not loaded: {', '.join(missing)}")
        return Check(True)

    async def mcp() -> Check:
        hub = app[ctx.MCP]
        servers = {server.key: server for policy in app[ctx.POLICIES].all() for server in policy.mcp
                   if not server.optional}
        try:
            healths = await asyncio.gather(*(hub.probe(server, MCP_PROBE_S) for server in servers.values()))
        except McpUnavailable as exc:  # the hub is closed: the process is stopping
            return Check(False, str(exc))
        down = [f"'{h.name}' ({h.error or h.state})" for h in healths if not h.up]
        if down:
            return Check(False, f"MCP servers of loaded policies are down: {', '.join(down)}")
        return Check(True)

    readiness.add("store", store)
    readiness.add("spool", spool)
    readiness.add("policies", policies)
    readiness.add("mcp", mcp)


async def livez(request: web.Request) -> web.Response:
    """200 while the process serves."""
    return web.Response(body=orjson.dumps({"status": "alive"}), content_type="application/json")


async def readyz(request: web.Request) -> web.Response:
    """200 when every readiness check passes, else 503 naming the failing ones."""
    checks = await request.app[ctx.READINESS].run()
    shown: dict[str, Any] = {name: {"ok": c.ok, **({"detail": c.detail} if c.detail else {})}
                             for name, c in checks.items()}
    failing = [f"{name} ({c.detail})" if c.detail else name for name, c in checks.items() if not c.ok]
    if not failing:
        return web.Response(body=orjson.dumps({"status": "ready", "checks": shown}), content_type="application/json")
    error = ApiError("this gateway process is not ready: " + "; ".join(failing), status=503, type="server_error",
                     code="not_ready", headers={"retry-after": "1"})
    error.extra.update({"status": "not_ready", "checks": shown})
    raise error
