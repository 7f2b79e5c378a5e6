"""Where a stdio MCP server's program is found: the venv's `gateway` script, started with a
PATH that lacks the venv's `bin` (as `.venv/bin/gateway serve` from a plain shell), finds
`mcp-server-time` next to its own interpreter; a program found nowhere fails the start
with one line naming where it looked. Real processes: the console script pip wrote, the
server pip installed ([test] extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.procs import Proc, free_port, wait_http

BIN = Path(sys.executable).parent
"""The venv's `bin`: the `gateway` script and `mcp-server-time` live there."""
PLAIN_PATH = "/usr/local/bin:/usr/bin:/bin"
"""A shell's PATH without the venv's `bin`."""


def write(folder: Path, command: list[str]) -> Path:
    (folder / "policies").mkdir(parents=True)
    (folder / "policies" / "clock.yaml").write_text(yaml.safe_dump(
        {"name": "clock", "limits": {"max_turns": 4}, "mcp": [{"name": "time", "command": command}]}))
    port = free_port()
    config = {"server": {"host": "127.0.0.1", "port": port}, "store": {"kind": "sqlite", "path": "./gateway.db"},
              "policies_dir": "./policies", "upstreams": [{"name": "scripted", "kind": "scripted"}],
              "models": [{"match": "scripted-*", "upstream": "scripted"}],
              "teams": [{"name": "demo", "keys": ["sk-cmd"], "policies": ["clock"]}]}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def venv_gateway(config: Path, folder: Path) -> subprocess.Popen[bytes]:
    """`.venv/bin/gateway serve` with a PATH that does not hold the venv's `bin`."""
    assert str(BIN) not in PLAIN_PATH.split(os.pathsep)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = PLAIN_PATH
    with (folder / "gateway.log").open("wb") as out:
        return subprocess.Popen([str(BIN / "gateway"), "serve", "--config", str(config)], cwd=folder, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[[list[str]], tuple[Path, subprocess.Popen[bytes]]]]:
    """Starts the venv's gateway in the test's folder on a policy running `command`; stops it at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(command: list[str]) -> tuple[Path, subprocess.Popen[bytes]]:
        config = write(tmp_path, command)
        procs.append(venv_gateway(config, tmp_path))
        return config, procs[-1]

    yield start
    for proc in procs:
        Proc(proc, "", tmp_path / "gateway.log").stop()


def test_a_bare_command_is_found_next_to_the_gateways_interpreter(
        started: Callable[[list[str]], tuple[Path, subprocess.Popen[bytes]]]) -> None:
    config, proc = started(["mcp-server-time"])
    folder = config.parent
    port = yaml.safe_load(config.read_text())["server"]["port"]
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log=folder / "gateway.log")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
        metrics = resp.read().decode()
    assert 'gateway_mcp_server_up{server="time"} 1.0' in metrics, metrics


def test_a_program_found_nowhere_fails_the_start_naming_where_it_looked(
        started: Callable[[list[str]], tuple[Path, subprocess.Popen[bytes]]]) -> None:
    config, proc = started(["mcp-server-nowhere"])
    folder = config.parent
    assert proc.wait(timeout=120) == 2
    log = (folder / "gateway.log").read_text()
    assert (f"program 'mcp-server-nowhere' not found: looked on PATH ({PLAIN_PATH}) and next to the gateway's "
            f"interpreter ({BIN})") in log, log
    assert "Traceback" not in log
