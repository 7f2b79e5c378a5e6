"""A warm parent for the gateway processes the tests start: imported once, forked per start.

A gateway process spends about a second of CPU before it answers: importing aiohttp and
the gateway (~0.6 s) and building the o200k_base encoding (~0.5 s). The suite starts more
than a hundred of them on two cores, so that second is most of its CPU. The zygote pays it
once per test run (pytest-xdist's controller starts one that all its workers share; a
run without xdist starts its own on first use): it imports what `gateway serve` imports,
loads the encoding, then forks a child per start request. The child is a real, separate gateway process: it has
its own pid, environment, working folder and log, runs the same `gateway.cli.main`, and is
stopped or SIGKILLed by pid like any other. What it skips is only the import.

Protocol, over a unix socket, one connection per child: the client sends one JSON line
`{"argv": [...], "cwd": ..., "env": {...}, "log": ...}` (or `"stdout"` and `"stderr"` paths
instead of one `"log"`); the zygote answers `{"pid": N}`,
then, once the child has exited, `{"returncode": R, "cpu_s": C}` (R negative: killed by that
signal, as `subprocess` reports it; C: the child's CPU seconds) and closes the connection. The zygote exits when its stdin closes
(the process that started it is gone).

`GATEWAY_TEST_ZYGOTE=0` turns it off: every start is then a fresh interpreter.
"""

from __future__ import annotations

import gc
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


SHARED = "GATEWAY_TEST_ZYGOTE_SOCKET"
"""The environment variable naming a zygote's socket that this process's tests share."""


def enabled() -> bool:
    """Whether gateway processes are forked from a zygote (GATEWAY_TEST_ZYGOTE=0: fresh)."""
    return os.environ.get("GATEWAY_TEST_ZYGOTE", "1") != "0"


CPU_SPENT = [0.0]
"""CPU seconds of this test process's forked children that have exited (tests/conftest.py
reports it per file with GATEWAY_TEST_CPU_REPORT)."""


def _preload() -> None:
    """What every gateway command the tests start would import or build before it answers."""
    import gateway.cli  # noqa: F401
    import gateway.providers.scripted  # noqa: F401
    import gateway.server.app  # noqa: F401
    import gateway.server.main  # noqa: F401
    from gateway.tokens import get_counter
    get_counter()
    # What a started gateway does once it serves (gateway/server/main.py `_settle_heap`),
    # done here once: a forked child's own full collection then walks only what it built
    # itself, not the imports again (about 60 ms of CPU per gateway start).
    gc.collect()
    gc.freeze()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested gateway process, never return."""
    code = 1
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        out = os.open(request.get("stdout") or request["log"], flags, 0o644)
        err = os.open(request["stderr"], flags, 0o644) if request.get("stderr") else out
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, devnull}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # a forked child would otherwise share the zygote's sequence
        from gateway.cli import main
        sys.argv = ["gateway", *request["argv"]]
        code = main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """The zygote's loop: fork on each request, report each child's exit."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # Listening before the imports: clients that connect meanwhile wait in the backlog, so
    # the process that started the zygote need not wait for its second of imports.
    print("listening", flush=True)
    _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # delivered through the wakeup fd
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                conn.settimeout(30)
                try:
                    request = json.loads(conn.makefile("rb").readline())
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(request)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                while os.read(wake_r, 4096) == 4096:
                    pass
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    report = {"returncode": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
                    conn.sendall(json.dumps(report).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


class Child:
    """The handle of a forked gateway process: the part of `subprocess.Popen` the tests use."""

    def __init__(self, sock: socket.socket, pid: int, args: list[str]) -> None:
        self._sock = sock
        self._buf = b""
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def _read(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)
        while b"\n" not in self._buf:
            data = self._sock.recv(4096)
            if not data:
                raise RuntimeError(f"the zygote went away before gateway process {self.pid} was reported")
            self._buf += data
        report = json.loads(self._buf.split(b"\n", 1)[0])
        self.returncode = int(report["returncode"])
        CPU_SPENT[0] += float(report.get("cpu_s", 0.0))
        self._sock.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._read(0)
            except (BlockingIOError, TimeoutError, socket.timeout):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._read(timeout)
            except (TimeoutError, socket.timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client side of a zygote: the one this process started (`start`), or one another
    process started and shares (`join`: pytest-xdist's controller starts one for all its
    workers, so the imports are paid once per run, not once per worker)."""

    def __init__(self, path: str, log: Path, popen: subprocess.Popen[bytes] | None) -> None:
        self.path = path
        self.log = log
        self.popen = popen

    @classmethod
    def start(cls, folder: Path) -> Zygote:
        """Start a zygote listening in `folder`; it exits when this process goes away."""
        path, log = str(folder / "zygote.sock"), folder / "zygote.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        root = Path(__file__).resolve().parents[2]
        with log.open("wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", path], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out)
        assert popen.stdout is not None
        line = popen.stdout.readline()
        if line.strip() != b"listening":
            raise RuntimeError(f"the zygote did not start:\n{log.read_text(errors='replace')}")
        return cls(path, log, popen)

    @classmethod
    def join(cls, path: str) -> Zygote:
        """The zygote another process started, listening at `path` (its log beside it)."""
        return cls(path, Path(path).with_name("zygote.log"), None)

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path, stderr: Path | None = None) -> Child:
        """Fork `gateway <argv>` with its output in `log` (its stderr in `stderr` when given)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(self.path)
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(log), "stderr": str(stderr or log)}
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            data = sock.recv(4096)
            if not data:
                raise RuntimeError(f"the zygote refused {argv}:\n{self.log.read_text(errors='replace')}")
            buf += data
        line, rest = buf.split(b"\n", 1)
        child = Child(sock, int(json.loads(line)["pid"]), [sys.executable, "-m", "gateway", *argv])
        child._buf = rest
        return child

    def close(self) -> None:
        """Stop the zygote this process started (a joined one belongs to its starter)."""
        if self.popen is not None and self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
