"""What keeps `gateway serve` from starting is one line and exit 2, before any `serving` line.

Real `gateway serve` processes (one process, and `--workers 2`): a port some other process
listens on, a port a running gateway serves (which must not be touched: its reservations
stay held, and a second `--workers` gateway must not share its port through SO_REUSEPORT),
the `metrics.listen` port in use, and the config's own problems (a config that is a folder
or not UTF-8 text, a missing policies folder, a SQLite folder that cannot be written).
Each says one line on stderr, no traceback, and exits 2. With `--workers 2`, a separate
metrics listener serves (every worker listens on it, as on the main port).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.store.sqlite import SqliteStore
from tests.server.conftest import KEY, config_data, write_config
from tests.server.served import poll
from tests.support.procs import Proc, free_port, run_gateway, start_gateway

TASK = [{"role": "user", "content": "Which file mentions a timeout?"}]


@pytest.fixture
def busy() -> Iterator[int]:
    """A port another process (this test) listens on."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield int(holder.getsockname()[1])


def config(folder: Path, **changes: Any) -> Path:
    data = config_data(server={"port": free_port()})
    for key, value in changes.items():
        data[key] = value
    return write_config(folder, data)


def refused(done: subprocess.CompletedProcess[str], starts: str) -> str:
    """The one line a start that failed said (asserted: exit 2, one line, nothing else)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"gateway: {starts}"), done.stderr[-3000:]
    assert "serving" not in done.stderr + done.stdout and "Traceback" not in done.stderr
    return lines[0]


WORKERS = pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one-process", "two-workers"])


@WORKERS
def test_a_busy_port_is_one_line(tmp_path: Path, busy: int, workers: list[str]) -> None:
    done = run_gateway(["serve", "--config", str(config(tmp_path)), "--port", str(busy), *workers])
    line = refused(done, f"port {busy} is in use: ")
    assert f"127.0.0.1:{busy}" in line and "--port" in line


@WORKERS
def test_a_busy_metrics_port_is_one_line(tmp_path: Path, busy: int, workers: list[str]) -> None:
    done = run_gateway(["serve", "--config", str(config(tmp_path, metrics={"listen": f"127.0.0.1:{busy}"})),
                        *workers])
    assert "metrics.listen" in refused(done, f"port {busy} is in use: ")


def drop_policies(folder: Path) -> None:
    for path in (folder / "policies").iterdir():
        path.unlink()
    (folder / "policies").rmdir()


PROBLEMS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("config-is-a-folder", lambda folder: folder, "config error: "),
    ("config-not-utf8", lambda folder: _written(folder / "bad.yaml", b"server: {port: \xff}\n"),
     "config error: "),
    ("no-policies-folder", lambda folder: _then(config(folder), drop_policies, folder), "config error: "),
    ("sqlite-folder-unwritable", lambda folder: config(folder, store={"kind": "sqlite",
                                                                      "path": "/proc/self/gw/gateway.db"}),
     "config error: "),
    ("sqlite-folder-is-a-file", lambda folder: config(folder, store={"kind": "sqlite",
                                                                     "path": str(folder / "policies" / "strict.yaml"
                                                                                 / "gateway.db")}),
     "config error: "),
]


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _then(path: Path, act: Callable[[Path], None], folder: Path) -> Path:
    act(folder)
    return path


@pytest.mark.parametrize(("make", "starts"), [(m, s) for _, m, s in PROBLEMS], ids=[n for n, _, _ in PROBLEMS])
def test_a_config_that_cannot_serve_is_one_line(tmp_path: Path, make: Callable[[Path], Path], starts: str) -> None:
    done = run_gateway(["serve", "--config", str(make(tmp_path))])
    refused(done, starts)


@pytest.mark.parametrize("name", ["no-policies-folder", "sqlite-folder-unwritable"])
def test_workers_that_cannot_start_say_it_once(tmp_path: Path, name: str) -> None:
    """Every worker meets the problem; the supervisor says it once (not once per worker,
    nor with a line of its own)."""
    make, starts = next((m, s) for n, m, s in PROBLEMS if n == name)
    done = run_gateway(["serve", "--config", str(make(tmp_path)), "--workers", "2"], timeout=120)
    refused(done, starts)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}", **(headers or {})}) as resp:
        return resp.status, await resp.json()


async def active(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether a call is in flight (admitted, not yet booked) at the gateway."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return any(float(line.split()[-1]) >= 1 for line in text.splitlines() if line.startswith("gateway_runs_active "))


async def test_a_second_gateway_on_a_running_ones_port_leaves_it_alone(tmp_path: Path) -> None:
    """Gateway A holds most of its team's budget for a call in flight; gateway B, started on
    A's port with A's config (so with A's name in the store), must fail before it touches
    the store: A's hold stays, and the team's next call is still refused."""
    port = free_port()
    # renewals of the hold every 20 s: one that B deleted would not come back while the test looks
    data = config_data(server={"port": port, "lease_ttl_s": 60}, team={"budget_usd": 0.05, "budget_period": "total"})
    path = write_config(tmp_path, data)
    a = start_gateway(["serve", "--config", str(path)], "/healthz", port, tmp_path / "a.log")
    big = {"model": "scripted-plan", "messages": TASK, "max_tokens": 3000}  # holds ~$0.036 of the $0.05
    try:
        async with aiohttp.ClientSession() as session:
            held = asyncio.ensure_future(post(session, a.url, big, {"X-Scripted-Latency-Ms": "30000"}))
            await poll(lambda: active(session, a.url))  # admitted: it holds its reservation
            status, reply = await post(session, a.url, big)
            assert status == 429 and reply["error"]["type"] == "team_budget_exceeded", reply
            done = await asyncio.to_thread(run_gateway, ["serve", "--config", str(path)])
            refused(done, f"port {port} is in use: ")
            store = SqliteStore(tmp_path / "gateway.db")
            try:
                _, reserved = await store.team_spend("t", "total")
            finally:
                await store.close()
            assert reserved > 0.03  # A's hold is intact (before: B's start deleted it as its own)
            status, reply = await post(session, a.url, big)
            assert status == 429 and reply["error"]["type"] == "team_budget_exceeded", reply
            held.cancel()
    finally:
        a.stop()


def test_a_second_workers_gateway_does_not_share_the_port(tmp_path: Path) -> None:
    """SO_REUSEPORT would let a second `--workers` gateway listen beside the first one's
    workers (and take half its connections): it is refused like any busy port."""
    first = tmp_path / "first"
    path = config(first)
    port = yaml.safe_load(path.read_text())["server"]["port"]
    proc = start_gateway(["serve", "--config", str(path), "--workers", "2"], "/healthz", port,
                         first / "gateway.log", timeout=240)
    try:
        done = run_gateway(["serve", "--config", str(config(tmp_path / "second")), "--port", str(port),
                            "--workers", "2"], timeout=60)
        refused(done, f"port {port} is in use: ")
    finally:
        proc.stop()


async def test_workers_serve_a_separate_metrics_listener(tmp_path: Path) -> None:
    metrics_port = free_port()
    path = config(tmp_path, metrics={"listen": f"127.0.0.1:{metrics_port}"})
    port = yaml.safe_load(path.read_text())["server"]["port"]
    proc: Proc = start_gateway(["serve", "--config", str(path), "--workers", "2"], "/healthz", port,
                               tmp_path / "gateway.log", timeout=240)
    try:
        async def all_serve() -> bool:  # the supervisor's line once every worker listens (both ports)
            assert proc.popen.poll() is None, proc.output()[-3000:]
            return "workers serving" in proc.output()

        await poll(all_serve, timeout=240)
        async with aiohttp.ClientSession() as session:
            status, reply = await post(session, proc.url, {"model": "scripted-plan", "messages": TASK})
            assert status == 200, reply
            async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                assert resp.status == 200
                assert 'route="/v1/chat/completions"' in await resp.text()
    finally:
        proc.stop()
