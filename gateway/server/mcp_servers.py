"""The gateway process's MCP servers: stopped on shutdown, and their health in /metrics.

`build_app` makes the process's `McpHub` (`app[ctx.MCP]`) before it loads the policies,
which discover their servers' tools through it; this module stops every server when the
app shuts down (`cleanup_ctx`) and exports each server's state: read at every scrape in a
single process (`HealthCollector`); with `--workers`, each worker runs its own copy of
each server, and writes its figures to the shared metrics files whenever they move
(`SharedHealth`): `up` is 1 while the server is up in at least one live worker, the
counters are summed over the workers.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable, Iterator

from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.mcp.hub import McpHub, ServerHealth
from gateway.server import context as ctx

UP_HELP = "1 while the MCP server's session is up, else 0."
STARTS_HELP = "Sessions started with the MCP server (more than one: it was restarted)."
FAILURES_HELP = "Times the MCP server died or could not be started."


def setup(app: web.Application) -> None:
    """Stop the servers at shutdown; export their health (called by `build_app`)."""
    app.cleanup_ctx.append(_lifecycle)
    hub = app[ctx.MCP]
    if app[ctx.METRICS].multiprocess_dir is None:
        app[ctx.METRICS].registry.register(HealthCollector(hub))
    else:
        shared = SharedHealth(hub)
        hub.watch(shared.sync)
        shared.sync()  # the servers the policies' load started already


def labelled(health: Iterable[ServerHealth]) -> Iterator[tuple[str, ServerHealth]]:
    """Each server's `server` label: its name, `name@2` for a second server of that name."""
    seen: dict[str, int] = {}
    for h in health:
        seen[h.name] = seen.get(h.name, 0) + 1
        yield (h.name if seen[h.name] == 1 else f"{h.name}@{seen[h.name]}"), h


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[ctx.MCP].aclose()


class HealthCollector:
    """`gateway_mcp_server_up{server}`, `..._starts_total`, `..._failures_total`, read at scrape time."""

    def __init__(self, hub: McpHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_mcp_server_up", UP_HELP, labels=["server"])
        starts = CounterMetricFamily("gateway_mcp_server_starts", STARTS_HELP, labels=["server"])
        failures = CounterMetricFamily("gateway_mcp_server_failures", FAILURES_HELP, labels=["server"])
        for label, health in labelled(self.hub.health()):
            up.add_metric([label], 1.0 if health.up else 0.0)
            starts.add_metric([label], float(health.starts))
            failures.add_metric([label], float(health.failures))
        yield up
        yield starts
        yield failures


class SharedHealth:
    """The same three metrics in prometheus-client's multiprocess files, kept in step with
    this worker's hub (`sync`, its watcher): counters move by what this worker's servers
    added since the last sync."""

    def __init__(self, hub: McpHub) -> None:
        self.hub = hub
        self.up = Gauge("gateway_mcp_server_up", UP_HELP, ["server"], registry=None, multiprocess_mode="livemax")
        self.starts = Counter("gateway_mcp_server_starts", STARTS_HELP, ["server"], registry=None)
        self.failures = Counter("gateway_mcp_server_failures", FAILURES_HELP, ["server"], registry=None)
        self._shown: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # watchers run on the hub's thread and on the askers'

    def sync(self) -> None:
        with self._lock:
            for label, health in labelled(self.hub.health()):
                starts, failures = self._shown.get(label, (0, 0))
                self.up.labels(label).set(1.0 if health.up else 0.0)
                self.starts.labels(label).inc(max(0, health.starts - starts))
                self.failures.labels(label).inc(max(0, health.failures - failures))
                self._shown[label] = (health.starts, health.failures)
