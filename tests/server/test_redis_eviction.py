"""`gateway serve` on a Redis that may evict keys: refused at start unless the config allows it.

Real redis-servers started by this test, each set up as a server a user may meet: a
managed offering's `maxmemory-policy allkeys-lru` (the gateway must refuse to start: one
line, exit 2), the same with `store.allow_eviction: true` (it starts, and says what it
risks), `volatile-lru` (refused too: leases and the records of expired reservations carry
a TTL), the default `noeviction` without `appendonly` (it starts and warns), and a server
that refuses CONFIG (managed Redis often does: it starts and says what to make sure of).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.server.conftest import config_data, write_config
from tests.store.conftest import _start_redis
from tests.support.procs import free_port, run_gateway, start_gateway


@pytest.fixture
def redis_with(tmp_path: Path) -> Iterator[object]:
    """Start a redis-server with these extra arguments; yields a function returning its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    started: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> str:
        proc, port = _start_redis(exe, tmp_path, extra=extra)
        started.append(proc)
        return f"redis://127.0.0.1:{port}/0"

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def config(folder: Path, url: str, **store: object) -> tuple[Path, int]:
    port = free_port()
    return write_config(folder, config_data(server={"port": port},
                                            store={"kind": "redis", "url": url, **store})), port


def serve_log(folder: Path, path: Path, port: int) -> str:
    """Start a gateway on `path`, check it serves, stop it; its log."""
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log")
    proc.stop()
    return proc.output()


@pytest.mark.parametrize(("policy", "workers"), [("allkeys-lru", []), ("volatile-lru", []),
                                                 ("allkeys-lru", ["--workers", "2"])])
def test_an_evicting_redis_is_refused_in_one_line(tmp_path: Path, redis_with: object, policy: str,
                                                  workers: list[str]) -> None:
    url = redis_with("--maxmemory", "64mb", "--maxmemory-policy", policy)  # type: ignore[operator]
    path, _ = config(tmp_path, url)
    done = run_gateway(["serve", "--config", str(path), *workers], timeout=90)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"gateway: store: the Redis server's maxmemory-policy is {policy}")
    assert "store.allow_eviction" in lines[0] and "noeviction" in lines[0]
    assert "serving" not in done.stderr and "Traceback" not in done.stderr


def test_allow_eviction_starts_and_says_what_it_risks(tmp_path: Path, redis_with: object) -> None:
    url = redis_with("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")  # type: ignore[operator]
    path, port = config(tmp_path, url, allow_eviction=True)
    log = serve_log(tmp_path, path, port)
    assert "maxmemory-policy is allkeys-lru and store.allow_eviction is true" in log


@pytest.mark.parametrize(("extra", "warning"), [
    ((), "appendonly no"),
    (("--rename-command", "CONFIG", ""), "refuses CONFIG GET"),
])
def test_a_redis_that_is_safe_or_cannot_be_asked_starts_with_a_warning(
        tmp_path: Path, redis_with: object, extra: Sequence[str], warning: str) -> None:
    url = redis_with(*extra)  # type: ignore[operator]
    path, port = config(tmp_path, url)
    log = serve_log(tmp_path, path, port)
    warned = [line for line in log.splitlines() if "WARNING" in line and "store:" in line]
    assert len(warned) >= 1 and warning in warned[0], log[-3000:]
    assert "Traceback" not in log


def test_allow_eviction_is_a_boolean(tmp_path: Path) -> None:
    path, _ = config(tmp_path, "redis://127.0.0.1:1/0", allow_eviction="yes")
    done = run_gateway(["serve", "--config", str(path)])
    assert done.returncode == 2 and "store.allow_eviction" in done.stderr and "true or false" in done.stderr
