"""The demo's bench: a scripted provider over real HTTP, fresh sandboxes, timed models."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.demo.report import Result
from gateway.harness.execute import CancelScope
from gateway.harness.loop import Outcome, run
from gateway.harness.model import Model, ModelReply, ModelRequest
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, Message, RunState
from gateway.harness.tools import Tool, ToolContext, ToolOutput
from gateway.harness.trace import EventList
from gateway.providers.http_model import HTTPChatModel
from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, file_tools, fresh_sandbox


class TimedModel:
    """Wraps a model and adds up the time spent waiting for it (to isolate the harness's own)."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner
        self.seconds = 0.0

    async def complete(self, request: ModelRequest) -> ModelReply:
        started = time.perf_counter()
        try:
            return await self.inner.complete(request)
        finally:
            self.seconds += time.perf_counter() - started


@dataclass
class Trial:
    """One finished run with what the bench saw of it."""

    outcome: Outcome
    events: EventList
    seconds: float
    model_seconds: float
    tool_seconds: float
    sandbox: Sandbox
    stopped_at: float | None = None
    ended_at: float = 0.0

    @property
    def state(self) -> RunState:
        return self.outcome.state

    @property
    def ms(self) -> int:
        return int(self.seconds * 1000)

    @property
    def own_ms(self) -> float:
        """Wall time minus the model's and the tools' own: what the harness itself took."""
        return (self.seconds - self.model_seconds - self.tool_seconds) * 1000

    def result(self, experiment: str, variant: str, **extra: Any) -> Result:
        return Result.of(experiment, variant, self.state, self.events.events, self.outcome.answer, self.ms, **extra)


@dataclass
class Lab:
    session: aiohttp.ClientSession
    base_url: str
    workdir: Path
    counter: int = field(default=0)

    def model(self, latency_ms: int = 0) -> HTTPChatModel:
        headers = {"X-Scripted-Latency-Ms": str(latency_ms)} if latency_ms else {}
        return HTTPChatModel(self.session, self.base_url, headers=headers)

    def sandbox(self) -> Sandbox:
        self.counter += 1
        return Sandbox(fresh_sandbox(self.workdir / f"sandbox-{self.counter}"))

    async def trial(self, model_name: str, *, limits: Limits = Limits(), latency_ms: int = 0,
                    task: str = PLAN_TASK, stop_after_s: float | None = None, state: RunState | None = None,
                    sandbox: Sandbox | None = None, extra_tools: Mapping[str, Any] | None = None,
                    model: Model | None = None, **options: Any) -> Trial:
        """Run one task to its stop and time it."""
        box = sandbox or self.sandbox()
        events = EventList()
        tool_time: list[float] = []
        tools = timed_tools({**file_tools(box), **(extra_tools or {})}, tool_time)
        opts = RunOptions(tools=tools, on_event=events, **options)
        if state is None:
            messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
            state = RunState.new(model_name, messages, limits=limits)
        timed = TimedModel(model or self.model(latency_ms))
        scope = CancelScope()
        stopped_at: list[float] = []
        if stop_after_s is not None:
            def press_stop() -> None:
                stopped_at.append(time.perf_counter())
                scope.cancel("user pressed Stop")
            handle = asyncio.get_running_loop().call_later(stop_after_s, press_stop)
        started = time.perf_counter()
        outcome = await run(state, timed, opts, scope)
        ended = time.perf_counter()
        if stop_after_s is not None:
            handle.cancel()
        return Trial(outcome, events, ended - started, timed.seconds, sum(tool_time), box,
                     stopped_at[0] if stopped_at else None, ended)


def timed_tools(tools: Mapping[str, Tool], spent: list[float]) -> dict[str, Tool]:
    """The same tools, each run's duration appended to `spent`."""
    def wrap(tool: Tool) -> Tool:
        async def fn(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
            started = time.perf_counter()
            try:
                return await tool.run(args, ctx)
            finally:
                spent.append(time.perf_counter() - started)
        return Tool(tool.spec, fn)
    return {name: wrap(t) for name, t in tools.items()}


async def serve_scripted() -> tuple[web.AppRunner, str]:
    """Start the scripted provider on a free loopback port; return its runner and base URL."""
    from gateway.providers.scripted import scripted_app

    app = web.Application()
    app.add_subapp("/v1", scripted_app())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, f"http://127.0.0.1:{port}/v1"


def workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="gateway-demo-")
