"""`gateway trace RUN_ID`: the real command, over a real SQLite store and a real trace file."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.harness.trace import EventList, Tracer
from gateway.harness.usage import DEFAULT_PRICE, Usage
from gateway.store import open_store
from gateway.trace_view import timeline
from tests.support.procs import run_gateway

RUN = "run_trace_view_1"


def plan_trace(run_id: str) -> list[dict[str, Any]]:
    """The chapter's `plan` run as the loop traces it: 3 turns, 2 tools, $0.002470."""
    sink = EventList()
    trace = Tracer(run_id, sink)
    trace("run_started", team="demo", policy="files", model="scripted-plan")
    cost = 0.0
    turns = [(204, 25, "tool_calls"), (269, 22, "tool_calls"), (342, 23, "stop")]
    tools = [("list_files", "{}", 3), ('read_file', '{"path": "errors.log"}', 12)]
    for n, (prompt, completion, finish) in enumerate(turns, start=1):
        cost += DEFAULT_PRICE.cost(Usage(prompt, completion))
        trace("turn", turn=n, prompt_tokens=prompt, completion_tokens=completion,
              total_tokens=prompt + completion, costUsd=round(cost, 9), finish=finish)
        if n <= len(tools):
            name, args, ms = tools[n - 1]
            trace("tool_start", toolName=name, args=args, callId=f"call_{n}")
            trace("tool_result", toolName=name, ms=ms, ok=True, callId=f"call_{n}")
    trace("run_stopped", status="completed", reason="completed", turns=3, costUsd=round(cost, 9))
    return sink.events


def write_config(tmp_path: Path, *, store_path: str = "gateway.db", trace_file: str | None = "trace.jsonl",
                 extra: str = "") -> Path:
    lines = [
        f"store: {{kind: sqlite, path: {store_path}}}",
        "upstreams: [{name: scripted, kind: scripted}]",
        'models: [{match: "scripted-*", upstream: scripted}]',
        "teams: [{name: demo, keys: [sk-demo], policies: [passthrough]}]",
    ]
    if trace_file is not None:
        lines.append(f"trace_file: {trace_file}")
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


async def store_events(db: Path, run_id: str, events: list[dict[str, Any]]) -> None:
    store = open_store({"kind": "sqlite", "path": str(db)})
    try:
        await store.append_events(run_id, events)
    finally:
        await store.close()


def gateway_trace(run_id: str, config: Path) -> subprocess.CompletedProcess[str]:
    return run_gateway(["trace", run_id, "--config", str(config)])


