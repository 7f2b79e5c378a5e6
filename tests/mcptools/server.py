"""An MCP server written with the official SDK, for the tests: `python -m tests.mcptools.server
stdio|http PORT`, its own record of what it did in the JSON-lines file `$MCP_TEST_LOG`.

Tools: `lookup` (read-only), `wipe` (destructive), `touch` (not read-only, says it is not
destructive), `slow` (reports progress), `fail` (errors), `hang` (waits until cancelled,
recording the cancel on the server's clock), `crash` (the process dies mid-call),
`whoami` (the process id: a restart shows), `grow` (adds a tool: the next tools/list
differs) and `big` (a result of any size). `lookup` also records the trace context it was
called with (`_meta.traceparent`, and over HTTP the `traceparent` header).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import orjson
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

server = MCPServer("gateway-tests")


def record(event: str, **fields: object) -> None:
    """One line in the server's own log (appended and flushed before the tool answers)."""
    path = os.environ.get("MCP_TEST_LOG")
    if path:
        with Path(path).open("ab") as f:
            f.write(orjson.dumps({"event": event, "ts": time.time(), "pid": os.getpid(), **fields}) + b"\n")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup(key: str, ctx: Context) -> str:
    """Look a key up in the test dictionary."""
    rc = ctx.request_context
    http = rc.request.headers.get("traceparent") if rc.request is not None else None
    record("lookup", key=key, meta_traceparent=(rc.meta or {}).get("traceparent"), header_traceparent=http)
    return f"value of {key}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def wipe(target: str) -> str:
    """Delete everything under target."""
    record("wipe", target=target)
    return f"wiped {target}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def touch(target: str) -> str:
    """Create target if it is missing (never destroys anything)."""
    record("touch", target=target)
    return f"touched {target}"


@server.tool()
async def slow(steps: int, ctx: Context) -> str:
    """Work in steps, reporting progress after each."""
    for i in range(steps):
        await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
        await anyio.sleep(0.02)
    record("slow", steps=steps)
    return f"done in {steps} steps"


@server.tool()
def fail(why: str) -> str:
    """Always fails, saying why."""
    record("fail", why=why)
    raise ToolError(f"failed on purpose: {why}")


@server.tool()
async def hang(tag: str) -> str:
    """Never answers; records being cancelled."""
    record("hang_started", tag=tag)
    try:
        await anyio.sleep(3600)
    except anyio.get_cancelled_exc_class():
        record("hang_cancelled", tag=tag)
        raise
    return "unreachable"


@server.tool()
def crash(tag: str) -> str:
    """Kills this server process mid-call."""
    record("crash", tag=tag)
    os._exit(3)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def whoami() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def grow(name: str) -> str:
    """Adds a read-only tool called `name` (the next tools/list shows it)."""

    def added() -> str:
        return f"{name} is here"

    server.add_tool(added, name=name, description=f"Added at run time as {name}.",
                    annotations=ToolAnnotations(readOnlyHint=True))
    return f"added {name}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def big(size: int) -> str:
    """A result of `size` characters."""
    return "x" * size


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
