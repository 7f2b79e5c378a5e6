"""A replica frozen past its lease writes nothing to the runs another replica took over.

Real processes: two gateway replicas (`server.lease_ttl_s: 3`, a policy with `recovery:
resume`) on one redis-server, one SQLite file or one PostgreSQL schema, and an upstream of
the test's own that counts every call it answers and the tokens it bills, and serves the runs' one tool (a slow
write, over HTTP, that records the idempotency key of every execution). Replica A drives two
runs; it is frozen (SIGSTOP, its whole process tree) while one run is inside the tool and the
other's model call is at the upstream. Replica B's recovery sweep resumes both once A's
lease expired; A is thawed while B is inside the tool of both runs, finds its lease taken
and stops driving, and only then does the upstream answer A's model call; B completes both
runs. Then:

- the team's ledger, and its spend rows, are what the upstream billed, to the micro-dollar
  (the zombie's answered call included);
- every trace line of each run was written by the replica holding its lease: A's lines
  (those its trace file shows it stored) all come before B's, and nothing A did after the
  freeze is stored (no `tool_result`, no false `run_stopped`, no turn);
- A's metrics count no stop of these runs; the tool repeated across the takeover carried
  the same idempotency key;
- a recovery sweep says "resumed" for a run only when it took the run over (once per run).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.store.base import Store, to_micros
from tests.faults.support import RedisProc, chat, serve
from tests.server.served import DEMO, events, get_run, poll
from tests.support.procs import Proc
from tests.support.upstreams import in_thread

LEASE_TTL_S = 3
TOOL_S = 8.0
"""The slow write's duration: longer than a lease and a sweep period together, so that the
thawed replica's sweep finds B's runs unsaved for a whole lease while B is inside the tool."""
PROMPT_TOKENS, COMPLETION_TOKENS = 500, 50
PRICE_IN, PRICE_OUT = 2.0, 12.0
CALL_MICROS = PROMPT_TOKENS * 2 + COMPLETION_TOKENS * 12  # $2 and $12 per million: 1,600 micro-dollars
HOLD = "HOLD"
"""A run whose first user message holds this word has its first model call held at the
upstream until the test lets it answer."""


@dataclass
class Counting:
    """What the upstream answered (and billed) and what the tool executed. Plain values only:
    the app runs on a thread of its own (tests/support/upstreams.py)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    held: int = 0
    release: bool = False
    tool_keys: list[str] = field(default_factory=list)
    tool_url: str = ""

    @property
    def billed_micros(self) -> int:
        return round((self.prompt_tokens * PRICE_IN + self.completion_tokens * PRICE_OUT))


