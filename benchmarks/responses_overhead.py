"""The gateway's added latency on a non-streamed Responses call, next to a chat call.

One run starts the scripted upstream (`gateway scripted`) and the gateway (`gateway serve`,
SQLite store, a team with a budget: every call reserved and settled), then, in the same
run, alternates rounds of non-streamed calls: straight to the upstream (chat), through the
gateway as chat completions, and through the gateway as Responses (the same conversation:
`instructions` + `input` + flat tools, stored as responses are by default). The added
latency is p50 through the gateway minus p50 direct; the target:

    Responses added latency <= 1.5x chat added latency

Run: `.venv/bin/python benchmarks/responses_overhead.py [--requests 1000] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proxy_overhead import BODY, KEY, TURNS_PER_RUN, gateway_config  # noqa: E402
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT  # noqa: E402
from tests.support.procs import free_port, start_gateway  # noqa: E402

RESPONSES_BODY = orjson.dumps({
    "model": "scripted-plan", "instructions": SYSTEM_PROMPT, "input": PLAN_TASK,
    "tools": [{"type": "function", **t.openai()["function"]} for t in FILE_TOOLS],
})


async def latencies(url: str, path: str, body: bytes, requests: int, run_prefix: str | None) -> list[float]:
    """`requests` sequential calls (concurrency 1); their latencies in seconds."""
    out: list[float] = []
    async with aiohttp.ClientSession() as session:
        for n in range(requests):
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
            if run_prefix is not None:
                headers["X-Run-Id"] = f"{run_prefix}-{n // TURNS_PER_RUN}"
            started = time.perf_counter()
            async with session.post(url + path, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}{path} answered {resp.status}: {await resp.text()}")
            out.append(time.perf_counter() - started)
    return out


async def main_async(args: argparse.Namespace) -> int:
    cells: dict[str, list[float]] = {"direct": [], "chat": [], "responses": []}
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        folder = Path(tmp)
        up_port, gw_port = free_port(), free_port()
        upstream = start_gateway(["scripted", "--port", str(up_port)], "/healthz", up_port, folder / "upstream.log")
        try:
            config = gateway_config(folder, gw_port, upstream.url + "/v1", True)
            gateway = start_gateway(["serve", "--config", str(config)], "/healthz", gw_port, folder / "gateway.log")
            try:
                for r in range(args.rounds + 1):  # round 0 warms up
                    n = args.requests if r else max(50, args.requests // 10)
                    got = {
                        "direct": await latencies(upstream.url, "/v1/chat/completions", BODY, n, None),
                        "chat": await latencies(gateway.url, "/v1/chat/completions", BODY, n,
                                                f"chat-{os.getpid()}-{r}"),
                        "responses": await latencies(gateway.url, "/v1/responses", RESPONSES_BODY, n,
                                                     f"resp-{os.getpid()}-{r}"),
                    }
                    if r:
                        for name, values in got.items():
                            cells[name] += values
            finally:
                gateway.stop()
        finally:
            upstream.stop()
    p50 = {name: statistics.median(values) * 1000 for name, values in cells.items()}
    chat_added, responses_added = p50["chat"] - p50["direct"], p50["responses"] - p50["direct"]
    ratio = responses_added / chat_added if chat_added > 0 else float("inf")
    print(f"non-streamed calls at c=1, {args.rounds} rounds x {args.requests} per target, alternating "
          f"({os.cpu_count()} CPUs shared by both processes and the load generator)")
    for name, value in p50.items():
        print(f"{name:<10} p50 {value:7.3f} ms")
    print(f"added latency p50: chat {chat_added:.3f} ms, responses {responses_added:.3f} ms -> ratio {ratio:.2f} "
          "(target <= 1.5)")
    return 0 if ratio <= 1.5 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="measured calls per target and round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (each target once per round)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
