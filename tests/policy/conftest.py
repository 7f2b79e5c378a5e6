"""Fixtures for the policy tests: a policy directory to write files into."""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.state import Limits, Message, RunState
from gateway.harness.usage import Usage

WriteFile = Callable[[str, str], Path]


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    d = tmp_path / "policies"
    d.mkdir()
    return d


@pytest.fixture
def write(policy_dir: Path) -> WriteFile:
    """write("name.yaml", yaml_text) -> path (the text is dedented)."""

    def _write(name: str, text: str) -> Path:
        path = policy_dir / name
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return _write


class FnModel:
    """A model whose next message is a function of the request (sub-runs see their own system
    prompt); every turn costs `usage`. The loop, policy and tools around it are all real."""

    def __init__(self, reply: Callable[[ModelRequest], Message], usage: Usage = Usage(1000, 100)) -> None:
        self.reply = reply
        self.usage = usage
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelReply:
        self.requests.append(request)
        message = self.reply(request)
        return ModelReply(message, self.usage, "tool_calls" if message.get("tool_calls") else "stop")


def tool_call(call_id: str, name: str, args: Any) -> Message:
    """An assistant turn calling one tool; `args` may be a raw string (e.g. invalid JSON)."""
    raw = args if isinstance(args, str) else orjson.dumps(args).decode()
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}]}


def answer(content: str) -> Message:
    return {"role": "assistant", "content": content}


def turns(request: ModelRequest) -> int:
    """How many assistant turns the transcript of `request` already holds."""
    return sum(1 for m in request.messages if m.get("role") == "assistant")


def tool_messages(state: RunState) -> list[str]:
    return [str(m["content"]) for m in state.messages if m.get("role") == "tool"]


def new_state(task: str = "do it", limits: Limits = Limits(max_turns=10)) -> RunState:
    return RunState.new("test-model", [{"role": "system", "content": "parent"}, {"role": "user", "content": task}],
                        limits=limits)


class Events:
    """An event sink that lets a test await the first event matching a predicate."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._waiters: list[tuple[Callable[[dict[str, Any]], bool], asyncio.Future[dict[str, Any]]]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        event = {**event, "at": time.perf_counter()}
        self.events.append(event)
        for pred, fut in list(self._waiters):
            if not fut.done() and pred(event):
                fut.set_result(event)

    async def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
        for event in self.events:
            if pred(event):
                return event
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.append((pred, fut))
        return await asyncio.wait_for(fut, timeout)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]
