"""A run's transcript, stored beside its head, answers GET /v1/runs/{id} as a whole run did:
a real gateway (SQLite) and pass-through clients that send their history again, edit it,
or continue a run stored before heads (schema 2, written into the file as an older
gateway left it)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.served import Served, get_run, request
from tests.support.procs import ROOT

FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("transcripts") / "gw")
    yield gateway
    gateway.proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def call(session: aiohttp.ClientSession, served: Served, run_id: str,
               messages: list[dict[str, Any]]) -> dict[str, Any]:
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body={"model": "scripted-plan", "messages": messages},
                                    headers={"X-Policy": "passthrough", "X-Run-Id": run_id,
                                             "X-Scripted-Reply": orjson.dumps({"content": f"answer {len(messages)}"})
                                             .decode()})
    assert status == 200, body
    message: dict[str, Any] = body["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None or k == "content"}


async def test_a_history_sent_again_then_edited_reads_back_as_the_last_call_saw_it(
        served: Served, session: aiohttp.ClientSession) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "first " + "x" * 50_000}]
    for i in range(3):
        reply = await call(session, served, "run_history", history)
        history = [*history, reply, {"role": "user", "content": f"and then {i}?"}]
    run = await get_run(session, served.url, "run_history")
    assert run["transcript"] == history[:-1] and run["turns"] == 3 and len(run["per_turn"]) == 3
    # the client drops the last exchanges and rewrites its first question
    edited = [{"role": "user", "content": "another first question"}]
    reply = await call(session, served, "run_history", edited)
    run = await get_run(session, served.url, "run_history")
    assert run["transcript"] == [*edited, reply] and run["turns"] == 4
    assert [t["total_tokens"] for t in run["per_turn"]] == [
        t["prompt_tokens"] + t["completion_tokens"] for t in run["per_turn"]]


async def test_a_run_stored_by_an_older_gateway_is_read_and_continued(
        served: Served, session: aiohttp.ClientSession) -> None:
    legacy = orjson.loads((FIXTURES / "run_v2.json").read_bytes())
    legacy.update(run_id="demo/run_older", team="demo", policy="passthrough", status="running", reason=None,
                  interruption=None, model="scripted-plan")
    legacy["limits"]["max_duration_s"] = None  # the fixture's run started long ago
    with sqlite3.connect(served.folder / "gateway.db") as db:
        db.execute("INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, body, turns,"
                   " cost_micros) VALUES (?, 'demo', 'running', 'passthrough', ?, ?, 0, ?, 2, 960)",
                   ("demo/run_older", legacy["created_at"], legacy["updated_at"], orjson.dumps(legacy)))
    run = await get_run(session, served.url, "run_older")
    assert run["transcript"] == legacy["messages"] and run["per_turn"] == legacy["per_turn"]
    assert (run["turns"], run["cost_usd"], run["status"]) == (2, 0.00096, "running")
    messages = [*legacy["messages"], {"role": "tool", "tool_call_id": "c2", "name": "delete_file", "content": "done"}]
    reply = await call(session, served, "run_older", messages)
    run = await get_run(session, served.url, "run_older")
    assert run["transcript"] == [*messages, reply] and run["turns"] == 3 and len(run["per_turn"]) == 3
    with sqlite3.connect(served.folder / "gateway.db") as db:
        body, = db.execute("SELECT body FROM runs WHERE id = 'demo/run_older'").fetchone()
        rows, = db.execute("SELECT COUNT(*) FROM transcripts WHERE run_id = 'demo/run_older' AND kind = 0").fetchone()
    assert b'"messages":[' not in bytes(body) and rows == len(messages) + 1  # saved in the new shape
