"""The run driver's life in the app: built at startup (after the store and the governor),
recovering what this process drove before a restart, sweeping abandoned runs, and stopping
every run it drives at shutdown (saved as interrupted, so they can be resumed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from gateway.harness.state import RunState
from gateway.harness.usage import DEFAULT_PRICE, Price
from gateway.policy.threads import ToolThreads
from gateway.server import context as ctx
from gateway.server.runs.auto_resume import BACKGROUND
from gateway.server.runs.cancels import ActiveRuns
from gateway.server.runs.driver import RunDriver
from gateway.server.runs.governed_model import UpstreamModel
from gateway.server.runs.recovery import STARTUP_SCAN, Sweeper
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S: Final = 5.0
SHUTTING_DOWN: Final = "the gateway is shutting down"




async def driver_ctx(app: web.Application) -> AsyncIterator[None]:
    live = app[ctx.LIVE]
    config = live.config  # its settings below cannot change on a reload

    def model_for(state: RunState) -> UpstreamModel:
        return UpstreamModel.for_run(app, state)

    def price_for(model: str) -> Price:
        route = live.config.route(model)
        return route.price if route is not None else DEFAULT_PRICE

    owner = app[ctx.GOVERNOR].owner  # the same name for its leases as for its reservations
    metrics = app[ctx.METRICS]
    threads = ToolThreads(config.server.tool_threads, metrics.on_tool_threads)
    metrics.tool_threads.set(threads.size)
    driver = RunDriver(app[ctx.STORE], app[ctx.POLICIES], model_for=model_for, price_for=price_for,
                       runs_dir=config.runs_dir, session=app[ctx.SESSION], trace_file=config.trace_file,
                       metrics=metrics, owner=owner, lease_ttl_s=config.server.lease_ttl_s,
                       store_deadline_s=config.store.timeout_s, threads=threads, tracing=app.get(ctx.TRACING))
    driver.approvals.teams = lambda: [team.name for team in app[ctx.LIVE].config.teams]
    app[ctx.DRIVER] = driver
    sweeper = Sweeper(driver, trace_file=config.trace_file, period_s=config.server.lease_ttl_s / 2)
    app[BACKGROUND] = sweeper.drives  # runs resumed after a decision (auto_resume) or by recovery
    try:
        await sweeper.sweep(STARTUP_SCAN)  # before serving: runs this process drove before a restart
    except StoreError as exc:  # the store is down: serve anyway (503s), recovery retries every period
        log.warning("startup recovery failed, retrying in the background: %s", exc)
    stop = asyncio.Event()
    sweeping = asyncio.get_running_loop().create_task(sweeper.run_forever(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait({sweeping}, timeout=SHUTDOWN_GRACE_S)
        await sweeper.close()
        await stop_all(driver.active, SHUTTING_DOWN)
        threads.close()


async def stop_runs(app: web.Application) -> None:
    # on_shutdown comes before aiohttp waits for open requests: runs stop now, saved as
    # interrupted (resumable), and their callers get that answer instead of a cut.
    if ctx.DRIVER in app:
        await stop_all(app[ctx.DRIVER].active, SHUTTING_DOWN)


async def stop_all(active: ActiveRuns, reason: str) -> None:
    """Press Stop on every run driven here and wait (briefly) until each is saved."""
    runs = list(active)
    active.cancel_all(reason)
    for run_id in runs:
        await active.wait_stopped(run_id, SHUTDOWN_GRACE_S)
