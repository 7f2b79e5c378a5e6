"""`gateway serve --workers N`: N gateway processes serving one port, under one supervisor.

The supervisor (the process the user started) checks the config, reserves the port (a
socket bound with SO_REUSEPORT that never listens, so `--port 0` works too, after a plain
bind has shown that nobody listens there: SO_REUSEPORT alone would share the port with
another gateway's workers), and the `metrics.listen` port alike, and starts
N workers: each is forked from the supervisor, which has already imported the gateway and
built the tokenizer (`gateway.server.main`), and runs `gateway serve` with the same config,
the resolved host and port and its index. A fork skips the second of imports and encoding
a fresh interpreter would spend, for a restarted worker too, and the workers share those
pages with the supervisor until they write them. The supervisor forks from one thread (its
loop is a selector, and the store it opened to release old holds is closed by then), so
the child holds no lock another thread had. Each worker is a full gateway over the shared store, listening
on its own SO_REUSEPORT socket of that port, so the kernel spreads new connections over
the workers. The workers share one key for the built-in scripted mount (a call a worker
makes to it may land on another worker). What each worker holds in the store (reservations, leases) is named after
its index (`app.process_owner`), so a restarted worker takes back its own holds at once.

Metrics are aggregated with prometheus-client's multiprocess mode: the supervisor gives
every worker one shared folder (PROMETHEUS_MULTIPROC_DIR), each worker writes its figures
there, and whichever worker a scrape lands on answers for all of them (docs/metrics.md).

Lifecycle (docs/config.md, "Workers"):
- SIGTERM or SIGINT to the supervisor: SIGTERM to every worker, which drains and stops as
  a single gateway does; a worker still alive after `STOP_GRACE_S` is killed. Each worker
  notes how many requests it drained in a file of the supervisor's folder (`note_stopped`)
  instead of printing its own stop line; the supervisor prints one line for them all.
- SIGHUP to the supervisor: every worker that serves reloads config.yaml and the policies;
  a worker still starting gets its signal once it serves (before, it would have no handler
  yet, and the signal would kill it). One worker gets the SIGHUP itself, and records the
  reload in the audit log as the gateway's own act; the others get `RELOAD_ONLY` (SIGUSR1:
  reload, record nothing), so one signal is one record. A POST /v1/admin/reload that one
  worker served (and recorded as its caller's act) sends the supervisor `RELOAD_ONLY`
  (`reload_every_worker`), which it forwards to every worker, and answers once every worker
  has read the files again since the call came: each worker notes when it last read them in
  a file of the supervisor's folder (`mark_reloaded`). Such a reload is also announced to
  the other replicas sharing the store under the origin every worker shares (`ORIGIN_ENV`),
  so the workers' own reload watches know it is their server's and leave it to this
  fan-out (`gateway.server.reload_watch`).
- A worker that dies after it was serving is started again (same index, so it releases
  what its previous life held); one that fails before it serves (a bad store, a port
  taken) stops the whole server with its exit code, since a restart would fail alike. A
  worker that cannot start sends its one line through its readiness pipe instead of
  printing it (`report_start_error`): the supervisor prints the first such line once, not
  one per worker.
  Before the first worker starts, what every worker of a previous life of this server
  held is released (`before`, `gateway.server.main`): a call that lands on worker J is not
  refused for a lease that worker I held when the whole server was killed.
- The supervisor dying (even SIGKILL) kills its workers (PR_SET_PDEATHSIG on Linux), so
  nothing keeps serving the port behind a dead parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from gateway.server.http.listener import StartError, listen_sockets, port_problem
from gateway.server.process_metrics import forget_worker

log = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
"""How long a worker may take to drain after SIGTERM before it is killed."""
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""Pauses before restarting a worker that died, growing while it keeps dying."""
READY = b"r"
"""What a worker writes to its readiness pipe once it listens."""
START_ERROR = b"e"
"""What a worker that cannot start writes to its readiness pipe, followed by its one line."""
MAX_ERROR_BYTES = 4096
PR_SET_PDEATHSIG = 1
SHARED_KEY_ENV = "GATEWAY_WORKERS_KEY"
"""The key the workers share for the built-in scripted mount (random per supervisor)."""
RELOADS_ENV = "GATEWAY_WORKERS_RELOADS"
"""The folder where each worker notes when it last read the policy files (`mark_reloaded`)."""
ORIGIN_ENV = "GATEWAY_WORKERS_ORIGIN"
"""The name the workers share when they announce a reload to other replicas (`reload_watch`):
the supervisor's fan-out reloads them all, so none reloads again for its own announcement."""
COUNT_ENV = "GATEWAY_WORKERS_COUNT"
STOPS_ENV = "GATEWAY_WORKERS_STOPS"
"""The folder where each worker notes how many requests it drained when it stopped (`note_stopped`)."""
RELOAD_ONLY = signal.SIGUSR1
"""The signal of a reload already recorded in the audit log (a worker of `--workers N` only):
the supervisor forwards it to every worker, and sends it instead of SIGHUP to all but one."""
RELOAD_WAIT_S = 15.0
"""How long POST /v1/admin/reload waits for the other workers (one may be restarting)."""
RELOAD_POLL_S = 0.01
WAIT_POLL_S = 0.01
"""How often `Worker.wait` looks whether a worker it waits for (at stop) has exited."""
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, RELOAD_ONLY, signal.SIGCHLD)
"""The signals the supervisor handles; a forked worker starts with their defaults."""

