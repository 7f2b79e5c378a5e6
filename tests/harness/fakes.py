"""Real fakes for the pure harness: a scripted in-process model and tools that record runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.state import Message
from gateway.harness.tools import Tool, ToolContext, ToolSpec
from gateway.harness.usage import Usage

Script = Callable[[int, str], Message]


def call(call_id: str, name: str, args: dict[str, Any] | None = None) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": orjson.dumps(args or {}).decode()}}]}


def text(content: str) -> Message:
    return {"role": "assistant", "content": content}


class ScriptModel:
    """Answers from a script of (turn index, joined tool results); usage = 10 + 1 per message."""

    def __init__(self, script: Script, delay: float = 0.0) -> None:
        self.script = script
        self.delay = delay
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelReply:
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)  # simulated provider latency, not synchronisation
        turn = sum(1 for m in request.messages if m.get("role") == "assistant")
        tool_text = "\n".join(str(m.get("content", "")) for m in request.messages if m.get("role") == "tool")
        message = self.script(turn, tool_text)
        usage = Usage(100 + 10 * len(request.messages), 20)
        return ModelReply(message, usage, "tool_calls" if message.get("tool_calls") else "stop")


class Recorder:
    """Tools that record each run; `slow` waits on the cancel event like a well-written tool."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, dict[str, Any], str]] = []
        self.started = asyncio.Event()

    def tool(self, name: str, result: str = "ok", *, read_only: bool = True, needs_approval: bool = False,
             raises: BaseException | None = None, slow: float = 0.0) -> Tool:
        async def fn(args: Mapping[str, Any], ctx: ToolContext) -> str:
            self.runs.append((name, dict(args), ctx.idempotency_key))
            self.started.set()
            if slow:
                try:
                    await asyncio.wait_for(ctx.cancelled.wait(), slow)
                    return "stopped early"
                except TimeoutError:
                    pass
            if raises is not None:
                raise raises
            return result

        return Tool(ToolSpec(name, f"the {name} tool", read_only=read_only, needs_approval=needs_approval), fn)
