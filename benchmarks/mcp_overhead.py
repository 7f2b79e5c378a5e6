"""The gateway's own time per MCP tool call, against calling the same server directly.

The test server written with the `mcp` SDK (tests/mcptools/server.py, its read-only
`lookup` tool) runs twice over the same transport: once behind the gateway's tool path
(a policy with an `mcp:` entry, loaded with a real `McpHub`; each call goes through
`harness.execute`: the argument check against the discovered schema, the hop to the
hub's thread, `tools/call`, the result flattened to text) and once behind a plain SDK
`Client` on this loop. Both include the same server time and wire, so the difference
of the medians is what the gateway adds per call. Blocks of calls alternate between the
two so a busy machine slows both alike.

Run: .venv/bin/python benchmarks/mcp_overhead.py [--calls 300] [--rounds 3] [--transport stdio|http|both]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import yaml
from mcp import Client
from mcp.client.stdio import StdioServerParameters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.harness.execute import CancelScope, execute  # noqa: E402
from gateway.harness.tools import ToolContext  # noqa: E402
from gateway.mcp.hub import McpHub  # noqa: E402
from gateway.policy.executors import ToolEnv, build_tool  # noqa: E402
from gateway.policy.schema import load_policy  # noqa: E402
from tests.mcptools.fixtures import http_server  # noqa: E402

SERVER = [sys.executable, "-m", "tests.mcptools.server"]
ARGS = {"key": "k"}


async def timed(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def measure(transport: str, url: str | None, folder: Path, calls: int, rounds: int) -> None:
    entry: dict[str, object] = ({"name": "bench", "url": url} if url else
                                {"name": "bench", "command": SERVER, "cwd": str(ROOT)})
    path = folder / f"bench-{transport}.yaml"
    path.write_text(yaml.safe_dump({"name": "bench", "mcp": [{**entry, "include": ["lookup"]}]}))
    hub = McpHub()
    try:
        decl = load_policy(path, hub).tools[0]
        tool = build_tool(decl, ToolEnv())
        ctx = ToolContext(run_id="bench", call_id="c", tool_name=tool.name, cancelled=asyncio.Event())
        scope = CancelScope()

        async def through_gateway() -> object:
            done = await execute(tool, ARGS, ctx, scope)
            assert done.outcome == "ok", done
            return done

        target: object = url if url else StdioServerParameters(command=SERVER[0], args=SERVER[1:], cwd=str(ROOT))
        async with Client(target, cache=None) as client:  # type: ignore[arg-type]
            async def direct() -> object:
                result = await client.call_tool("lookup", ARGS)
                assert not result.is_error
                return result

            await timed(direct, 20)  # warm both paths
            await timed(through_gateway, 20)
            gateway: list[float] = []
            sdk: list[float] = []
            for _ in range(rounds):
                sdk += await timed(direct, calls)
                gateway += await timed(through_gateway, calls)
    finally:
        await hub.aclose()
    g50, d50 = statistics.median(gateway) * 1000, statistics.median(sdk) * 1000
    g99 = statistics.quantiles(gateway, n=100)[98] * 1000
    d99 = statistics.quantiles(sdk, n=100)[98] * 1000
    print(f"{transport}: {len(sdk)} calls each. SDK direct p50 {d50:.3f} ms p99 {d99:.3f} ms; "
          f"through the gateway p50 {g50:.3f} ms p99 {g99:.3f} ms; "
          f"gateway's own time per call (p50 difference) {g50 - d50:.3f} ms, ratio {g50 / d50:.2f}x")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=300, help="calls per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per path, alternating")
    parser.add_argument("--transport", choices=["stdio", "http", "both"], default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.transport in ("stdio", "both"):
            await measure("stdio", None, folder, args.calls, args.rounds)
        if args.transport in ("http", "both"):
            with http_server(folder / "server.jsonl") as url:
                await measure("http", url, folder, args.calls, args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
