"""What the MCP tests share: the test server's record, an HTTP instance of it, a model
that follows a plan written in the task, and policies naming MCP servers."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tests.support.procs import ROOT, free_port, wait_http

BIN = Path(sys.executable).parent
"""Where the interpreter's console scripts are (the third-party servers' programs)."""


def server_log(path: Path) -> list[dict[str, Any]]:
    """The test server's own record, oldest first."""
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def stdio_server(name: str, log: Path, **extra: Any) -> dict[str, Any]:
    """A policy's `mcp:` entry for the test server over stdio."""
    return {"name": name, "command": [sys.executable, "-m", "tests.mcptools.server"], "cwd": str(ROOT),
            "env": {"MCP_TEST_LOG": str(log)}, **extra}


@contextlib.contextmanager
def http_server(log: Path) -> Iterator[str]:
    """The test server over streamable HTTP on a free port; yields its URL."""
    port = free_port()
    out = (log.parent / f"mcp-http-{port}.out").open("wb")
    env = {"MCP_TEST_LOG": str(log), "PATH": str(BIN)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.mcptools.server", "http", str(port)], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/mcp", proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def plan_task(*calls: tuple[str, dict[str, Any]]) -> str:
    """A user message the planning model follows: these calls, one per turn, then an answer."""
    return orjson.dumps({"plan": [[name, args] for name, args in calls]}).decode()


def next_message(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The planning model: the plan's next call, or an answer quoting every tool result."""
    task = next(m for m in messages if m.get("role") == "user")
    plan = orjson.loads(task["content"])["plan"]
    done = sum(1 for m in messages if m.get("role") == "assistant")
    if done < len(plan):
        name, args = plan[done]
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{done + 1}", "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]}
    results = [str(m.get("content")) for m in messages if m.get("role") == "tool"]
    return {"role": "assistant", "content": "results: " + " | ".join(results)}


async def planning_upstream(request: web.Request) -> web.Response:
    """An OpenAI-compatible chat completions handler for `serving`, following the plan."""
    body = await request.json()
    message = next_message(body["messages"])
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return web.json_response({"id": "chatcmpl-plan", "object": "chat.completion", "created": 0,
                              "model": body["model"], "choices": [{"index": 0, "message": message,
                                                                   "finish_reason": finish}],
                              "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}})
