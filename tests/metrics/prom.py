"""A real Prometheus for tests: start it on a free port with a temporary TSDB, query it.

The scrape config is the shipped grafana/prometheus.yml with only the target address and
the intervals rewritten, so the test exercises what users run. Every wait polls
Prometheus's HTTP API; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.support.procs import ROOT, free_port

SHIPPED_CONFIG = ROOT / "grafana" / "prometheus.yml"
JOB = "gateway"
POLL_S = 0.05  # polling interval of the waits below, not a synchronisation sleep

T = TypeVar("T")


def binary(name: str) -> str:
    """Path of a Prometheus binary; a clear failure naming the install script if absent."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found on PATH: run scripts/install-test-deps.sh "
                           "(installs Debian's prometheus package, which provides prometheus and promtool)")
    return path


def scrape_config(target: str | list[str], interval: str = "1s") -> dict[str, Any]:
    """The shipped prometheus.yml, scraping `target` (host:port, or several: replicas) every `interval`."""
    config: dict[str, Any] = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    if len(jobs) != 1:
        raise AssertionError(f"{SHIPPED_CONFIG} must have exactly one job named {JOB!r}")
    jobs[0]["static_configs"] = [{"targets": [target] if isinstance(target, str) else list(target)}]
    return config


class PromError(RuntimeError):
    """Prometheus answered a query with an error."""


@dataclass
class Prometheus:
    """A running Prometheus process and its HTTP API."""

    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PromError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the vector (or a one-element list for a scalar)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)
        result: list[dict[str, Any]] = data["result"]
        return result

    def exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query_exemplars", query=expr, start=f"{start:.3f}", end=f"{end:.3f}")
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": match})
        return values

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The single value of `expr` now (or at `at`), or None if it has no sample."""
        result = self.query(expr, at)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr} returned {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
        """Poll `probe` until it returns something other than None."""
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.popen.returncode} while waiting for {what}:\n"
                                   + self.output())
            value = probe()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus: {what} not seen within {timeout}s\n" + self.output()[-3000:])
            time.sleep(POLL_S)

    def wait_scrape_after(self, after: float, timeout: float = 30.0) -> float:
        """Wait until the gateway job has a successful scrape that started after `after` (unix s)."""
        # A scrape that fails (up 0: past its timeout on a loaded machine) is waited past, not
        # taken for the answer: the next one may succeed. Only a timeout ends the wait.
        def probe() -> float | None:
            result = self.query(f'timestamp(up{{job="{JOB}"}})')
            if not result or float(result[0]["value"][1]) <= after:
                return None
            at = float(result[0]["value"][1])
            return at if self.scalar(f'up{{job="{JOB}"}}', at) == 1.0 else None
        return self.wait_for(f"a successful scrape of job {JOB} after {after:.3f} (see {self.log})", probe, timeout)

    def wait_value(self, expr: str, expected: float, timeout: float = 30.0, tolerance: float = 1e-9) -> float:
        """Wait until the single value of `expr` equals `expected` (within `tolerance`)."""
        def probe() -> float | None:
            value = self.scalar(expr)
            if value is None or not math.isclose(value, expected, rel_tol=0.0, abs_tol=tolerance):
                return None
            return value
        return self.wait_for(f"{expr} == {expected}", probe, timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def start_prometheus(target: str | list[str], workdir: Path, interval: str = "1s", timeout: float = 30.0) -> Prometheus:
    """Start Prometheus scraping `target` every `interval`, TSDB and log under `workdir`.

    Returns once /-/ready answers 200 (about 0.1 s). Its first scrape comes later: the
    discovery manager hands targets over at most every 5 s, so start it early.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(scrape_config(target, interval), sort_keys=False))
    port = free_port()
    log = workdir / "prometheus.log"
    out = log.open("wb")
    popen = subprocess.Popen(
        [binary("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage",
         "--storage.tsdb.retention.time=1h", "--log.level=warn"],
        stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    prom = Prometheus(popen, f"http://127.0.0.1:{port}", log)

    def ready() -> bool | None:
        try:
            with urllib.request.urlopen(prom.url + "/-/ready", timeout=1) as resp:
                return True if resp.status == 200 else None
        except (urllib.error.URLError, ConnectionError, OSError):
            return None

    try:
        prom.wait_for("/-/ready", ready, timeout)
    except BaseException:
        prom.stop()
        raise
    return prom
