"""Process health on /metrics of real gateway processes: one alone, and `--workers 2`.

`process_*` and `python_gc_*` (the standard collectors; with workers, each worker's labelled
by its pid, whichever worker answers the scrape), the event loop's lag, the upstream
connections and the store's latency by operation. A worker killed with SIGKILL is started
again: the dead one's figures go, the new one's come.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.metrics.exposition import Exposition, parse
from tests.server.served import DEMO
from tests.support.procs import Proc, free_port, start_gateway

WAIT_S = 60.0


def _start(folder: Path, workers: int) -> Proc:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (folder / "policies").mkdir(exist_ok=True)
    (folder / "policies" / "passthrough.yaml").write_text(yaml.safe_dump({"name": "passthrough"}))
    config = {"server": {"host": "127.0.0.1", "port": port}, "store": {"kind": "sqlite", "path": "./gateway.db"},
              "policies_dir": "./policies", "upstreams": [{"name": "scripted", "kind": "scripted"}],
              "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
              "teams": [{"name": "demo", "keys": [DEMO], "policies": ["passthrough"]}], "access_log": False}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return start_gateway(["serve", "--config", str(folder / "config.yaml"), "--workers", str(workers)], "/healthz",
                         port, folder / "gateway.log")


def scrape(url: str) -> Exposition:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def call(url: str) -> None:
    request = urllib.request.Request(url + "/v1/chat/completions", data=b'{"model": "scripted-plan", "messages": '
                                     b'[{"role": "user", "content": "hi"}]}',
                                     headers={"Authorization": f"Bearer {DEMO}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200


def pids(exposition: Exposition, sample: str) -> set[str]:
    return exposition.label_values(sample, "pid")


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = _start(tmp_path_factory.mktemp("alone"), 1)
    try:
        yield proc
    finally:
        proc.stop()


def test_one_process_exports_the_standard_collectors_and_its_own_health(alone: Proc) -> None:
    call(alone.url)
    got = scrape(alone.url)
    assert got.types["process_resident_memory_bytes"] == "gauge"
    assert got.total("process_resident_memory_bytes") > 10_000_000
    assert got.total("process_cpu_seconds_total") > 0
    assert got.total("process_open_fds") > 0
    assert got.types["python_gc_collections_total"] == "counter"
    assert got.label_values("python_gc_collections_total", "generation") == {"0", "1", "2"}
    assert not pids(got, "process_resident_memory_bytes")  # one process: no pid label
    assert got.types["gateway_event_loop_lag_seconds"] == "gauge"
    assert 0 <= got.total("gateway_event_loop_lag_seconds") < 5
    ops = got.label_values("gateway_store_seconds_count", "op")
    assert {"admit", "commit_turn"} <= ops, ops  # a pass-through call's store steps, timed
    assert got.total("gateway_store_seconds_count", op="admit") >= 1
    assert got.label_values("gateway_upstream_connections", "state") == {"in_use", "idle"}

    def connections() -> float:
        return scrape(alone.url).total("gateway_upstream_connections", state="idle")

    deadline = time.monotonic() + WAIT_S
    while connections() < 1:  # the call's connection to the scripted upstream, kept alive (sampled every second)
        assert time.monotonic() < deadline
        time.sleep(0.1)  # poll interval: the sampler runs on its own schedule


def test_every_worker_reports_its_own_process_and_gc(tmp_path: Path) -> None:
    proc = _start(tmp_path / "workers", 2)
    try:
        def workers() -> set[str]:
            try:
                got = scrape(proc.url)
            except (OSError, urllib.error.URLError):  # a connection the killed worker had accepted
                return set()
            return {pid for pid in pids(got, "process_resident_memory_bytes") & pids(got, "python_gc_collections_total")
                    & pids(got, "gateway_event_loop_lag_seconds")
                    if got.total("process_resident_memory_bytes", pid=pid) > 10_000_000
                    and got.total("process_start_time_seconds", pid=pid) > 0}

        deadline = time.monotonic() + WAIT_S
        while len(found := workers()) != 2:  # a worker writes its GC file within 2 s of starting
            assert time.monotonic() < deadline, found
            time.sleep(0.1)
        children = {int(p) for p in found}
        assert os.getpid() not in children and proc.popen.pid not in children  # the workers, not the supervisor
        victim = int(sorted(found)[0])
        os.kill(victim, signal.SIGKILL)  # the supervisor starts worker again

        deadline = time.monotonic() + WAIT_S
        while True:
            now = workers()
            if len(now) == 2 and str(victim) not in now:
                break
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
    finally:
        proc.stop()
