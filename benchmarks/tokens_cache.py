"""How much the token cache saves on a growing transcript.

A run re-sends its whole transcript every turn, so counting each request from scratch is
quadratic in the number of turns. This replays the `runaway` scenario for 100 turns and
times the tokenizer three ways:

    no cache      count every request from scratch
    with cache    gateway.tokens' caches (per-message LRU + remembered transcript prefix)
    final once    count only the final transcript, once (the floor)

in two settings: the server-side harness (each turn re-sends the *same* message objects,
plus two new ones) and the HTTP proxy (each request a *fresh* JSON decode, as the gateway
and the scripted provider receive it).

Target: with cache at most 2x the floor. Run: .venv/bin/python benchmarks/tokens_cache.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from gateway.harness.tools import ToolContext  # noqa: E402
from gateway.tokens import TokenCounter, get_counter  # noqa: E402
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT  # noqa: E402
from gateway.tools.files import Sandbox, fresh_sandbox  # noqa: E402

TURNS = 100
REPEATS = 7


def runaway_requests(listing: str, fresh: bool) -> list[list[dict[str, Any]]]:
    """The `messages` of each of the 100 requests of a runaway run."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": PLAN_TASK}]
    requests = []
    for turn in range(TURNS):
        requests.append(json.loads(json.dumps(messages)) if fresh else list(messages))
        cid = f"c{turn + 1}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "name": "list_files", "content": listing})
    return requests


def best_of(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(requests: list[list[dict[str, Any]]], tools: list[dict[str, Any]]) -> tuple[float, float, float]:
    encoding = get_counter().encoding

    def replay(cache_size: int) -> Callable[[], object]:
        def run() -> None:
            counter = TokenCounter(encoding, cache_size=cache_size)
            for request in requests:
                counter.count_request(request, tools)
        return run

    def final_once() -> None:
        TokenCounter(encoding).count_request(requests[-1], tools)

    return best_of(replay(0)), best_of(replay(16_384)), best_of(final_once)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(fresh_sandbox(Path(tmp)))
        listing = asyncio.run(box.list_files({}, ToolContext("bench", "c1", "list_files", asyncio.Event())))
    tools = [t.openai() for t in FILE_TOOLS]
    counter = TokenCounter(get_counter().encoding)
    total = sum(counter.count_request(r, tools) for r in runaway_requests(listing, fresh=False))
    print(f"runaway, {TURNS} turns, {total:,} prompt tokens counted in all (best of {REPEATS})")
    for label, fresh in (("harness: same objects", False), ("proxy: fresh JSON", True)):
        uncached, cached, floor = measure(runaway_requests(listing, fresh), tools)
        print(f"\n{label}")
        print(f"  no cache     {uncached * 1000:7.2f} ms  {uncached / TURNS * 1e6:7.1f} us/turn")
        print(f"  with cache   {cached * 1000:7.2f} ms  {cached / TURNS * 1e6:7.1f} us/turn")
        print(f"  final once   {floor * 1000:7.2f} ms")
        if fresh:
            bodies = [orjson.dumps(r) for r in runaway_requests(listing, fresh)]
            decode = best_of(lambda: [orjson.loads(b) for b in bodies])
            print(f"  (for scale: decoding those 100 request bodies with orjson takes {decode * 1000:.2f} ms)")
        verdict = "ok" if cached <= 2 * floor else "over target"
        print(f"  with cache / final once = {cached / floor:.2f}x (target <= 2x: {verdict}); "
              f"no cache / with cache = {uncached / cached:.1f}x")


if __name__ == "__main__":
    main()
