"""Kill a run after turn 2 with SIGKILL, then resume it from the store in another process.

The child (`python -m gateway.demo.resume CHILD ...`) runs the plan task with every state
change saved to SQLite; its third model call hangs, and the parent kills it once the
checkpoint after turn 2's tool run is on disk. The parent then loads the run and finishes it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from gateway.demo.lab import Lab
from gateway.demo.report import Result, tool_runs
from gateway.harness.loop import run
from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.options import RunOptions
from gateway.harness.state import Limits, RunState
from gateway.harness.trace import Event
from gateway.providers.http_model import HTTPChatModel
from gateway.store import open_store
from gateway.store.base import Store
from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT
from gateway.tools.files import Sandbox, file_tools


class Durable:
    """Checkpoint + event sink over a store: events are flushed with each state save."""

    def __init__(self, store: Store, announce: bool = False) -> None:
        self.store = store
        self.buffer: list[Event] = []
        self.announce = announce

    def on_event(self, event: Event) -> None:
        self.buffer.append(event)

    async def checkpoint(self, state: RunState) -> None:
        if self.buffer:
            events, self.buffer = self.buffer, []
            await self.store.append_events(state.run_id, events)
        await self.store.save_run(state)
        if self.announce:
            print(f"checkpoint turns={state.turns} messages={len(state.messages)}", flush=True)


class HangOnThirdTurn(HTTPChatModel):
    async def complete(self, request: ModelRequest) -> ModelReply:
        if sum(1 for m in request.messages if m.get("role") == "assistant") == 2:
            await asyncio.Event().wait()  # the process is killed here
        return await super().complete(request)


async def child(db: str, base_url: str, sandbox: str, run_id: str) -> None:
    store = open_store({"kind": "sqlite", "path": db})
    durable = Durable(store, announce=True)
    state = RunState.new("scripted-plan", [{"role": "system", "content": SYSTEM_PROMPT},
                                           {"role": "user", "content": PLAN_TASK}],
                         run_id=run_id, limits=Limits(max_turns=20))
    await store.create_run(state)
    async with aiohttp.ClientSession() as session:
        options = RunOptions(tools=file_tools(Sandbox(Path(sandbox))), on_event=durable.on_event,
                             checkpoint=durable.checkpoint)
        await run(state, HangOnThirdTurn(session, base_url), options)


async def experiment(lab: Lab) -> list[Result]:
    db = lab.workdir / "resume.db"
    sandbox = lab.sandbox()
    run_id = f"resume-{os.getpid()}-{time.time_ns()}"
    started = time.perf_counter()
    # the scripted provider runs on this event loop: read the child without blocking it
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.demo.resume", "child", str(db),
                                                lab.base_url, str(sandbox.root), run_id, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    async for line in proc.stdout:
        if b"messages=6" in line:
            break
    else:
        raise RuntimeError(f"the child run ended before turn 2 was saved (exit {await proc.wait()})")
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    store = open_store({"kind": "sqlite", "path": str(db)})
    try:
        restored = await store.load_run(run_id)
        assert restored is not None, "the killed run is not in the store"
        before = Result.of("resume", "restored after SIGKILL", restored.copy(),
                           [e for _, e in await store.events(run_id)], None, 0, messages=len(restored.messages))
        durable = Durable(store)
        options = RunOptions(tools=file_tools(sandbox), on_event=durable.on_event, checkpoint=durable.checkpoint)
        outcome = await run(restored, lab.model(), options)
        events = [e for _, e in await store.events(run_id)]
    finally:
        await store.close()
    ms = int((time.perf_counter() - started) * 1000)
    after = Result.of("resume", "resumed and finished", outcome.state, events, outcome.answer, ms,
                      runs_across_both=",".join(tool_runs(events, run_id)))
    return [before, after]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["child"])
    parser.add_argument("db")
    parser.add_argument("base_url")
    parser.add_argument("sandbox")
    parser.add_argument("run_id")
    args = parser.parse_args()
    asyncio.run(child(args.db, args.base_url, args.sandbox, args.run_id))


if __name__ == "__main__":
    main()
