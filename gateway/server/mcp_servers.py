"""The gateway process's MCP servers: stopped on shutdown, and their health in /metrics.

`build_app` makes the process's `McpHub` (`app[ctx.MCP]`) before it loads the policies,
which discover their servers' tools through it; this module stops every server when the
app shuts down (`cleanup_ctx`) and exports each server's state at every scrape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.mcp.hub import McpHub
from gateway.server import context as ctx


def setup(app: web.Application) -> None:
    """Stop the servers at shutdown; export their health (called by `build_app`)."""
    app.cleanup_ctx.append(_lifecycle)
    app[ctx.METRICS].registry.register(HealthCollector(app[ctx.MCP]))


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[ctx.MCP].aclose()


class HealthCollector:
    """`gateway_mcp_server_up{server}`, `..._starts_total`, `..._failures_total`, read at scrape time."""

    def __init__(self, hub: McpHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_mcp_server_up", "1 while the MCP server's session is up, else 0.",
                               labels=["server"])
        starts = CounterMetricFamily("gateway_mcp_server_starts", "Sessions started with the MCP server "
                                     "(more than one: it was restarted).", labels=["server"])
        failures = CounterMetricFamily("gateway_mcp_server_failures", "Times the MCP server died or could "
                                       "not be started.", labels=["server"])
        seen: dict[str, int] = {}
        for health in self.hub.health():
            seen[health.name] = seen.get(health.name, 0) + 1
            label = health.name if seen[health.name] == 1 else f"{health.name}@{seen[health.name]}"
            up.add_metric([label], 1.0 if health.up else 0.0)
            starts.add_metric([label], float(health.starts))
            failures.add_metric([label], float(health.failures))
        yield up
        yield starts
        yield failures
