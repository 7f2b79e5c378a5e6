"""Real tool functions the policy tests point python executors at."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

from gateway.harness.tools import ToolContext


def echo_sync(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Sync: runs in a worker thread, says which thread and what it was given."""
    main = threading.current_thread() is threading.main_thread()
    return f"echo {args.get('text')} main_thread={main} key={ctx.idempotency_key}"


async def echo_async(args: Mapping[str, Any], ctx: ToolContext) -> str:
    ctx.progress("echoing")
    return f"async {args.get('text')} run={ctx.run_id} call={ctx.call_id}"


async def hang(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Never returns by itself (ignores cancellation): only a timeout ends it."""
    await asyncio.Event().wait()
    return "unreachable"


async def wait_for_stop(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """A well-written long tool: works in steps and stops when the run is stopped."""
    for step in range(1000):
        ctx.progress(f"step {step}")
        try:
            await asyncio.wait_for(ctx.cancelled.wait(), timeout=0.01)
        except TimeoutError:
            continue
        ctx.progress("stopping")
        return f"stopped at step {step}"
    return "finished"


def sync_wait_for_stop(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """A sync tool checking the event between slices of blocking work."""
    deadline = time.monotonic() + 10
    ctx.progress("working")
    while time.monotonic() < deadline:
        if ctx.cancelled.is_set():
            ctx.progress("stopping")
            return "stopped"
        time.sleep(0.002)
    return "finished"


def forbidden(args: Mapping[str, Any], ctx: ToolContext) -> str:
    raise PermissionError(f"may not read {args.get('path')}")


not_callable = 42