def upstream_app(counting: Counting) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        messages = body["messages"]
        held = HOLD in str(messages[0].get("content")) and not any(m["role"] != "user" for m in messages)
        if held and counting.held == 0:
            counting.held += 1
            while not counting.release:
                await asyncio.sleep(0.01)  # the test's go-ahead, set from its own thread
        if any(m["role"] == "tool" for m in messages):
            message: dict[str, Any] = {"role": "assistant", "content": "written"}
            finish = "stop"
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_write", "type": "function", "function": {"name": "slow_write", "arguments": "{}"}}]}
            finish = "tool_calls"
        counting.calls += 1
        counting.prompt_tokens += PROMPT_TOKENS
        counting.completion_tokens += COMPLETION_TOKENS
        return web.json_response({
            "id": f"chatcmpl-{counting.calls}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"], "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
                      "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}})

    async def slow_write(request: web.Request) -> web.Response:
        body = await request.json()
        counting.tool_keys.append(str(body["idempotency_key"]))
        await asyncio.sleep(TOOL_S)  # the tool's own work: what a takeover repeats
        return web.Response(text="wrote it")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/tools/slow_write", slow_write)
    return app


@pytest.fixture
def upstream() -> Iterator[tuple[str, Counting]]:
    counting = Counting()
    with in_thread(lambda: upstream_app(counting)) as root:
        yield root, counting


def replica(folder: Path, store: dict[str, Any], root: str) -> Proc:
    policy = {
        "name": "writer", "description": "one slow write over HTTP; runs cut by a crash go on by themselves",
        "limits": {"max_turns": 6, "max_budget_usd": 1.0}, "recovery": "resume", "dedupe": "off",
        "tools": [{"name": "slow_write", "description": "Write the report (slow).",
                   "parameters": {"type": "object", "properties": {}}, "read_only": False,
                   "executor": {"http": {"url": f"{root}/tools/slow_write", "timeout_s": 60}}}],
    }
    extra = {
        "upstreams": [{"name": "counted", "kind": "openai", "base_url": f"{root}/v1"}],
        "models": [{"match": "counted-*", "upstream": "counted", "price_in": PRICE_IN, "price_out": PRICE_OUT}],
        "teams": [{"name": "demo", "keys": [DEMO], "budget_usd": 1000.0, "budget_period": "total",
                   "policies": ["writer"]}],
    }
    return serve(folder, store, server={"lease_ttl_s": LEASE_TTL_S}, extra=extra, policies=(), variants=[policy])


def tree(pid: int) -> list[int]:
    """`pid` and every process under it (a gateway's workers), parents first."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            todo.extend(int(c) for c in children)
    return found


def signal_tree(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def trace_lines(folder: Path, run_id: str) -> list[dict[str, Any]]:
    """The lines of `run_id` a replica's trace file holds: what that replica stored."""
    path = folder / "trace.jsonl"
    lines = [orjson.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()] if path.exists() else []
    return [line for line in lines if line.get("runId") == run_id]


@dataclass
class Setup:
    store: dict[str, Any]
    open_store: Any


@pytest.fixture(params=["redis", "sqlite", "postgres"])
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Setup]:
    if request.param == "postgres":
        from gateway.store.postgres import PostgresStore
        from tests.support import postgres

        dsn, schema = request.getfixturevalue("postgres_dsn"), postgres.new_schema("zombie")
        yield Setup({"kind": "postgres", "dsn": dsn, "schema": schema}, lambda: PostgresStore(dsn, schema))
    elif request.param == "redis":
        proc = RedisProc(tmp_path / "redis")
        proc.start()
        from gateway.store.redis import RedisStore
        try:
            yield Setup({"kind": "redis", "url": proc.url, "prefix": "zombie:"},
                        lambda: RedisStore(proc.url, "zombie:"))
        finally:
            proc.stop()
    else:
        from gateway.store.sqlite import SqliteStore
        path = tmp_path / "shared" / "gateway.db"
        yield Setup({"kind": "sqlite", "path": str(path)}, lambda: SqliteStore(path))


