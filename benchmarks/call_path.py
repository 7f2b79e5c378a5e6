"""The way one pass-through chat call travels through the gateway's modules.

Issue 11 counted, for one pass-through call, how many files it crossed and how often it
entered the same one ("passthrough.py four times, budget.py three times, 17 files"). This
prints the same figures for today's code: a real gateway app and a real scripted upstream
(each on its own port, the upstream on a thread of its own so that only the gateway's
frames are traced), one call to warm up, then one traced with `sys.setprofile`. An entry is
a call into a gateway module from a frame of another module (a coroutine resumed after an
await is not a call); the upstream's and the client's frames are not counted.

Run: `.venv/bin/python benchmarks/call_path.py [--stream] [--policy passthrough]`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.config.settings import parse_config  # noqa: E402
from gateway.providers.scripted import standalone_app  # noqa: E402
from gateway.server.app import build_app  # noqa: E402

PACKAGE = str(ROOT / "gateway") + "/"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _upstream(port: int, ready: threading.Event) -> None:
    """The scripted upstream, serving on its own loop and thread (not traced)."""
    async def serve() -> None:
        runner = web.AppRunner(standalone_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(serve())


def _config(folder: Path, upstream_port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "store": {"kind": "sqlite", "path": str(folder / "gateway.db")},
        "policies_dir": str(ROOT / "policies"),
        "upstreams": [{"name": "scripted", "kind": "scripted", "base_url": f"http://127.0.0.1:{upstream_port}/v1"}],
        "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [{"name": "bench", "keys": ["sk-bench"], "budget_usd": 1000.0, "policies": ["passthrough"]}],
    }


class PathTracer:
    """Counts, for the frames of the traced thread, the entries into each gateway module."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.calls = 0
        self._seen: set[FrameType] = set()  # a coroutine resumed after an await is not a new call

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        file = frame.f_code.co_filename
        if not file.startswith(PACKAGE) or frame in self._seen:
            return
        self._seen.add(frame)
        self.calls += 1
        caller = frame.f_back
        if caller is None or caller.f_code.co_filename != file:
            self.entries[file[len(PACKAGE):]] += 1


async def main_async(args: argparse.Namespace) -> int:
    upstream_port, port = _free_port(), _free_port()
    ready = threading.Event()
    threading.Thread(target=_upstream, args=(upstream_port, ready), daemon=True).start()
    ready.wait(30)
    folder = Path(tempfile.mkdtemp(prefix="gw-path-"))
    config = parse_config(_config(folder, upstream_port), folder / "config.yaml")
    runner = web.AppRunner(build_app(config, self_url=f"http://127.0.0.1:{port}"))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    body = {"model": "scripted-plan", "messages": [{"role": "user", "content": "Which file mentions a timeout?"}],
            "stream": args.stream}
    headers = {"Authorization": "Bearer sk-bench", "X-Run-Id": "path-1", "X-Policy": args.policy}
    tracer = PathTracer()
    async with aiohttp.ClientSession() as session:
        for traced in (False, True):
            if traced:
                sys.setprofile(tracer)
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                        headers=headers) as response:
                    await response.read()
                    status = response.status
            finally:
                sys.setprofile(None)
            if status != 200:
                print(f"the call answered {status}", file=sys.stderr)
                return 1
    await runner.cleanup()
    mode = "streamed" if args.stream else "non-streamed"
    print(f"one {mode} pass-through call: {len(tracer.entries)} gateway modules, "
          f"{sum(tracer.entries.values())} entries, {tracer.calls} gateway function calls")
    layers: Counter[str] = Counter(file.split("/")[0] if "/" in file else file for file in tracer.entries)
    print("modules per layer: " + ", ".join(f"{layer} {n}" for layer, n in layers.most_common()))
    for file, n in tracer.entries.most_common():
        print(f"{n:5d}  {file}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="trace a streamed call")
    parser.add_argument("--policy", default="passthrough")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
