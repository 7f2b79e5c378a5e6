"""Running one tool call: timeout, cancellation that reaches into the tool, errors as data."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.harness.tools import Tool, ToolContext, ToolOutput, ToolResult

CallOutcome = Literal["ok", "error", "cancelled"]


@dataclass(frozen=True)
class Executed:
    """What became of one tool run."""

    outcome: CallOutcome
    result: ToolResult | None = None
    error: BaseException | None = None
    ms: int = 0


class CancelScope:
    """The run's Stop button: one event shared by the loop, the model call and every tool."""

    def __init__(self, event: asyncio.Event | None = None) -> None:
        self.event = event or asyncio.Event()
        self.reason = "cancelled"

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()


async def race(aw: Any, scope: CancelScope) -> tuple[bool, Any]:
    """Await `aw` unless the scope is cancelled first; then cancel it and return (False, None).

    Exceptions of `aw` propagate. The cancelled task is awaited so nothing outlives the Stop.
    """
    task: asyncio.Task[Any] = asyncio.ensure_future(aw)
    if scope.cancelled:
        task.cancel()
    else:
        stopper = asyncio.ensure_future(scope.event.wait())
        try:
            await asyncio.wait((task, stopper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        # The Stop wins whenever it was pressed by the time the race looks: a tool watching
        # ctx.cancelled wakes on the same event and may end first, returning or raising a
        # "stopped at step N" that is not the call's result. Which task the loop ran first
        # (load decides) must not decide whether the call stays pending.
        if task.done() and not scope.cancelled:
            return True, task.result()
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # the tool failed while being cancelled: the Stop wins
        pass
    return False, None


async def execute(tool: Tool, args: Mapping[str, Any], ctx: ToolContext, scope: CancelScope) -> Executed:
    """Run `tool` with its timeout; a Stop cancels it (asyncio cancellation + ctx.cancelled)."""
    started = time.perf_counter()

    async def call() -> ToolOutput:
        timeout = tool.spec.timeout_s
        if timeout is None:
            return await tool.run(args, ctx)
        try:
            async with asyncio.timeout(timeout):
                return await tool.run(args, ctx)
        except TimeoutError:
            raise TimeoutError(f"{tool.name} timed out after {timeout:g} s") from None

    try:
        finished, output = await race(call(), scope)
    except Exception as exc:  # a tool that raises is data, not a crash
        return Executed("error", error=exc, ms=_ms(started))
    if not finished:
        return Executed("cancelled", ms=_ms(started))
    result = output if isinstance(output, ToolResult) else ToolResult(str(output))
    return Executed("ok", result=result, ms=_ms(started))


def _ms(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)
