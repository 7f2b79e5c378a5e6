"""Real processes for the fault tests: a redis-server that can be stopped, frozen and
restarted on the same port, and a gateway serving the shipped policies on it (or on SQLite).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
import yaml

from tests.server.served import DEMO, OPS, TASK
from tests.support.procs import ROOT, Proc, free_port, start_gateway

FILES_HEADERS = {"X-Policy": "files"}
PLAN_BODY: dict[str, Any] = {"model": "scripted-plan", "messages": TASK}


@dataclass
class RedisProc:
    """A redis-server on a fixed port: `stop`/`start` keep the port (and, with no
    persistence, start empty unless `appendonly`), `freeze`/`thaw` SIGSTOP/SIGCONT it."""

    folder: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    appendonly: bool = True
    args: tuple[str, ...] = ()
    """More redis-server arguments (e.g. `--replicaof HOST PORT`)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server is not installed (apt-get install -y redis-server)"
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "redis.log").open("ab")
        self.popen = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always", "--dir", str(self.folder),
             *self.args],
            stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + 15
        try:
            while True:
                assert self.popen.poll() is None, (self.folder / "redis.log").read_text(errors="replace")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)  # readiness poll interval, not a synchronisation stand-in
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the crash of a master that a failover follows."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self.popen = None

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            self.popen.wait(timeout=10)
        self.popen = None

    def freeze(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGCONT)


def files_variant(name: str, **changes: Any) -> dict[str, Any]:
    """The shipped files policy under another name, with top-level fields changed."""
    data: dict[str, Any] = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())
    data.update(name=name, **changes)
    return data


def write_config(folder: Path, port: int, store: dict[str, Any], *, server: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, policies: Sequence[str] = ("passthrough", "files"),
                 variants: Sequence[dict[str, Any]] = ()) -> Path:
    """A gateway config in `folder`: the shipped policies (plus `variants`, which team demo
    may use too), teams demo (sk-demo) and ops (sk-ops)."""
    folder.mkdir(parents=True, exist_ok=True)
    pol = folder / "policies"
    pol.mkdir(exist_ok=True)
    for path in (ROOT / "policies").glob("*.yaml"):
        (pol / path.name).write_text(path.read_text())
    for variant in variants:
        (pol / f"{variant['name']}.yaml").write_text(yaml.safe_dump(variant))
    policies = [*policies, *(v["name"] for v in variants)]
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, **(server or {})},
        "store": store,
        "policies_dir": "./policies",
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "demo", "keys": [DEMO], "budget_usd": 1000.0, "policies": list(policies)},
            {"name": "ops", "keys": [OPS], "budget_usd": None, "policies": ["passthrough"]},
        ],
        **(extra or {}),
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def serve(folder: Path, store: dict[str, Any], **kw: Any) -> Proc:
    """Write the config and start `gateway serve` on it (ready when /v1/models answers)."""
    port = free_port()
    config = write_config(folder, port, store, **kw)
    n = len(list(folder.glob("gateway-*.log"))) + 1
    return start_gateway(["serve", "--config", str(config)], "/v1/models", port, folder / f"gateway-{n}.log")


def restart(proc: Proc, folder: Path) -> Proc:
    """A new process on the same config (after kill/stop)."""
    port = int(proc.url.rsplit(":", 1)[1])
    n = len(list(folder.glob("gateway-*.log"))) + 1
    return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/v1/models", port,
                         folder / f"gateway-{n}.log")


async def chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None, *,
               key: str = DEMO, headers: dict[str, str] | None = None,
               timeout_s: float | None = None) -> tuple[int, dict[str, str], Any]:
    """POST /v1/chat/completions; a call past `timeout_s` raises TimeoutError (a hang)."""
    data = orjson.dumps(body or PLAN_BODY)
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with asyncio.timeout(timeout_s):
        async with session.post(f"{url}/v1/chat/completions", data=data, headers=h) as resp:
            raw = await resp.read()
    try:
        parsed: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        parsed = raw.decode(errors="replace")
    return resp.status, dict(resp.headers), parsed