async def test_a_replica_frozen_past_its_lease_writes_nothing_to_the_runs_taken_over(
        setup: Setup, tmp_path: Path, upstream: tuple[str, Counting]) -> None:
    root, counting = upstream
    a = replica(tmp_path / "a", setup.store, root)
    b = replica(tmp_path / "b", setup.store, root)
    frozen: list[int] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            headers = {"X-Policy": "writer"}
            in_tool = asyncio.ensure_future(chat(session, a.url, {
                "model": "counted-1", "messages": [{"role": "user", "content": "write the report"}]},
                headers={**headers, "X-Run-Id": "in_tool"}))
            in_call = asyncio.ensure_future(chat(session, a.url, {
                "model": "counted-1", "messages": [{"role": "user", "content": f"write the report ({HOLD})"}]},
                headers={**headers, "X-Run-Id": "in_call"}))
            await poll(lambda: _kinds_hold(session, a.url, "in_tool", "tool_start"), timeout=30)
            await poll(lambda: _true(counting.held == 1), timeout=30)
            frozen = tree(a.popen.pid)
            signal_tree(frozen, signal.SIGSTOP)
            # B takes both runs over once A's lease expired, and runs the tool of each again.
            for rid in ("in_tool", "in_call"):
                await poll(lambda rid=rid: _resumed_in_tool(session, b.url, rid), timeout=60)
            signal_tree(frozen, signal.SIGCONT)
            frozen = []
            # Thawed, A finds its lease taken and stops driving in_call, its model call still at
            # the upstream; only then does the upstream answer that call (and bill it).
            answered_in_call = await asyncio.wait_for(in_call, 60)
            counting.release = True
            answers = [await asyncio.wait_for(in_tool, 60), answered_in_call]
            for rid in ("in_tool", "in_call"):
                await poll(lambda rid=rid: _status_is(session, b.url, rid, "completed"), timeout=60)
            # the zombie's answered call is booked on the team's ledger once its reply arrives
            store: Store = setup.open_store()
            try:
                async def ledger_settled() -> tuple[int, int] | None:
                    spent, reserved = await store.team_spend("demo", "total")
                    got = (to_micros(spent, "spent"), to_micros(reserved, "reserved"))
                    return got if got == (counting.billed_micros, 0) else None

                try:
                    await poll(ledger_settled, timeout=15)
                except TimeoutError:
                    spent, reserved = await store.team_spend("demo", "total")
                    raise AssertionError(f"ledger spent {to_micros(spent, 's')} reserved {to_micros(reserved, 'r')}"
                                         f" micro-dollars; the upstream billed {counting.billed_micros} for "
                                         f"{counting.calls} calls") from None
                # and in the spend rows (GET /v1/spend), every call once
                rows = await store.spend("2000-01-01", "2999-12-31", "demo")
                assert (sum(r.cost_micros for r in rows), sum(r.calls for r in rows)) == (
                    counting.billed_micros, counting.calls), rows
            finally:
                await store.close()
            assert counting.calls == 5  # in_tool: A's turn 1, B's turn 2; in_call: A's, then B's turns 1 and 2
            assert counting.billed_micros == 5 * CALL_MICROS

            for rid, answer in zip(("in_tool", "in_call"), answers, strict=True):
                status, _, body = answer
                assert status == 409 and body["error"]["code"] == "run_conflict", body  # A's drive: refused
                lines = await events(session, b.url, rid)
                by_a, by_b = trace_lines(tmp_path / "a", f"demo/{rid}"), trace_lines(tmp_path / "b", f"demo/{rid}")
                public = [{**e, "runId": f"demo/{rid}"} for e in lines]
                assert public == by_a + by_b, (
                    f"{rid}: stored trace is not A's lines then B's:\n"
                    f"stored {[e['type'] for e in lines]}\nA {[e['type'] for e in by_a]}\n"
                    f"B {[e['type'] for e in by_b]}")
                assert by_b[0]["type"] == "run_resumed" and by_b[0]["by"] == "gateway-recovery"
                stops = [(e["status"], e["reason"]) for e in lines if e["type"] == "run_stopped"]
                assert stops == [("completed", "completed")], stops
                assert [e["type"] for e in lines].count("turn") == 2
                run = await get_run(session, b.url, rid)
                assert run["turns"] == 2 and run["cost_usd"] == pytest.approx(2 * CALL_MICROS / 1e6)
            # in_tool's write ran twice (A's cut short), under one idempotency key; in_call's once (B's)
            assert sorted(counting.tool_keys) == sorted(["demo/in_tool:call_write"] * 2 + ["demo/in_call:call_write"])

            async with session.get(f"{a.url}/metrics") as resp:
                text = await resp.text()
            stopped = re.findall(r'^gateway_runs_stopped_total\{[^}]*\} ([0-9.]+)$', text, re.M)
            assert sum(float(v) for v in stopped) == 0, [line for line in text.splitlines()
                                                         if line.startswith("gateway_runs_stopped_total")]
        said = [line for proc in (a, b) for line in proc.output().splitlines() if "recovery:" in line]
        for rid in ("in_tool", "in_call"):
            assert sum(f"demo/{rid}" in line and "resumed ['" in line for line in said) == 1, said
    finally:
        if frozen:
            signal_tree(frozen, signal.SIGCONT)
        a.stop()
        b.stop()


async def _true(value: bool) -> bool:
    return value


async def _kinds_hold(session: aiohttp.ClientSession, url: str, rid: str, kind: str) -> bool:
    try:
        return any(e["type"] == kind for e in await events(session, url, rid))
    except AssertionError:  # not created yet
        return False


async def _resumed_in_tool(session: aiohttp.ClientSession, url: str, rid: str) -> bool:
    kinds = [e["type"] for e in await events(session, url, rid)]
    return "run_resumed" in kinds and "tool_start" in kinds[kinds.index("run_resumed"):]


async def _status_is(session: aiohttp.ClientSession, url: str, rid: str, status: str) -> bool:
    return bool((await get_run(session, url, rid))["status"] == status)