WorkerMain = Callable[[int, int], int]
"""What a forked worker runs: `gateway serve` as worker `index`, telling the supervisor on
`ready_fd` once it serves; returns its exit code (`gateway.server.main`)."""


class WorkerTimeout(Exception):
    """A worker did not exit within the time `Worker.wait` was given."""


class Worker:
    """A forked worker process: the part of `subprocess.Popen` the supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has exited (negative: killed by that signal), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already: nothing more will be known
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Its exit code, waiting `timeout` seconds at most (`WorkerTimeout`)."""
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise WorkerTimeout(self.pid)
            time.sleep(WAIT_POLL_S)  # the supervisor's stop: nothing else to do meanwhile
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def parse_workers(value: str) -> int:
    """`--workers`: a count >= 1, or `auto` (the CPU cores this process may use)."""
    if value == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--workers must be a whole number >= 1 or 'auto', got {value!r}") from None
    if not 1 <= n <= 256:
        raise ValueError(f"--workers must be between 1 and 256 (or 'auto'), got {n}")
    return n


def reserve_port(host: str, port: int, setting: str = "server.host/server.port or --host/--port") -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT that never listens: it holds the
    port (resolving port 0) while the workers bind their own listening sockets to it.

    The port is first bound plainly (`listen_sockets`, then closed): SO_REUSEPORT alone
    would bind next to another process's SO_REUSEPORT listeners (another gateway's workers)
    and share its connections. `StartError` when it is in use."""
    for probe in listen_sockets(host, port, setting=setting):
        port = int(probe.getsockname()[1])
        probe.close()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise port_problem(exc, host, port, setting) from None
    except BaseException:
        sock.close()
        raise
    return sock


def shared_key() -> str | None:
    """In a worker: the scripted mount's key its supervisor gave every worker."""
    return os.environ.get(SHARED_KEY_ENV) or None


def shared_origin() -> str | None:
    """In a worker: the reload origin its supervisor gave every worker (`ORIGIN_ENV`)."""
    return os.environ.get(ORIGIN_ENV) or None