async def test_prints_turns_tools_and_stop_reason_from_the_store(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    await store_events(tmp_path / "gateway.db", RUN, plan_trace(RUN))
    await store_events(tmp_path / "gateway.db", "run_other", plan_trace("run_other")[:2])

    done = gateway_trace(RUN, config)

    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith(f"run {RUN}: 9 events, started ") and "sqlite store" in out[0]
    turns = [line for line in out if " turn " in line]
    assert [re.search(r"turn (\d+): in (\d+) out (\d+)", t).groups() for t in turns] == [  # type: ignore[union-attr]
        ("1", "204", "25"), ("2", "269", "22"), ("3", "342", "23")]
    # cumulative cost after each turn, then the chapter's total
    assert [re.search(r"cost so far \$(\S+),", t).group(1) for t in turns] == [  # type: ignore[union-attr]
        "0.000708", "0.001510", "0.002470"]
    tool_lines = [line for line in out if "  tool " in line]
    assert len(tool_lines) == 2
    assert "tool list_files() -> ok in 3 ms" in tool_lines[0]
    assert 'tool read_file({"path": "errors.log"}) -> ok in 12 ms' in tool_lines[1]
    assert "stopped: completed (completed), turns 3, cost $0.002470" in out[-2]
    assert out[-1] == ("total: 3 turns, 2 tool runs (0 failed), tokens in 815 out 70, cost $0.002470, "
                       "last stop completed (completed)")
    assert "run_started  team=demo policy=files model=scripted-plan" in done.stdout
    # every event line carries its time since the first event, in order
    times = [float(m.group(1)) for line in out[1:-1] if (m := re.match(r" *\+([\d.]+)s  ", line))]
    assert len(times) == 7 and times == sorted(times) and times[0] == 0.0


async def test_falls_back_to_the_trace_file(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    await store_events(tmp_path / "gateway.db", "run_elsewhere", plan_trace("run_elsewhere"))
    lines = [json.dumps(e) for e in plan_trace("run_other")] + ["{not json"]
    lines += [json.dumps(e) for e in plan_trace(RUN)]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")

    done = gateway_trace(RUN, config)

    assert done.returncode == 0, done.stderr
    assert f"trace file {tmp_path / 'trace.jsonl'}" in done.stdout.splitlines()[0]
    assert done.stdout.count(" turn ") == 3  # only this run's lines, not run_other's
    assert "skipped 1 unreadable line(s)" in done.stderr


def test_unknown_run_says_where_it_looked_and_creates_no_database(tmp_path: Path) -> None:
    config = write_config(tmp_path, store_path="missing.db")

    done = gateway_trace("run_nope", config)

    assert done.returncode == 1
    assert "no trace for run 'run_nope'" in done.stderr
    assert f"no database at {tmp_path / 'missing.db'}" in done.stderr
    assert f"not in the trace file {tmp_path / 'trace.jsonl'}" in done.stderr
    assert not (tmp_path / "missing.db").exists()
    assert done.stdout == ""


def test_bad_config_names_file_and_field(tmp_path: Path) -> None:
    config = write_config(tmp_path, extra="teams: 3\n")
    config.write_text(config.read_text().replace("teams: [{name: demo, keys: [sk-demo], policies: [passthrough]}]\n", ""))

    done = gateway_trace(RUN, config)

    assert done.returncode == 2
    assert str(config) in done.stderr and "teams" in done.stderr


@pytest.mark.parametrize("ok", [True, False])
def test_interrupted_tools_progress_and_approvals(ok: bool) -> None:
    sink = EventList()
    trace = Tracer("r", sink)
    trace("turn", turn=1, prompt_tokens=10, completion_tokens=5, total_tokens=15, costUsd=0.00008, finish="tool_calls")
    trace("tool_start", toolName="scan_archive", args='{"path": "archive"}', callId="c1")
    trace("tool_progress", toolName="scan_archive", label="200/1200 files")
    trace("tool_start", toolName="scan_archive", args="{}", callId="c0")
    trace("tool_result", toolName="scan_archive", ms=1202, ok=False, outcome="cancelled", callId="c0")
    trace("tool_start", toolName="read_file", args='{"path": "' + "x" * 200 + '"}', callId="c2")
    trace("tool_result", toolName="read_file", ms=7.4, ok=ok, callId="c2")
    trace("approval_required", toolName="delete_file", args='{"path": "access.log"}', callId="c3")
    trace("approval_decided", callId="c3", decision="reject", reason="keep the logs")
    trace("run_stopped", status="interrupted", reason="cancelled", turns=1, costUsd=0.00008, detail="user pressed Stop")

    lines = timeline("r", sink.events)

    text = "\n".join(lines)
    assert 'tool scan_archive({"path": "archive"}) -> no result' in text
    assert "scan_archive: 200/1200 files" in text
    assert "tool scan_archive() -> cancelled in 1202 ms" in text  # a cancelled call is not a failure
    read = next(line for line in lines if "read_file(" in line)
    assert read.endswith(f"-> {'ok' if ok else 'failed'} in 7 ms") and "..." in read and len(read) < 140
    assert 'approval needed: delete_file({"path": "access.log"}) call c3' in text
    assert 'approval_decided  callId=c3 decision=reject reason="keep the logs"' in text
    assert "stopped: interrupted (cancelled), turns 1, cost $0.000080: user pressed Stop" in text
    assert lines[-1].startswith(f"total: 1 turns, 2 tool runs ({0 if ok else 1} failed)")
