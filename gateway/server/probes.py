"""GET /livez, /readyz and /healthz: is the process alive, and may it take calls.

- `/livez`: 200 while the process serves HTTP (its event loop runs); no store is asked.
  A failing liveness probe means: restart the process.
- `/readyz`: 200 `{"status": "ready", "checks": {...}}` when every readiness check passes
  (`gateway.server.http.readiness`), else 503 in the OpenAI error shape (code `not_ready`,
  naming each failing check) with the same `status` and `checks`. A failing readiness probe
  means: send no calls here for now (they would be refused); the process recovers by itself.
- `/healthz`: the same as `/readyz` (its older name).

The checks added here: `store` (the store answers a read now, with its own deadline, and
took this process's last write: `ctx.STORE_HEALTH`) and `spool` (its reserve is intact and
every spooled record is written: no call is admitted otherwise). `draining` comes with
`Readiness`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from gateway.server import context as ctx
from gateway.server.http.errors import ApiError
from gateway.server.http.readiness import Check, Readiness
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

PROBE_RUN_ID = "healthz-probe"


def setup(app: web.Application, readiness: Readiness) -> None:
    """Add the `store` and `spool` checks of `app` to `readiness`, and keep their gauges current."""

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

    readiness.add("store", store)
    readiness.add("spool", spool)


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
