"""`gateway serve`: load and check the config, then run the gateway until stopped.

A config error (file, field, problem: every error of the file, one line each), a port in
use or a store that cannot be opened is said on stderr with exit 2, before anything listens
(`serve_command`). SIGHUP reloads config.yaml and the policies like POST /v1/admin/reload
(`gateway.server.reload`), logs the result and records it in the audit log.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import gc
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.config.settings import Config, ConfigError, load_config
from gateway.policy.registry import policy_names
from gateway.server.app import build_app, open_configured_store, process_owner
from gateway.server.context import METRICS, READINESS
from gateway.server.http.access import access_logger
from gateway.server.http.listener import Connections, StartError, bound_port, listen_sockets, run
from gateway.server import context as ctx
from gateway.server.reload import record_reload
from gateway.server.reload_watch import announce
from gateway.server.reload import reload as reload_files
from gateway.server.workers import (
    RELOAD_ONLY,
    note_stopped,
    parse_workers,
    report_start_error,
    shared_key,
    signal_ready,
    supervise,
)
from gateway.store import StoreError
from gateway.store.spool import Spool
from gateway.telemetry.access_log import AccessLog
from gateway.tokens import get_counter

log = logging.getLogger("gateway")

GC_YOUNG_THRESHOLD = 20_000
"""Allocations between two young-generation collections (CPython's default is 700): a call
allocates a few hundred containers that reference counting frees anyway, so the default
runs the cyclic collector every few calls."""


LARGE_BLOCK_BYTES = 1 << 20
"""Blocks at least this large (a request body of megabytes, the string of a long transcript)
are mapped by glibc for themselves, and given back to the system when freed."""


def _large_blocks_to_the_system() -> None:
    """glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after
    which big blocks come from the heap, whose freed middle it never gives back: a few runs
    with a prompt of megabytes left the process 120 MB larger for good. A fixed threshold
    keeps big blocks mapped (one mmap per such block, rare on a call's path)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, LARGE_BLOCK_BYTES)  # M_MMAP_THRESHOLD


async def _settle_heap(app: web.Application) -> None:
    """Once the app has started: what startup built (modules, config, the token counter,
    sessions) is frozen out of the cyclic collector's passes, which would otherwise walk
    it again on every full collection (a pause of milliseconds), and young collections
    run less often. Gives some 10% more calls per second under load."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def _self_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(config: Config, host: str, port: int, what: str) -> str:
    """The line `serve` prints once it listens: where, on which config and store, the console."""
    url = _self_url(host, port)
    return f"gateway: {what} on {url} (config {config.path}, store {config.store.kind}); console at {url}/console/"


def _release_previous_workers(config: Config, host: str, count: int) -> Callable[[int], None]:
    """For the supervisor: give back the reservations and leases the workers of this
    server's previous life held (each worker does it for its own index when it starts,
    but the first to serve would refuse a resume with `run_busy` meanwhile). A store that
    cannot be opened at all is a ConfigError here, said once, before any worker starts."""

    def release(port: int) -> None:
        async def each_worker() -> int:
            spooled = Spool(config.spool_file).reservations()  # held until the spool books them
            store = open_configured_store(config)
            try:
                url = _self_url(host, port)
                return sum([await store.release_owner(process_owner(url, i), keep=spooled) for i in range(count)])
            finally:
                await store.close()

        try:
            released = asyncio.run(each_worker())
        except StoreError as exc:  # each worker tries again for its own
            log.warning("could not release what the previous workers held: %s", exc)
            return
        if released:
            log.warning("released %d reservations left by this server's previous workers", released)

    return release


async def _reload_on_sighup(app: web.Application) -> AsyncIterator[None]:
    """SIGHUP reloads the files and records the reload in the audit log as the gateway's own
    act (whoever sent the signal is not known); a worker of `--workers N` also reloads on
    `RELOAD_ONLY`, the supervisor's signal for a reload recorded elsewhere (by the worker
    that served POST /v1/admin/reload, or that got the SIGHUP)."""
    loop = asyncio.get_running_loop()

    running: set[asyncio.Future[object]] = set()  # held until done (the loop keeps weak references)

    async def reload_and_record(record: bool) -> None:  # logs what it loaded, or why it kept the old set
        done = await reload_files(app, by="SIGHUP")
        if record and done.ok:
            await announce(app)  # every replica sharing the store reloads its own files too
            await record_reload(app, done, None, by="SIGHUP")

    def reload(record: bool) -> None:
        task: asyncio.Future[object] = asyncio.ensure_future(reload_and_record(record))
        running.add(task)
        task.add_done_callback(running.discard)

    signals = {signal.SIGHUP: True} | ({RELOAD_ONLY: False} if ctx.WORKER in app else {})
    try:
        for signum, record in signals.items():
            loop.add_signal_handler(signum, reload, record)
    except (NotImplementedError, RuntimeError):  # no signals here (Windows, a non-main thread)
        yield
        return
    yield
    for signum in signals:
        loop.remove_signal_handler(signum)


def serve_command(args: argparse.Namespace) -> int:
    """Run the gateway; flags --config, --host, --port (override server.host/port),
    --workers (processes sharing the port, `gateway.server.workers`), --loop.

    Whatever keeps it from starting (a config error, a port in use, a store it cannot
    open) is one line on stderr and exit 2, before the `serving on` line; a worker of
    `--workers N` hands that line to its supervisor instead, which prints it once."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker: int | None = getattr(args, "worker_index", None)
    ready_fd: int | None = getattr(args, "ready_fd", None)
    try:
        workers = parse_workers(str(getattr(args, "workers", "1")))
    except ValueError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    read_at = time.time()  # the policy files are read from here on
    try:
        config = load_config(args.config, policy_names)
        host = args.host or config.server.host
        port = args.port if args.port is not None else config.server.port
        if worker is None and workers > 1:
            if config.store.kind == "memory":
                raise ConfigError(str(config.path), "store.kind",
                                  f"--workers {workers} needs a store the workers share (sqlite or redis); the "
                                  "memory store lives in one process")
            get_counter()  # built once here: every forked worker shares it
            gc.collect()
            gc.freeze()  # a worker's collections then leave the supervisor's pages shared
            return supervise(_worker(args, host), workers, host, port, _release_previous_workers(config, host, workers),
                             also_listen=config.metrics.listen,
                             banner=lambda bound: _banner(config, host, bound, f"{workers} workers serving"))
        # The port first: nothing is opened, and no store state touched, for a gateway that cannot serve.
        sockets = listen_sockets(host, port, reuse_port=worker is not None)
        port = bound_port(sockets)
        try:
            app = build_app(config, self_url=_self_url(host, port), worker=worker,
                            scripted_key=shared_key() if worker is not None else None)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
    except ConfigError as exc:  # every error of the file, one line each
        return _cannot_start("\ngateway: ".join(f"config error: {line}" for line in str(exc).splitlines()), worker,
                             ready_fd)
    except StartError as exc:
        return _cannot_start(str(exc), worker, ready_fd)
    app.cleanup_ctx.append(_reload_on_sighup)
    _large_blocks_to_the_system()
    app.on_startup.append(_settle_heap)  # runs after the cleanup contexts have set up
    signal = signal_ready(ready_fd, worker, read_at)

    def ready() -> None:
        if worker is None:
            print(_banner(config, host, port, "serving"), file=sys.stderr, flush=True)
        if signal is not None:
            signal()

    # web.run_app, with parser errors (oversized headers) in the OpenAI shape, the access log,
    # and /readyz failing from the SIGTERM on (server.shutdown_delay_s before the listener closes)
    sink = AccessLog(config.access_log) if config.access_log.enabled else None
    try:
        run(app, sockets, ready=ready, loop=getattr(args, "loop", "auto"),
            access=access_logger(sink) if sink is not None else None,
            stopped=None if worker is None else functools.partial(note_stopped, worker),
            connections=Connections.of(config.server, app[METRICS].on_connection), on_drain=app[READINESS].drain,
            drain_delay_s=config.server.shutdown_delay_s)
    except StartError as exc:  # raised while the app started (the metrics listener's port)
        return _cannot_start(str(exc), worker, ready_fd)
    finally:
        if sink is not None:
            sink.close()
    return 0


def _worker(args: argparse.Namespace, host: str) -> Callable[[int, int, int], int]:
    """What each forked worker of `--workers N` runs: this `gateway serve` as worker `index`
    on the supervisor's `port` (`gateway.server.workers.supervise`)."""

    def serve_worker(port: int, index: int, ready_fd: int) -> int:
        return serve_command(argparse.Namespace(config=args.config, host=host, port=port, workers="1",
                                                loop=getattr(args, "loop", "auto"), worker_index=index,
                                                ready_fd=ready_fd))

    return serve_worker


def _cannot_start(line: str, worker: int | None, ready_fd: int | None) -> int:
    """Exit 2 with `line` said once: on stderr, or by the supervisor of this worker."""
    if worker is None or not report_start_error(ready_fd, line):
        print(f"gateway: {line}", file=sys.stderr, flush=True)
    return 2
