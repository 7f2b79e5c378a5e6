"""`gateway trace RUN_ID`: a run's trace printed as a readable timeline.

The events come from the store the config names; if the store has none (another
machine's store, a deleted database), from the config's `trace_file`. The timeline shows
each turn with its tokens and cumulative cost, each tool call with its arguments, outcome
and duration, approvals and decisions, and the stop reason, with times relative to the
first event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO, cast

import orjson

from gateway.config.settings import Config, ConfigError, load_config
from gateway.harness.state import scoped_run_id
from gateway.harness.trace import Event, ToolResultEvent
from gateway.store import StoreError, open_store
from gateway.store.tracefile import rotated

ARGS_WIDTH = 80
# Fields shown by the header of a line; what remains is printed as key=value.
_COMMON = frozenset({"runId", "type", "ts"})


@dataclass(frozen=True)
class Loaded:
    """The run's events and where they were read from."""

    events: list[Event]
    source: str
    notes: tuple[str, ...] = ()


def trace_command(args: argparse.Namespace) -> int:
    """Print the timeline of `args.run_id` using the config at `args.config`.

    Exit codes: 0 printed, 1 no trace for that run anywhere, 2 unusable config.
    """
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"gateway trace: {line}", file=sys.stderr)
        return 2
    loaded = asyncio.run(load_any(config, candidates(config, args.run_id, getattr(args, "team", None))))
    for note in loaded.notes:
        print(f"gateway trace: {note}", file=sys.stderr)
    if not loaded.events:
        print(f"gateway trace: no trace for run {args.run_id!r} ({loaded.source})", file=sys.stderr)
        return 1
    write_timeline(args.run_id, loaded.events, sys.stdout, source=loaded.source)
    return 0


def candidates(config: Config, run_id: str, team: str | None) -> list[str]:
    """The stored ids `run_id` may name: run ids are per team (stored as `team/id`), so a bare
    id is looked for under `team`, or under each configured team in turn."""
    if "/" in run_id:
        return [run_id]
    if team is not None:
        return [scoped_run_id(team, run_id)]
    return [*(scoped_run_id(t.name, run_id) for t in config.teams), run_id]


async def load_any(config: Config, run_ids: list[str]) -> Loaded:
    """The events of the first of `run_ids` that has any (what was searched, otherwise)."""
    loaded = Loaded([], "")
    for run_id in run_ids:
        loaded = await load_events(config, run_id)
        if loaded.events:
            return loaded
    return loaded


async def load_events(config: Config, run_id: str) -> Loaded:
    """The run's events from the store, else from the trace file; notes say what was skipped."""
    notes: list[str] = []
    searched: list[str] = []
    store_cfg = config.store
    where = f"{store_cfg.kind} store {store_cfg.path or store_cfg.url or ''}".rstrip()
    if store_cfg.kind == "sqlite" and store_cfg.path and not Path(store_cfg.path).exists():
        # Opening would create an empty database; reading a trace must not write anything.
        searched.append(f"no database at {store_cfg.path}")
    else:
        try:
            store = open_store(store_cfg.options)
            try:
                events = [event for _, event in await store.events(run_id)]
            finally:
                await store.close()
        except (StoreError, OSError) as exc:
            notes.append(f"cannot read the {where}: {exc}")
            searched.append(f"{where} unreadable")
        else:
            if events:
                return Loaded(events, where, tuple(notes))
            searched.append(f"not in the {where}")
    if config.trace_file is None:
        searched.append("no trace_file configured")
        return Loaded([], "; ".join(searched), tuple(notes))
    events, bad = [], 0
    for path in [*rotated(config.trace_file, config.retention.trace_file_keep), config.trace_file]:
        found, unreadable = read_trace_file(path, run_id)  # oldest file first: lines stay in order
        events += found
        bad += unreadable
    if bad:
        notes.append(f"{config.trace_file}: skipped {bad} unreadable line(s)")
    if events:
        return Loaded(events, f"trace file {config.trace_file}", tuple(notes))
    searched.append(f"not in the trace file {config.trace_file}")
    return Loaded([], "; ".join(searched), tuple(notes))


def read_trace_file(path: Path, run_id: str) -> tuple[list[Event], int]:
    """The run's lines of a JSONL trace file, in file order, and how many lines were unreadable
    (not JSON, or with no event `type`)."""
    events: list[Event] = []
    bad = 0
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return [], 0
    with fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                bad += 1
                continue
            if not isinstance(event, dict) or event.get("runId") != run_id:
                continue
            if isinstance(event.get("type"), str):
                events.append(cast(Event, event))
            else:
                bad += 1
    return events, bad


def write_timeline(run_id: str, events: Sequence[Event], out: TextIO, source: str = "") -> None:
    """Write the timeline of `events` (one run's, in order) to `out`."""
    for line in timeline(run_id, events, source):
        out.write(line + "\n")