def die_with_parent(parent: int) -> None:
    """In a forked worker: the kernel kills it when the supervisor (`parent`) dies (Linux);
    if it died before this was asked, the worker exits now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def signal_ready(fd: int | None, index: int | None = None, read_at: float = 0.0) -> Callable[[], None] | None:
    """In a worker: the callback that tells the supervisor it listens (once), having read
    the policy files at `read_at` (`mark_reloaded`)."""
    if fd is None:
        return None

    def ready() -> None:
        if index is not None:
            mark_reloaded(index, read_at)
        with contextlib.suppress(OSError):
            os.write(fd, READY)
            os.close(fd)

    return ready


def report_start_error(fd: int | None, line: str) -> bool:
    """In a worker that cannot start: hand `line` to the supervisor (its readiness pipe),
    which prints it once for all workers. False when there is no supervisor to tell."""
    if fd is None:
        return False
    try:
        os.write(fd, START_ERROR + line.encode(errors="replace")[:MAX_ERROR_BYTES])
        os.close(fd)
    except OSError:
        return False
    return True


def mark_reloaded(index: int, read_at: float) -> None:
    """In a worker, on its event loop: it serves the policy files as they were at `read_at`
    (or later). Written whole or not at all, and never back to an earlier time (two reloads
    may end in either order)."""
    folder = os.environ.get(RELOADS_ENV)
    if not folder or _read_since(folder, index) >= read_at:
        return
    _note(folder, index, repr(read_at))


def _note(folder: str, index: int, text: str) -> None:
    """Worker `index`'s note in `folder`, written whole or not at all."""
    path = os.path.join(folder, str(index))
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w", encoding="ascii") as out:
            out.write(text)
        os.replace(path + ".tmp", path)


def note_stopped(index: int, drained: int) -> None:
    """In a worker that stopped serving: it drained `drained` requests (for the supervisor's
    one stop line). Written whole or not at all."""
    folder = os.environ.get(STOPS_ENV)
    if folder:
        _note(folder, index, str(drained))


def _drained(folder: str) -> int:
    total = 0
    for name in os.listdir(folder):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, name), encoding="ascii") as f:
                total += int(f.read())
    return total


def _read_since(folder: str, index: int) -> float:
    try:
        with open(os.path.join(folder, str(index)), encoding="ascii") as f:
            return float(f.read())
    except (OSError, ValueError):
        return 0.0


async def reload_every_worker(since: float) -> tuple[int, int]:
    """In a worker that reloaded its policies (POST /v1/admin/reload) from files read at
    `since` or later: `RELOAD_ONLY` to the supervisor, which forwards it to every worker, then
    wait (`RELOAD_WAIT_S` at most) until each has read the files since then. (workers, how many did)."""
    folder, count = os.environ.get(RELOADS_ENV), int(os.environ.get(COUNT_ENV) or 0)
    with contextlib.suppress(OSError):
        os.kill(os.getppid(), RELOAD_ONLY)
    if not folder or count < 1:
        return count, 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RELOAD_WAIT_S
    while True:
        done = sum(1 for i in range(count) if _read_since(folder, i) >= since)
        if done == count or loop.time() > deadline:
            return count, done
        await asyncio.sleep(RELOAD_POLL_S)  # polling the other processes' notes: no channel back to them


