"""The harness's own time, and the tokenizer's time with and without the per-message cache.

1. The three-turn `plan` run against a zero-latency provider: the scripted provider's three
   replies are recorded over HTTP once, then replayed in-process, so what is left of the wall
   time is the loop itself plus durable saves to a real SQLite file (every checkpoint) and the
   real file tools (timed separately and subtracted). Target: <= 3 ms (a TypeScript
   reference loop added ~15 ms).
2. Token counting for a 100-turn `runaway` transcript: counting the prompt of every turn with
   the per-message cache vs without it, against counting the final transcript once.
   Target: with the cache <= 2x counting the final transcript once.

Run: .venv/bin/python benchmarks/harness_overhead.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tokens_cache benchmark
import tokens_cache  # noqa: E402

from gateway.demo.lab import serve_scripted, timed_tools
from gateway.harness.loop import run
from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, RunState
from gateway.providers.http_model import HTTPChatModel
from gateway.store import open_store
from gateway.harness.tools import ToolContext
from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, file_tools, fresh_sandbox


class Replay:
    """Zero-latency provider: hands back recorded replies in order."""

    def __init__(self, replies: list[ModelReply]) -> None:
        self.replies = replies
        self.index = 0

    async def complete(self, request: ModelRequest) -> ModelReply:
        reply = self.replies[self.index]
        self.index += 1
        return ModelReply(dict(reply.message), reply.usage, reply.finish_reason)


class Recording(HTTPChatModel):
    replies: list[ModelReply]

    async def complete(self, request: ModelRequest) -> ModelReply:
        reply = await super().complete(request)
        self.replies.append(reply)
        return reply


def new_plan() -> RunState:
    return RunState.new("scripted-plan", [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": PLAN_TASK}], limits=Limits(max_turns=20))


async def harness_time(rounds: int = 200) -> list[float]:
    runner, base_url = await serve_scripted()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            async with aiohttp.ClientSession() as session:
                recorder = Recording(session, base_url)
                recorder.replies = []
                await run(new_plan(), recorder, RunOptions(tools=file_tools(Sandbox(fresh_sandbox(root / "rec")))))
        finally:
            await runner.cleanup()
        store = open_store({"kind": "sqlite", "path": str(root / "bench.db")})
        samples = []
        sandbox = Sandbox(fresh_sandbox(root / "box"))
        for i in range(rounds):
            spent: list[float] = []
            state = new_plan()
            await store.create_run(state)
            options = RunOptions(tools=timed_tools(file_tools(sandbox), spent), checkpoint=store.save_run)
            started = time.perf_counter()
            out = await run(state, Replay(recorder.replies), options)
            wall = time.perf_counter() - started
            assert out.state.status == "completed" and out.state.turns == 3
            if i >= 10:  # warm-up
                samples.append((wall - sum(spent)) * 1000)
        await store.close()
    return samples


def tokenizer_times() -> tuple[float, float, float]:
    """(with cache, without, final transcript once) for the 100-turn runaway, best of 7 (tokens_cache.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(fresh_sandbox(Path(tmp)))
        listing = asyncio.run(box.list_files({}, ToolContext("bench", "c1", "list_files", asyncio.Event())))
    uncached, cached, once = tokens_cache.measure(tokens_cache.runaway_requests(listing, fresh=False),
                                                  [t.openai() for t in FILE_TOOLS])
    return cached, uncached, once


def main() -> None:
    samples = asyncio.run(harness_time())
    p50 = statistics.median(samples)
    p99 = sorted(samples)[int(len(samples) * 0.99) - 1]
    print(f"harness own time, 3-turn plan run, SQLite saves included: p50={p50:.3f} ms p99={p99:.3f} ms "
          f"(target <= 3 ms; the TypeScript reference loop ~15 ms) -> {'OK' if p50 <= 3 else 'OVER'}")
    cached, uncached, once = tokenizer_times()
    print(f"tokenizer, 100-turn runaway transcript (best of 7): per turn with cache {cached * 10:.3f} ms, "
          f"without {uncached * 10:.3f} ms; whole run with cache {cached * 1000:.2f} ms vs counting the final "
          f"transcript once {once * 1000:.2f} ms = {cached / once:.2f}x (target <= 2x) -> "
          f"{'OK' if cached / once <= 2 else 'OVER'}; without cache {uncached / once:.1f}x")


if __name__ == "__main__":
    main()
