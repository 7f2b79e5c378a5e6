"""grafana/docker-compose.yml's gateway, checked without Docker (no daemon nor compose
plugin here): the parts that decide whether it works, read from the files themselves.

- what the gateway writes (SQLite store, runs, trace, spool) is on a volume, not in the
  container's own layer;
- every upstream key variable of its config is passed from the host's environment;
- no upstream is addressed as loopback (inside a container that is the container itself):
  `local` is the host, named through `extra_hosts`;
- the healthcheck asks /healthz on the served port, and its command, run against a real
  gateway on this config, passes while it serves and fails once it is gone;
- its config is the shipped config.yaml but for those settings, so the two cannot drift.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.config.settings import load_config
from tests.support.procs import ROOT, START_TIMEOUT_S, free_port, start_gateway

GRAFANA = ROOT / "grafana"
CONTAINER_CONFIG = GRAFANA / "gateway.yaml"
DATA = "/data"


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((GRAFANA / "docker-compose.yml").read_text())
    return data


def gateway_service() -> dict[str, Any]:
    service: dict[str, Any] = compose()["services"]["gateway"]
    return service


def test_the_image_serves_the_container_config() -> None:
    service = gateway_service()
    command = service["command"]
    assert command[command.index("--config") + 1] == "gateway.yaml"
    dockerfile = (GRAFANA / "Dockerfile").read_text()
    assert "COPY grafana/gateway.yaml ./gateway.yaml" in dockerfile
    assert "!grafana/gateway.yaml" in (GRAFANA / "Dockerfile.dockerignore").read_text().splitlines()
    load_config(CONTAINER_CONFIG)  # valid as it is


def test_what_the_gateway_writes_is_on_a_volume() -> None:
    volumes = gateway_service()["volumes"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert mounts.get(DATA) == "gateway-data" and "gateway-data" in compose()["volumes"]
    config = load_config(CONTAINER_CONFIG)
    written = [config.store.path, config.runs_dir, config.trace_file, config.spool_file]
    for path in written:
        assert path is not None and Path(str(path)).is_relative_to(DATA), path


def test_every_upstream_key_variable_is_passed_from_the_host() -> None:
    environment = gateway_service()["environment"]
    config = load_config(CONTAINER_CONFIG)
    needed = {u.api_key_env for u in config.upstreams.values() if u.api_key_env}
    assert needed == {"OPENAI_API_KEY"}
    for name in needed:
        assert environment[name] == f"${{{name}:-}}"  # the host's value, empty when it has none


def test_no_upstream_is_the_containers_own_loopback() -> None:
    config = load_config(CONTAINER_CONFIG)
    hosts = {h.split(":")[0] for h in gateway_service()["extra_hosts"]}
    for upstream in config.upstreams.values():
        if upstream.base_url is None:
            continue  # the built-in scripted mount: the gateway's own address, known once it serves
        host = urlsplit(upstream.base_url).hostname or ""
        assert host not in ("127.0.0.1", "localhost", "::1"), upstream
        if upstream.kind == "local":
            assert host == "host.docker.internal" and host in hosts
    assert "host.docker.internal:host-gateway" in gateway_service()["extra_hosts"]


def test_the_container_config_is_the_shipped_one_but_for_the_containers_settings() -> None:
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    container = yaml.safe_load(CONTAINER_CONFIG.read_text())
    shipped["server"]["host"] = "0.0.0.0"
    shipped["store"]["path"] = f"{DATA}/gateway.db"
    shipped["runs_dir"] = f"{DATA}/runs"
    shipped["trace_file"] = f"{DATA}/trace.jsonl"
    shipped["spool_file"] = f"{DATA}/spool.jsonl"
    next(u for u in shipped["upstreams"] if u["name"] == "local")["base_url"] = "http://host.docker.internal:8081/v1"
    assert container == shipped


def test_the_healthcheck_passes_while_the_gateway_serves_and_fails_once_it_is_gone(tmp_path: Path) -> None:
    service = gateway_service()
    check = service["healthcheck"]
    port = int(service["ports"][0].split(":")[-1])
    assert check["test"][0] == "CMD" and f"http://127.0.0.1:{port}/healthz" in check["test"][-1]
    assert compose()["services"]["prometheus"]["depends_on"]["gateway"]["condition"] == "service_healthy"

    # The container's config on this machine: /data is a temp folder, the port a free one.
    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    (tmp_path / "data").mkdir()
    config = tmp_path / "gateway.yaml"
    config.write_text(CONTAINER_CONFIG.read_text().replace(f"{DATA}/", f"{tmp_path}/data/"))
    free = free_port()
    proc = start_gateway(["serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(free)], "/healthz",
                         free, tmp_path / "gateway.log", timeout=START_TIMEOUT_S)
    probe = [sys.executable if part == "python" else part.replace(f":{port}/", f":{free}/")
             for part in check["test"][1:]]
    try:
        assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
        assert (tmp_path / "data" / "gateway.db").exists()  # where the volume is
    finally:
        proc.stop()
    assert subprocess.run(probe, capture_output=True, timeout=30).returncode != 0
