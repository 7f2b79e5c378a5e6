"""`gateway serve`: load and check the config, then run the gateway until stopped.

A config error (file, field, problem) is printed and the process exits 2 without
listening. SIGHUP reloads the policies like POST /v1/admin/reload (new runs get the new
versions) and logs the result.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.server.admin import reload_policies
from gateway.server.app import build_app
from gateway.server.config import ConfigError, load_config


def _self_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _reload_on_sighup(app: web.Application) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()

    def reload() -> None:
        reload_policies(app, by="SIGHUP")  # logs what it loaded, or why it kept the old set

    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError):  # no signals here (Windows, a non-main thread)
        yield
        return
    yield
    loop.remove_signal_handler(signal.SIGHUP)


def serve_command(args: argparse.Namespace) -> int:
    """Run the gateway; flags --config, --host, --port (override server.host/port)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        host = args.host or config.server.host
        port = args.port if args.port is not None else config.server.port
        app = build_app(config, self_url=_self_url(host, port) if port else None)
    except ConfigError as exc:
        print(f"gateway: config error: {exc}", file=sys.stderr)
        return 2
    app.cleanup_ctx.append(_reload_on_sighup)
    print(f"gateway: serving on {_self_url(host, port)} (config {config.path}, store {config.store.kind})",
          file=sys.stderr, flush=True)
    web.run_app(app, host=host, port=port, access_log=None, print=None, handle_signals=True)
    return 0
