"""A run's trace writer on a real SQLite file: a line that announces a state (a person is
asked, the run stopped) is never in the store before that state is.

Found under load by tests/server/test_auto_resume_replicas.py: a client that saw
`approval_required` in the trace and approved at once got a 409 (`not_waiting_for_call`),
because the background writer had stored the line while the run was still saved as running.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gateway.harness.state import Interruption, RunState
from gateway.server.runs.tracelog import TraceWriter
from gateway.store.sqlite import SqliteStore


async def stored_types(store: SqliteStore, run_id: str) -> list[str]:
    return [str(e["type"]) for _, e in await store.events(run_id)]


async def test_an_approval_line_is_stored_only_with_the_waiting_run(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "gw.db")
    try:
        state = RunState.new("m", [{"role": "user", "content": "hi"}], run_id="demo/r1", team="demo")
        await store.create_run(state)
        writer = TraceWriter(store, state.run_id, trace_file=tmp_path / "trace.jsonl")
        writer.start()
        # As the loop emits them: synchronously, before the background writer runs.
        writer({"type": "tool_start", "callId": "c1"})
        writer({"type": "approval_required", "callId": "c2"})
        writer({"type": "run_stopped", "status": "interrupted"})
        deadline = time.monotonic() + 10
        while not await stored_types(store, state.run_id):  # the background writer has written
            assert time.monotonic() < deadline, "the background writer wrote nothing"
            await asyncio.sleep(0.01)
        assert await stored_types(store, state.run_id) == ["tool_start"]
        loaded = await store.load_run(state.run_id)
        assert loaded is not None and loaded.status == "running"

        state.status, state.reason = "interrupted", "approval"
        state.interruption = Interruption("approval", "c2", "delete_file", {})
        await writer.commit(state)
        assert await stored_types(store, state.run_id) == ["tool_start", "approval_required", "run_stopped"]
        loaded = await store.load_run(state.run_id)
        assert loaded is not None and loaded.status == "interrupted"
        await writer.close()
        assert (tmp_path / "trace.jsonl").read_text().count("\n") == 3  # the trace file got each line once
    finally:
        await store.close()
