"""Process health on /metrics: the standard process and GC collectors, the event loop's lag,
the connections to the upstreams (docs/metrics.md, "Process health").

- One process: prometheus-client's own `ProcessCollector` (`process_*`, read from /proc at
  scrape), `GCCollector` (`python_gc_*`) and `PlatformCollector` (`python_info`), in the
  app's registry.
- `gateway serve --workers N` (multiprocess mode): a scrape lands on any worker, which
  answers for all of them, so each figure carries the `pid` of the worker it is about
  (as prometheus-client's multiprocess gauges do). `WorkersCollector` reads every live
  worker's `process_*` from /proc at scrape, and its `python_gc_*` from the small file each
  worker rewrites every `GC_FILE_S` (a process cannot read another's collector).

`gateway.server.process_health` samples what changes between scrapes (the loop's lag, the
upstream connections, the GC file of a worker).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import orjson
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, Metric

GC_FILE_S: Final = 2.0
"""How often a worker rewrites its GC file."""
GC_FILE_PREFIX: Final = "process_"
"""`process_<pid>.json` in the multiprocess folder: a worker's GC figures."""


def register_standard(registry: CollectorRegistry) -> None:
    """The standard collectors of one process, in `registry`."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def gc_file(folder: str, pid: int) -> Path:
    return Path(folder) / f"{GC_FILE_PREFIX}{pid}.json"


def publish_gc(folder: str) -> None:
    """This worker's `gc.get_stats()`, for whichever worker a scrape lands on (written whole: renamed into place)."""
    path = gc_file(folder, os.getpid())
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(gc.get_stats()))
    os.replace(tmp, path)


def forget_worker(folder: str, pid: int) -> None:
    """A worker died: its GC file goes with it (the supervisor calls this)."""
    with contextlib.suppress(OSError):
        gc_file(folder, pid).unlink()


_GC_FAMILIES: Final = (("python_gc_objects_collected", "Objects collected during gc", "collected"),
                       ("python_gc_objects_uncollectable", "Uncollectable objects found during GC", "uncollectable"),
                       ("python_gc_collections", "Number of times this generation was collected", "collections"))


class WorkersCollector:
    """`process_*` and `python_gc_*` of every live worker, each labelled with its `pid`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _workers(self) -> list[tuple[int, list[dict[str, Any]]]]:
        own = os.getpid()
        found: list[tuple[int, list[dict[str, Any]]]] = [(own, gc.get_stats())]
        for path in Path(self.folder).glob(f"{GC_FILE_PREFIX}*.json"):
            try:
                pid = int(path.stem.removeprefix(GC_FILE_PREFIX))
            except ValueError:
                continue
            if pid == own or not Path(f"/proc/{pid}").exists():
                continue
            try:
                stats = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue
            if isinstance(stats, list):
                found.append((pid, stats))
        return sorted(found)

    def collect(self) -> Iterable[Metric]:
        workers = self._workers()
        families: dict[str, Metric] = {}
        for pid, _ in workers:
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():  # type: ignore[misc]
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    merged.samples.append(sample._replace(labels={**sample.labels, "pid": str(pid)}))
        yield from families.values()
        for name, doc, key in _GC_FAMILIES:
            counter = CounterMetricFamily(name, doc, labels=["generation", "pid"])
            for pid, stats in workers:
                for generation, figures in enumerate(stats):
                    if isinstance(figures, dict) and isinstance(figures.get(key), int):
                        counter.add_metric([str(generation), str(pid)], figures[key])
            yield counter
