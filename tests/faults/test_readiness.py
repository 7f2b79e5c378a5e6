"""GET /livez and /readyz of a real gateway on a real redis-server, while things fail.

The gateway's policies name two MCP servers over streamable HTTP (the test server of
tests/mcptools, restartable on its port): one required, one `optional: true`. Its upstream is
a scripted provider of its own process (`gateway scripted`), so a call can be made slow
(`X-Scripted-Latency-Ms`) without the gateway calling itself.

- Everything up: ready, every check named and passing; alive.
- Redis stopped: not ready (`store`), still alive, /healthz the same as /readyz (503); ready
  again once Redis is back.
- The optional MCP server stopped: still ready. The required one stopped: not ready
  (`mcp`, naming it); once it listens again, the check itself starts its session again.
- SIGTERM: /readyz fails at once while the process still serves (`server.shutdown_delay_s`),
  /livez answers, a call in flight is answered, then the process drains and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.faults.support import RedisProc
from tests.mcptools.fixtures import BIN
from tests.server.served import DEMO, OPS
from tests.support.procs import ROOT, Proc, free_port, start_gateway, start_scripted, wait_http

SHUTDOWN_DELAY_S = 2.0
SLOW_MS = 4000
WAIT_S = 30.0


@dataclass
class McpServer:
    """The test MCP server over HTTP on a fixed port (stop, start again on it)."""

    port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        out = (self.log.parent / f"mcp-{self.port}.out").open("ab")
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.mcptools.server", "http", str(self.port)],
                                      cwd=ROOT, env={"MCP_TEST_LOG": str(self.log), "PATH": str(BIN)},
                                      stdout=out, stderr=subprocess.STDOUT)
        wait_http(self.url, self.popen)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self.popen = None


def get(url: str, path: str, key: str | None = None, headers: dict[str, str] | None = None,
        body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(url + path, data=orjson.dumps(body) if body is not None else None, headers={
        **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def wait_until(check: Any, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)  # the poll interval of a probe, not a synchronisation stand-in


def ready(url: str) -> tuple[int, Any]:
    return get(url, "/readyz")


@dataclass
class Stack:
    folder: Path
    redis: RedisProc
    required: McpServer
    optional: McpServer
    scripted: Proc
    gateway: Proc


def _config(folder: Path, port: int, stack_redis: RedisProc, scripted: str, required: str, optional: str) -> Path:
    policies = folder / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "passthrough.yaml").write_text(yaml.safe_dump({"name": "passthrough"}))
    (policies / "needs.yaml").write_text(yaml.safe_dump(
        {"name": "needs", "mcp": [{"name": "required", "url": required, "include": ["lookup"]}]}))
    (policies / "extra.yaml").write_text(yaml.safe_dump(
        {"name": "extra", "mcp": [{"name": "spare", "url": optional, "include": ["lookup"], "optional": True}]}))
    config = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_delay_s": SHUTDOWN_DELAY_S},
        "store": {"kind": "redis", "url": stack_redis.url, "timeout_s": 0.5},
        "policies_dir": str(policies),
        "upstreams": [{"name": "scripted", "kind": "scripted", "base_url": scripted + "/v1"}],
        "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [{"name": "demo", "keys": [DEMO], "policies": ["passthrough", "needs", "extra"]},
                  {"name": "ops", "keys": [OPS], "policies": ["passthrough"]}],
        "access_log": False,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("readiness")
    redis = RedisProc(folder / "redis")
    required = McpServer(free_port(), folder / "mcp.jsonl")
    optional = McpServer(free_port(), folder / "mcp.jsonl")
    scripted = start_scripted(folder)
    started: list[Any] = [scripted]
    try:
        for part in (redis, required, optional):
            part.start()
            started.append(part)
        port = free_port()
        config = _config(folder, port, redis, scripted.url, required.url, optional.url)
        # One process whatever GATEWAY_TEST_WORKERS says: readiness is each process's own (a
        # probe lands on one worker), and these tests follow one process's checks as they turn.
        gateway = start_gateway(["serve", "--config", str(config), "--workers", "1"], "/livez", port,
                                folder / "gateway.log")
        started.append(gateway)
        yield Stack(folder, redis, required, optional, scripted, gateway)
    finally:
        for part in reversed(started):
            part.stop()


def test_ready_names_every_check_and_alive_asks_nothing(stack: Stack) -> None:
    status, body = wait_until(lambda: (r := ready(stack.gateway.url))[0] == 200 and r)
    assert body["status"] == "ready"
    assert body["checks"] == {name: {"ok": True} for name in ("draining", "store", "spool", "policies", "mcp")}
    assert get(stack.gateway.url, "/livez") == (200, {"status": "alive"})


def test_a_stopped_store_is_not_ready_but_alive_and_ready_again_once_back(stack: Stack) -> None:
    url = stack.gateway.url
    wait_until(lambda: ready(url)[0] == 200)
    stack.redis.stop()
    try:
        status, body = ready(url)
        assert status == 503 and body["error"]["code"] == "not_ready" and body["status"] == "not_ready"
        assert body["checks"]["store"] == {"ok": False, "detail": "the store does not answer"}
        assert all(c["ok"] for name, c in body["checks"].items() if name != "store"), body
        assert "store (the store does not answer)" in body["error"]["message"]
        assert get(url, "/livez")[0] == 200
        status, body = get(url, "/healthz")  # the same as /readyz
        assert status == 503 and body["error"]["code"] == "not_ready", body
    finally:
        stack.redis.start()
    wait_until(lambda: ready(url)[0] == 200)


def test_a_required_mcp_server_down_is_not_ready_an_optional_one_is(stack: Stack) -> None:
    url = stack.gateway.url
    wait_until(lambda: ready(url)[0] == 200)
    stack.optional.stop()
    # its session notices only when used: a call to its tool fails, and the gateway stays ready
    status, body = get(url, "/v1/chat/completions", DEMO, {"X-Run-Id": "mcp-spare", "X-Policy": "extra"},
                       {"model": "scripted-plan", "messages": [{"role": "user", "content": "hi"}]})
    assert ready(url)[0] == 200
    stack.required.stop()
    status, body = get(url, "/v1/chat/completions", DEMO, {"X-Run-Id": "mcp-needs", "X-Policy": "needs"},
                       {"model": "scripted-plan", "messages": [{"role": "user", "content": "hi"}]})
    status, body = wait_until(lambda: (r := ready(url))[0] == 503 and r)
    assert body["checks"]["mcp"]["ok"] is False and "'required'" in body["checks"]["mcp"]["detail"]
    assert "spare" not in body["checks"]["mcp"]["detail"]
    stack.required.start()
    stack.optional.start()
    wait_until(lambda: ready(url)[0] == 200)  # the check started the session again


def test_sigterm_fails_readiness_first_then_drains(stack: Stack) -> None:
    url = stack.gateway.url
    wait_until(lambda: ready(url)[0] == 200)

    def slow_call() -> tuple[int, Any]:
        return get(url, "/v1/chat/completions", DEMO, {"X-Run-Id": "slow", "X-Scripted-Latency-Ms": str(SLOW_MS)},
                   {"model": "scripted-plan", "messages": [{"role": "user", "content": "hi"}]})

    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(slow_call)
        wait_until(lambda: "\ngateway_runs_active 1.0" in urllib.request.urlopen(url + "/metrics").read().decode())
        stack.gateway.popen.send_signal(signal.SIGTERM)
        status, body = wait_until(lambda: (r := ready(url))[0] == 503 and r)
        assert body["checks"]["draining"] == {"ok": False, "detail": "the process is shutting down"}
        assert get(url, "/livez")[0] == 200  # alive, still serving: a load balancer stops sending now
        assert get(url, "/v1/models", DEMO)[0] == 200
        assert call.result(timeout=WAIT_S)[0] == 200  # the call in flight is answered
    assert stack.gateway.popen.wait(timeout=WAIT_S) == 0
    assert "having drained" in stack.gateway.output()
    if os.environ.get("GATEWAY_TEST_WORKERS") is None:
        assert "having drained 1 request in flight" in stack.gateway.output()
