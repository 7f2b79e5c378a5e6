"""Real processes for tests: start `python -m gateway ...`, wait until it answers, kill it.

Readiness is polled over HTTP (not slept for); SIGKILL is available for crash tests.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import zygote

ROOT = Path(__file__).resolve().parents[2]


START_TIMEOUT_S = 120.0
"""A generous readiness wait for a process that a module's tests share: on a loaded 2-core
machine a gateway has taken more than 30 s to answer, and one slow start fails every test
of the module. The wait ends as soon as the process answers."""


PORTS_FROM = 15000
"""`free_port` hands out ports from here up to the kernel's ephemeral range (32768-60999 by
default, /proc/sys/net/ipv4/ip_local_port_range). A port bound as port 0 comes from that
range, and the suite's many outgoing connections take their local ports from it too: one
could take it between the test's pick and the server's bind, which then fails ("in use").
Below the range only listeners take ports, and each pytest-xdist worker has a slice of its
own (`PORT_SLICES`), whose ports it hands out in turn."""
PORT_SLICES = 16
_PORT_TURN = itertools.count()


def _ephemeral_from() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, below the ephemeral range (`PORTS_FROM`)."""
    high = _ephemeral_from()
    if high - PORTS_FROM < PORT_SLICES * 64:  # an unusual range: leave the choice to the kernel
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...; none in the controller
    index = int(worker[2:]) + 1 if worker[:2] == "gw" and worker[2:].isdigit() else 0
    size = (high - PORTS_FROM) // PORT_SLICES
    start = PORTS_FROM + index % PORT_SLICES * size
    for _ in range(size):
        port = start + next(_PORT_TURN) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}-{start + size - 1}")


_ZYGOTE: list[zygote.Zygote] = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> zygote.Zygote | None:
    """The run's zygote (the one `zygote.SHARED` names, else this process's own, started on
    first use), or None when GATEWAY_TEST_ZYGOTE=0."""
    if not zygote.enabled():
        return None
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            shared = os.environ.get(zygote.SHARED)
            if shared:
                _ZYGOTE.append(zygote.Zygote.join(shared))
            else:
                _ZYGOTE.append(zygote.Zygote.start(Path(tempfile.mkdtemp(prefix="gwz"))))
                atexit.register(_ZYGOTE[0].close)
        return _ZYGOTE[0]


@dataclass
class Proc:
    popen: subprocess.Popen[bytes] | zygote.Child
    url: str
    log: Path

    def kill(self) -> None:
        """SIGKILL: the crash a test wants to survive. A supervisor's workers die with it
        (PR_SET_PDEATHSIG) a moment later: this returns once nothing listens on its port, so
        that a restart on the same port is the restart of a gateway that is gone."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        host, port = self.url.rsplit("//", 1)[1].rsplit(":", 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                return  # refused: the workers are gone too
            time.sleep(0.02)  # polling for the workers' exit

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def wait_http(url: str, proc: subprocess.Popen[bytes] | zygote.Child | None = None, timeout: float = START_TIMEOUT_S, log: Path | None = None) -> None:
    """Poll `url` until it answers any HTTP status; fail early if the process died."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            detail = log.read_text(errors="replace") if log and log.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{detail}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout}s") from None
            time.sleep(0.02)  # polling interval of a readiness probe, not a synchronisation sleep


def wait_said(log: Path, text: str, proc: subprocess.Popen[bytes] | zygote.Child, timeout: float) -> None:
    """Poll `log` until it holds `text`; fail early if the process died."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and text in log.read_text(errors="replace")):
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before it said {text!r}:\n"
                               f"{log.read_text(errors='replace') if log.exists() else ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the process did not say {text!r} within {timeout}s")
        time.sleep(0.02)  # polling a log file, as a readiness probe


TEST_WORKERS = "GATEWAY_TEST_WORKERS"
"""Set (e.g. to 2), every `gateway serve` a test starts runs that many workers (`--workers`),
unless its store is the in-memory one, which cannot be shared: the server tests then run
against a multi-worker gateway."""


TEST_WORKERS_FILES = "GATEWAY_TEST_WORKERS_FILES"
"""Set to a folder, each test file that starts a gateway GATEWAY_TEST_WORKERS would change
leaves its name there (`/` as `%`): `scripts/test` runs only those files again against
2-worker gateways, since every other test would run exactly as it just did."""


def with_test_workers(args: Sequence[str], cwd: Path) -> list[str]:
    """`args` plus `--workers N` when GATEWAY_TEST_WORKERS asks for it and the config allows."""
    if not args or args[0] != "serve" or "--workers" in args:
        return list(args)
    config = Path(args[list(args).index("--config") + 1] if "--config" in args else "config.yaml")
    try:
        kind = (yaml.safe_load((cwd / config).read_text()) or {}).get("store", {}).get("kind", "sqlite")
    except (OSError, yaml.YAMLError, AttributeError):
        return list(args)
    if kind == "memory":
        return list(args)
    _note_test_file()
    workers = os.environ.get(TEST_WORKERS)
    return [*args, "--workers", workers] if workers else list(args)


def _note_test_file() -> None:
    folder, test = os.environ.get(TEST_WORKERS_FILES), os.environ.get("PYTEST_CURRENT_TEST")
    if folder and test:
        (Path(folder) / test.split("::")[0].replace("/", "%")).touch()


def start_gateway(args: Sequence[str], ready_path: str, port: int, log: Path, cwd: Path | None = None,
                  env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S, fresh: bool = False) -> Proc:
    """Start `python -m gateway <args>` and wait for `http://127.0.0.1:<port><ready_path>`.

    The process is forked from this test process's zygote (tests/support/zygote.py), which
    has already imported the gateway, unless `fresh` asks for a new interpreter."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    given = list(args)
    args = with_test_workers(args, cwd or ROOT)
    if args != given:  # N interpreters start at once on a shared machine
        timeout *= 2
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    warm = None if fresh else _zygote()
    popen: subprocess.Popen[bytes] | zygote.Child
    if warm is not None:
        popen = warm.spawn(list(args), cwd or ROOT, full_env, log)
    else:
        with log.open("wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", "gateway", *args], cwd=cwd or ROOT, env=full_env,
                                     stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ready_path, popen, timeout, log)
        if args != given:  # one worker answered; a call may land on another still starting
            wait_said(log, f"{args[args.index('--workers') + 1]} workers serving", popen, timeout)
    except BaseException:  # not ready in time: never leave it serving behind the test's back
        Proc(popen, url, log).stop()
        raise
    return Proc(popen, url, log)


def run_gateway(args: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m gateway <args>` to its end, like `subprocess.run(..., capture_output=True,
    text=True)`: forked from the zygote (see `start_gateway`) unless it is turned off."""
    warm = _zygote()
    full_env = dict(os.environ) if env is None else dict(env)
    if warm is None:
        return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=cwd or ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="gwrun") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = warm.spawn(list(args), cwd or ROOT, full_env, out, err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
            raise
        return subprocess.CompletedProcess(child.args, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def start_scripted(folder: Path) -> Proc:
    """`gateway scripted` on a free port (log in `folder`): the scripted provider alone, open by design."""
    port = free_port()
    return start_gateway(["scripted", "--port", str(port)], "/healthz", port, folder / "scripted.log")


@contextlib.contextmanager
def serving_config(folder: Path, config: dict[str, Any]) -> Iterator[Proc]:
    """`gateway serve` with `config` written to `folder`/config.yaml (its `server.port`), stopped on exit."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", int(config["server"]["port"]),
                         folder / "gateway.log")
    try:
        yield proc
    finally:
        proc.stop()