def timeline(run_id: str, events: Sequence[Event], source: str = "") -> list[str]:
    """The timeline as lines of text (the pure part of `gateway trace`)."""
    t0 = _ts(events[0]) if events else None
    t_end = _ts(events[-1]) if events else None
    header = f"run {run_id}: {len(events)} events"
    if t0 is not None:
        header += f", started {datetime.fromtimestamp(t0, timezone.utc).isoformat(timespec='milliseconds')}"
        if t_end is not None:
            header += f", {t_end - t0:.3f}s"
    if source:
        header += f" ({source})"
    lines = [header]
    results = {e.get("callId"): e for e in events if e["type"] == "tool_result" and e.get("callId")}
    started = {e.get("callId") for e in events if e["type"] == "tool_start" and e.get("callId")}
    for event in events:
        text = _describe(event, results, started)
        if text is None:
            continue
        ts = _ts(event)
        when = f"{f'+{ts - t0:.3f}s':>10}" if ts is not None and t0 is not None else " " * 10
        lines.append(f"{when}  {text}")
    lines.append(_totals(events))
    return lines


def _describe(event: Event, results: Mapping[Any, ToolResultEvent], started: Set[Any]) -> str | None:
    # Lines come from disk, written by any version: the kind's fields are read with .get.
    if event["type"] == "turn":
        return (f"turn {event.get('turn')}: in {event.get('prompt_tokens')} out {event.get('completion_tokens')} "
                f"tokens, cost so far {_usd(event.get('costUsd'))}, finish {event.get('finish')}")
    if event["type"] == "tool_start":
        head = f"  tool {event.get('toolName')}({_args(event.get('args'))})"
        result = results.get(event.get("callId"))
        if result is None:
            return f"{head} -> no result"
        return f"{head} -> {_outcome(result)} in {_ms(result.get('ms'))}"
    if event["type"] == "tool_result":
        if event.get("callId") in started and results.get(event.get("callId")) is event:
            return None  # shown on its tool_start line
        return f"  tool {event.get('toolName')} -> {_outcome(event)} in {_ms(event.get('ms'))}"
    if event["type"] == "tool_progress":
        return f"    {event.get('toolName')}: {event.get('label')}"
    if event["type"] == "tool_deduped":
        return f"  tool {event.get('toolName')}({_args(event.get('args'))}) -> deduped, earlier result reused"
    if event["type"] == "tool_denied":
        return f"  tool {event.get('toolName')}({_args(event.get('args'))}) -> denied: {event.get('reason')}"
    if event["type"] == "approval_required":
        return (f"  approval needed: {event.get('toolName')}({_args(event.get('args'))}) "
                f"call {event.get('callId')}")
    if event["type"] == "run_stopped":
        text = (f"stopped: {event.get('status')} ({event.get('reason')}), turns {event.get('turns')}, "
                f"cost {_usd(event.get('costUsd'))}")
        return text + (f": {event.get('detail')}" if event.get("detail") else "")
    return f"{event['type']}{_rest(event)}"


def _totals(events: Iterable[Event]) -> str:
    turns = [e for e in events if e["type"] == "turn"]
    tools = [e for e in events if e["type"] == "tool_result"]
    failed = sum(1 for e in tools if _outcome(e) not in ("ok", "cancelled"))
    tokens_in = sum(_int(e.get("prompt_tokens")) for e in turns)
    tokens_out = sum(_int(e.get("completion_tokens")) for e in turns)
    cost = turns[-1].get("costUsd") if turns else 0.0
    stops = [e for e in events if e["type"] == "run_stopped"]
    end = f", last stop {stops[-1].get('status')} ({stops[-1].get('reason')})" if stops else ", not stopped"
    return (f"total: {len(turns)} turns, {len(tools)} tool runs ({failed} failed), "
            f"tokens in {tokens_in} out {tokens_out}, cost {_usd(cost)}{end}")


def _outcome(result: ToolResultEvent) -> str:
    """ok | failed | cancelled (a call the Stop ended: pending, not failed); lines written before
    tool_result carried `outcome` say only ok or not."""
    outcome = result.get("outcome")
    if isinstance(outcome, str) and outcome:
        return "failed" if outcome == "error" else outcome
    return "ok" if result.get("ok") else "failed"


def _rest(event: Event) -> str:
    fields = [f"{k}={_value(v)}" for k, v in event.items() if k not in _COMMON]
    return ("  " + " ".join(fields)) if fields else ""


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return _clip(json.dumps(value, separators=(",", ":"), default=str))


def _args(args: Any) -> str:
    if isinstance(args, str):
        try:  # tool arguments travel as the model's JSON text
            args = json.loads(args)
        except ValueError:
            return _clip(args)
    if isinstance(args, dict) and not args:
        return ""
    return _clip(json.dumps(args, separators=(", ", ": "), ensure_ascii=False, default=str))


def _clip(text: str) -> str:
    return text if len(text) <= ARGS_WIDTH else text[: ARGS_WIDTH - 3] + "..."


def _usd(value: Any) -> str:
    return f"${value:.6f}" if isinstance(value, (int, float)) else "$?"


def _ms(value: Any) -> str:
    return f"{value:.0f} ms" if isinstance(value, (int, float)) else "? ms"


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _ts(event: Event) -> float | None:
    ts = event.get("ts")
    return float(ts) if isinstance(ts, (int, float)) else None
