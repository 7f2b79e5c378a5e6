"""A throwaway PostgreSQL cluster for the tests: one per test session, shared by its workers.

The cluster lives in a temporary folder named by `GATEWAY_TEST_PG_DIR`, which the session's
first process (pytest-xdist's controller, or the only process) sets in `pytest_configure`
and its workers inherit, as they inherit the zygote's socket. Nothing starts until a test
asks: the first process that needs the cluster takes a lock on the folder, runs `initdb`
and `pg_ctl start` there (as the `postgres` user when we are root: PostgreSQL refuses to
run as root) on a free port, and writes the port down; the others read it. The session's
first process stops the cluster at its end (`stop`). Each test module (or test) then gets
a schema of its own (`new_schema`).

The server binaries are Debian's (`postgresql`, installed by scripts/install-test-deps.sh):
`/usr/lib/postgresql/<version>/bin`, or whatever `pg_ctl` is on the PATH.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "GATEWAY_TEST_PG_DIR"
USER = "postgres"
START_TIMEOUT_S = 60


def bin_dir() -> Path | None:
    """Where initdb and pg_ctl are (the newest Debian version first), or None."""
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]),
                            reverse=True):
        if (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def prepare() -> str:
    """The session's cluster folder (made, not started), named in the environment for workers."""
    folder = os.environ.get(ENV)
    if not folder:
        folder = tempfile.mkdtemp(prefix="gwpg")
        os.chmod(folder, 0o755)
        os.environ[ENV] = folder
    return folder


def _as_postgres() -> list[str]:
    """The prefix that runs a command as the `postgres` user when we are root."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", USER, "--"] if shutil.which("runuser") else ["su", USER, "-s", "/bin/sh", "-c"]


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
    prefix = _as_postgres()
    if prefix and prefix[0] == "su":
        import shlex

        return subprocess.run([*prefix, shlex.join(cmd)], capture_output=True, check=False, **kw)  # type: ignore[call-overload]
    return subprocess.run([*prefix, *cmd], capture_output=True, check=False, **kw)  # type: ignore[call-overload]


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def dsn(database: str = "postgres") -> str:
    """The DSN of the session's cluster, started by the first caller."""
    folder = Path(prepare())
    with _locked(folder):
        port_file = folder / "port"
        if port_file.exists() and _answers(folder, int(port_file.read_text())):
            return f"postgresql://{USER}@127.0.0.1:{int(port_file.read_text())}/{database}"
        port = _start(folder)
        port_file.write_text(str(port))
    return f"postgresql://{USER}@127.0.0.1:{port}/{database}"


def _answers(folder: Path, port: int) -> bool:
    tools = bin_dir()
    if tools is None:
        return False
    return subprocess.run([str(tools / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-q"],
                          check=False).returncode == 0


def _start(folder: Path) -> int:
    from tests.support.procs import free_port

    tools = bin_dir()
    if tools is None:
        raise RuntimeError("PostgreSQL is not installed (pg_ctl not found); scripts/install-test-deps.sh installs "
                           "Debian's postgresql")
    data = folder / "data"
    if os.geteuid() == 0:
        uid, gid = pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid
        os.chown(folder, uid, gid)
    if not data.exists():
        done = _run([str(tools / "initdb"), "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8",
                     "--no-sync", "--locale", "C"])
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.decode(errors='replace')}")
    for _attempt in range(3):  # a free port can be taken before the server binds it
        port = free_port()
        options = (f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off"
                   " -c full_page_writes=off -c max_connections=400 -c shared_buffers=64MB")
        done = _run([str(tools / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(folder / "server.log"),
                     "-w", "-t", str(START_TIMEOUT_S), "start"])
        if done.returncode == 0:
            return port
        log = (folder / "server.log").read_text(errors="replace") if (folder / "server.log").exists() else ""
        if "already in use" not in log:
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.decode(errors='replace')}\n{log[-2000:]}")
    raise RuntimeError("PostgreSQL could not bind a free port in 3 attempts")


def stop(folder: str) -> None:
    """Stop the cluster of `folder` (if one was started) and remove the folder."""
    path = Path(folder)
    tools = bin_dir()
    if tools is not None and (path / "data" / "postmaster.pid").exists():
        _run([str(tools / "pg_ctl"), "-D", str(path / "data"), "-m", "immediate", "-w", "stop"])
    shutil.rmtree(path, ignore_errors=True)


def new_schema(prefix: str = "t") -> str:
    """A schema name no other test uses."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def wait_until_down(port: int, timeout_s: float = 10.0) -> None:
    tools = bin_dir()
    deadline = time.monotonic() + timeout_s
    while tools is not None and time.monotonic() < deadline:
        if subprocess.run([str(tools / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-q"],
                          check=False).returncode != 0:
            return
        time.sleep(0.05)  # poll interval


class Cluster:
    """A PostgreSQL cluster of a test's own on a fixed port, for the fault tests: `stop` and
    `start` keep the port and the data, `freeze`/`thaw` SIGSTOP/SIGCONT the server and every
    backend, `kill` is a crash (SIGKILL of the postmaster and its children)."""

    def __init__(self) -> None:
        from tests.support.procs import free_port

        # Not under pytest's tmp_path: its folders are private to root, and the server runs as postgres.
        self.folder = Path(tempfile.mkdtemp(prefix="gwpgc"))
        os.chmod(self.folder, 0o755)
        self.port = free_port()
        self.settings = "-c fsync=off -c max_connections=200"
        """Server settings (`-c name=value`); the tests' are not durable: a crash of the machine is not tested."""

    @property
    def dsn(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def store(self, **extra: object) -> dict[str, object]:
        """A `store:` config on this cluster."""
        return {"kind": "postgres", "dsn": self.dsn, "schema": "gateway", **extra}

    def start(self) -> None:
        tools = bin_dir()
        assert tools is not None, "PostgreSQL is not installed (scripts/install-test-deps.sh)"
        data = self.folder / "data"
        if os.geteuid() == 0:
            os.chown(self.folder, pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid)
        if not data.exists():
            done = _run([str(tools / "initdb"), "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8",
                         "--no-sync", "--locale", "C"])
            assert done.returncode == 0, done.stderr
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 {self.settings}"
        done = _run([str(tools / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.folder / "server.log"),
                     "-w", "-t", str(START_TIMEOUT_S), "start"])
        assert done.returncode == 0, (done.stderr, (self.folder / "server.log").read_text(errors="replace")[-2000:])

    def stop(self) -> None:
        """A fast shutdown (connections are closed, as in a failover)."""
        tools = bin_dir()
        assert tools is not None
        self.thaw()
        _run([str(tools / "pg_ctl"), "-D", str(self.folder / "data"), "-m", "fast", "-w", "stop"])

    def remove(self) -> None:
        """Stop the cluster (immediately) and delete its folder."""
        self.thaw()
        stop(str(self.folder))

    def running(self) -> bool:
        return (self.folder / "data" / "postmaster.pid").exists()

    def _pids(self) -> list[int]:
        pid_file = self.folder / "data" / "postmaster.pid"
        if not pid_file.exists():
            return []
        main = int(pid_file.read_text().split()[0])
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == main]
        return [main, *children]

    def freeze(self) -> None:
        import signal

        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        import signal

        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