@dataclass
class _Worker:
    index: int
    popen: Worker | None = None
    ready_fd: int | None = None
    serving: bool = False
    reload_due: int | None = None  # the reload signal that came while it was starting: sent once it serves
    start_error: str | None = None  # the line it could not start with (`report_start_error`)
    deaths: int = 0
    restart_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts, watches and stops the workers of one `gateway serve --workers N`."""

    def __init__(self, worker: WorkerMain, count: int, host: str, port: int) -> None:
        self.worker = worker
        self.count = count
        self.host = host
        self.port = port
        self.workers = [_Worker(i) for i in range(count)]
        self.folder = tempfile.mkdtemp(prefix="gateway-workers-")
        self.metrics_dir = os.path.join(self.folder, "metrics")
        self.reloads_dir = os.path.join(self.folder, "reloads")
        self.stops_dir = os.path.join(self.folder, "stops")
        for folder in (self.metrics_dir, self.reloads_dir, self.stops_dir):
            os.mkdir(folder)
        self.key = secrets.token_urlsafe(32)
        self.origin = "workers-" + secrets.token_hex(8)
        self.selector = selectors.DefaultSelector()
        self.wake: tuple[int, int] | None = None  # the signal wakeup pipe, while `run` runs
        self.reserved: list[socket.socket] = []  # the ports `supervise` holds (a worker closes its copies)
        self.stopping = False
        self.stop_asked_at = 0.0
        self.served = False  # a worker has served: a stop then says what was drained
        self.exit_code = 0
        self.banner = f"gateway: {count} workers serving on port {port}"
        """Printed each time every worker serves (again)."""

    def _spawn(self, w: _Worker) -> None:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        env[SHARED_KEY_ENV] = self.key
        env[RELOADS_ENV] = self.reloads_dir
        env[COUNT_ENV] = str(self.count)
        env[ORIGIN_ENV] = self.origin
        env[STOPS_ENV] = self.stops_dir
        parent = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                self._become_worker(w.index, write_fd, env, parent)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        w.popen = Worker(pid)
        w.ready_fd, w.serving, w.restart_at, w.started_at = read_fd, False, None, time.monotonic()
        w.reload_due = None  # it reads the files as they are now
        self.selector.register(read_fd, selectors.EVENT_READ, w)

    def _become_worker(self, index: int, ready_fd: int, env: dict[str, str], parent: int) -> NoReturn:
        """In the forked child: drop what is the supervisor's, run worker `index`, exit."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for s in HANDLED:
                signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
            die_with_parent(parent)
            self.selector.close()
            for sock in self.reserved:
                sock.close()
            for fd in (*(self.wake or ()), *(x.ready_fd for x in self.workers if x.ready_fd is not None)):
                with contextlib.suppress(OSError):
                    os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            from prometheus_client import values

            # prometheus-client picks its value class (multiprocess or not) when it is
            # imported, which was in the supervisor, before PROMETHEUS_MULTIPROC_DIR was set.
            values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
            code = self.worker(index, ready_fd)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _forget_pipe(self, w: _Worker) -> None:
        if w.ready_fd is not None:
            self.selector.unregister(w.ready_fd)
            os.close(w.ready_fd)
            w.ready_fd = None

    def _on_ready(self, w: _Worker) -> None:
        assert w.ready_fd is not None
        data = b""
        with contextlib.suppress(OSError):
            data = os.read(w.ready_fd, 1 + MAX_ERROR_BYTES)
        self._forget_pipe(w)
        if data.startswith(START_ERROR):
            w.start_error = data[1:].decode(errors="replace").strip() or "the worker could not start"
        elif data == READY:
            w.serving = self.served = True
            if w.reload_due is not None and w.popen is not None:
                w.popen.send_signal(w.reload_due)
                w.reload_due = None
            if all(x.serving for x in self.workers):
                print(self.banner, file=sys.stderr, flush=True)

    def _reap(self, w: _Worker) -> None:
        """A worker exited: restart it, or stop everything if it never served."""
        assert w.popen is not None
        code = w.popen.returncode
        if w.ready_fd is not None:  # what it wrote before it exited (its write end is closed: no wait)
            self._on_ready(w)
        self._mark_dead(w.popen.pid)
        w.popen = None
        if self.stopping:
            return
        if not w.serving:
            if w.start_error is not None:  # its one line, said once however many workers fail alike
                print(f"gateway: {w.start_error}", file=sys.stderr, flush=True)
            else:
                log.error("worker %d exited with %s before it served; stopping the gateway", w.index, code)
            self.exit_code = code if isinstance(code, int) and code > 0 else 1
            self.stop()
            return
        w.deaths = w.deaths + 1 if time.monotonic() - w.started_at < 60 else 1
        pause = RESTART_BACKOFF_S[min(w.deaths, len(RESTART_BACKOFF_S)) - 1]
        log.error("worker %d exited with %s; restarting it in %.1f s", w.index, code, pause)
        print(f"gateway: worker {w.index} exited with {code}; restarting it", file=sys.stderr, flush=True)
        w.restart_at = time.monotonic() + pause

    def _mark_dead(self, pid: int) -> None:
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        forget_worker(self.metrics_dir, pid)  # its process_* and python_gc_* go with it

    def stop(self) -> None:
        """SIGTERM to every worker (once); `run` then waits for them."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_asked_at = time.monotonic()
        for w in self.workers:
            if w.popen is not None and w.popen.poll() is None:
                w.popen.send_signal(signal.SIGTERM)

    def reload(self, signum: int) -> None:
        """Every worker reloads: for a SIGHUP, one (the first that serves) gets SIGHUP and
        records it, the others `RELOAD_ONLY`; for `RELOAD_ONLY` (already recorded), all get
        that. One still starting gets its signal when it serves."""
        alive = [w for w in self.workers if w.popen is not None and w.popen.poll() is None]
        recorder = next((w for w in alive if w.serving), alive[0] if alive else None)
        for w in alive:
            sent = signal.SIGHUP if signum == signal.SIGHUP and w is recorder else RELOAD_ONLY
            assert w.popen is not None
            if w.serving:
                w.popen.send_signal(sent)
            elif w.reload_due != signal.SIGHUP:  # a SIGHUP it still owes is recorded when sent
                w.reload_due = sent

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or a worker that cannot start); returns the exit code."""
        wake_r, wake_w = self.wake = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        self.selector.register(wake_r, selectors.EVENT_READ, None)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        pending: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _frame: pending.append(signum)) for s in HANDLED}
        try:
            for w in self.workers:
                self._spawn(w)
            self._loop(wake_r, pending)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(old_wakeup)
            self.stop()
            self._wait_all()
            if self.served and self.exit_code == 0:
                drained = _drained(self.stops_dir)
                print(f"gateway: stopped (pid {os.getpid()}, {self.count} workers) in "
                      f"{time.monotonic() - self.stop_asked_at:.1f} s, having drained {drained} "
                      f"request{'' if drained == 1 else 's'} in flight", file=sys.stderr, flush=True)
            self.selector.close()
            os.close(wake_r)
            os.close(wake_w)
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.exit_code

    def _loop(self, wake_r: int, pending: list[int]) -> None:
        while True:
            now = time.monotonic()
            due = [w.restart_at for w in self.workers if w.restart_at is not None]
            timeout = max(0.0, min(due) - now) if due else None
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                else:
                    self._on_ready(key.data)
            while pending:
                signum = pending.pop(0)
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.stop()
                elif signum in (signal.SIGHUP, RELOAD_ONLY):
                    self.reload(signum)
            for w in self.workers:
                if w.popen is not None and w.popen.poll() is not None:
                    self._reap(w)
            if self.stopping:
                return
            now = time.monotonic()
            for w in self.workers:
                if w.popen is None and w.restart_at is not None and w.restart_at <= now:
                    self._spawn(w)

    def _wait_all(self) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers:
            if w.popen is None:
                continue
            try:
                w.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except WorkerTimeout:
                log.error("worker %d did not stop within %.0f s; killing it", w.index, STOP_GRACE_S)
                w.popen.kill()
                w.popen.wait(STOP_GRACE_S)  # SIGKILL: gone at once
            self._forget_pipe(w)


def supervise(worker: Callable[[int, int, int], int], count: int, host: str, port: int,
              before: Callable[[int], None] | None = None, also_listen: tuple[str, int] | None = None,
              banner: Callable[[int], str] | None = None) -> int:
    """Reserve the port (and `also_listen`, the metrics listener's address, which every
    worker listens on too), call `before(port)` (the port bound), run `count` workers until
    stopped; the exit code. A port in use is one line and exit 2, before any worker starts.
    Each worker is forked and runs `worker(port, index, ready_fd)` (`WorkerMain`).
    `banner(port)` is printed once every worker serves."""
    with contextlib.ExitStack() as held:
        try:
            reserved = [held.enter_context(reserve_port(host, port))]
            if also_listen is not None:
                reserved.append(held.enter_context(reserve_port(*also_listen, setting="metrics.listen")))
        except StartError as exc:
            print(f"gateway: {exc}", file=sys.stderr)
            return 2
        bound = int(reserved[0].getsockname()[1])
        if before is not None:
            before(bound)
        supervisor = Supervisor(functools.partial(worker, bound), count, host, bound)
        supervisor.reserved = reserved
        if banner is not None:
            supervisor.banner = banner(bound)
        return supervisor.run()
