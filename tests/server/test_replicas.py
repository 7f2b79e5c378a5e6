"""Two real gateway processes on one real redis-server (or one PostgreSQL) and one shared `runs_dir`.

Each replica has its own config file (own folder, port and trace file) naming the same
store (a Redis prefix or a PostgreSQL schema of the module's own), the same policies folder and the same
`runs_dir`, with `server.lease_ttl_s: 1`. Shown here:

- a strict team budget is shared: a storm of calls split over both replicas never
  jointly spends more than it (and the ledger equals what the runs were charged);
- a run paused for approval on A is approved and resumed on B, in A's sandbox;
- A is SIGKILLed mid-tool; B is refused while A's lease lives, then takes the run over
  when the lease expires and completes it without paying a turn twice.

Plus the config side of these settings: `server.lease_ttl_s` and `runs_dir`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.config.settings import DEFAULT_LEASE_TTL_S, ConfigError, parse_config
from gateway.harness.usage import Price, Usage
from gateway.server.runs.governor import MARGIN_USD
from gateway.store.periods import period_key
from gateway.store import Store
from gateway.tokens import get_counter
from tests.server.conftest import config_data
from tests.server.served import (
    DEMO,
    OPS,
    TASK,
    chat_body,
    events,
    get_run,
    poll,
    request,
    wait_event,
)
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.shared_store import SHARED_KINDS, shared_store, view
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway

THRIFTY = "sk-thrifty"
LEASE_TTL_S = 1.0
PRICE = Price(2.0, 12.0)
STORM_BODY: dict[str, Any] = {"model": "scripted-runaway", "messages": TASK}
STORM_HEADERS = {"X-Policy": "passthrough", "X-Scripted-Latency-Ms": "20"}


@dataclass
class Pair:
    """Replicas `a` and `b`, the folder they share and their store's address."""

    a: Proc
    b: Proc
    folder: Path
    store_config: dict[str, Any]

    @property
    def runs_dir(self) -> Path:
        return self.folder / "shared-runs"

    def restart_a(self) -> None:
        """Replica `a` started again on its port and config (after it was killed)."""
        port = int(self.a.url.rsplit(":", 1)[1])
        n = len(list((self.folder / "a").glob("gateway*.log"))) + 1
        self.a = start_gateway(["serve", "--config", str(self.folder / "a" / "config.yaml")], "/healthz", port,
                               self.folder / "a" / f"gateway-{n}.log", timeout=START_TIMEOUT_S)

    def store(self) -> Store:
        """Another client of the replicas' store, to read the ledger they share."""
        return view(self.store_config)

    def sandbox(self, run_id: str) -> Path:
        folders = [p for p in (self.runs_dir / "demo" / run_id).iterdir() if p.is_dir()]
        assert len(folders) == 1, folders  # one sandbox per run, whichever replica drove it
        return folders[0]

    def trace_file(self, name: str, run_id: str) -> list[dict[str, Any]]:
        """What replica `name` itself wrote of the run (each replica has its own trace file)."""
        path = self.folder / name / "trace.jsonl"
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []
        return [e for e in lines if e.get("runId") == f"demo/{run_id}"]


def write_replica_config(folder: Path, port: int, shared: Path, store: dict[str, Any],
                         budget_usd: float, policies: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True)
    config = {
        "server": {"host": "127.0.0.1", "port": port, "lease_ttl_s": LEASE_TTL_S},
        "store": store,
        "policies_dir": str(shared / "policies"),
        "runs_dir": str(shared / "shared-runs"),
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "demo", "keys": [DEMO], "budget_usd": 10.0,
             "policies": ["passthrough", "files", "files_auto", *policies]},
            {"name": "ops", "keys": [OPS], "budget_usd": None, "policies": ["passthrough"]},
            {"name": "thrifty", "keys": [THRIFTY], "budget_usd": budget_usd, "budget_period": "total",
             "budget_mode": "strict", "policies": ["passthrough"]},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def storm_turn_cost() -> float:
    """What one runaway turn of the storm costs (its prompt and its 23-token reply)."""
    prompt = get_counter().count_request(STORM_BODY["messages"])
    return PRICE.cost(Usage(prompt, 23))


def start_pair(shared: Path, store: str | dict[str, Any], extra: dict[str, dict[str, Any]] | None = None) -> Pair:
    """Replicas a and b on one store (a Redis URL: a prefix of their own there; or a `store:`
    config), one policies folder, one runs_dir; `extra` policies (by name) are added to the
    folder and to team demo's."""
    (shared / "policies").mkdir(parents=True)
    for name, data in (extra or {}).items():
        (shared / "policies" / f"{name}.yaml").write_text(yaml.safe_dump({**data, "name": name}))
    for path in (ROOT / "policies").glob("*.yaml"):
        (shared / "policies" / path.name).write_text(path.read_text())
    auto = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())  # resumes by itself after a decision
    auto["name"] = "files_auto"
    auto["approval"]["on_decision"] = "resume"
    (shared / "policies" / "files_auto.yaml").write_text(yaml.safe_dump(auto))
    if isinstance(store, str):
        store = {"kind": "redis", "url": store, "prefix": f"replicas-{uuid.uuid4().hex[:12]}:"}
    budget = 8 * storm_turn_cost()

    def start(name: str) -> Proc:
        port = free_port()
        config = write_replica_config(shared / name, port, shared, store, budget, tuple(extra or ()))
        return start_gateway(["serve", "--config", str(config)], "/healthz", port, shared / name / "gateway.log",
                             timeout=START_TIMEOUT_S)

    with ThreadPoolExecutor(2) as pool:  # both start at once: the test waits for the slower one only
        futures = [pool.submit(start, name) for name in ("a", "b")]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 2:  # one failed to start: stop the other, then fail with the reason
        for proc in started:
            proc.stop()
        for f in futures:
            f.result()
    return Pair(started[0], started[1], shared, store)


@pytest.fixture(scope="module", params=SHARED_KINDS)
def replica_pair(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Shared by the module's tests (each uses its own team or run ids), on Redis and on PostgreSQL."""
    started = start_pair(tmp_path_factory.mktemp("replicas"), shared_store(request.param, request, "replicas"))
    yield started
    started.a.stop()
    started.b.stop()


@pytest.fixture
def pair(replica_pair: Pair) -> Pair:
    """The module's pair, both replicas running (`a` started again if a test killed it)."""
    if replica_pair.a.popen.poll() is not None:
        replica_pair.restart_a()
    return replica_pair


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_a_run_changed_on_one_replica_is_seen_by_the_other_at_its_next_call(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    # A keeps the runs it booked (RunCache) and skips loading them; B's changes must still
    # decide A's next call: a cancel, and a resume that changes the run's turn cap.
    run_id = f"cached-{uuid.uuid4().hex[:8]}"
    runs = f"/v1/runs/{run_id}"

    async def call_a() -> tuple[int, dict[str, str], Any]:
        return await request(session, "POST", f"{pair.a.url}/v1/chat/completions", key=OPS,
                             body=chat_body("scripted-plan"), headers={"X-Run-Id": run_id})

    status, headers, _ = await call_a()
    assert status == 200 and headers["X-Run-Turns"] == "1"
    status, _, body = await request(session, "POST", f"{pair.b.url}{runs}/cancel", key=OPS, body={"reason": "b"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    status, _, body = await call_a()
    assert status == 409 and body["error"]["code"] == "run_cancelled", body
    status, _, body = await request(session, "POST", f"{pair.b.url}{runs}/resume", key=OPS, body={"max_turns": 2})
    assert status == 200 and body["run"]["status"] == "running", body

    async def call_b() -> tuple[int, dict[str, str], Any]:
        return await request(session, "POST", f"{pair.b.url}/v1/chat/completions", key=OPS,
                             body=chat_body("scripted-plan"), headers={"X-Run-Id": run_id})

    status, headers, _ = await call_b()
    assert status == 200 and headers["X-Run-Turns"] == "2"
    status, _, body = await call_a()  # A's copy: 1 turn of the policy's 20; stored: 2 of 2
    assert status == 429 and body["error"]["type"] == "max_turns_exceeded", body
    status, _, body = await request(session, "POST", f"{pair.b.url}{runs}/resume", key=OPS, body={"max_turns": 4})
    assert status == 200, body
    status, headers, _ = await call_a()  # A's copy now says 2 of 2: the stored cap of 4 decides
    assert status == 200 and headers["X-Run-Turns"] == "3"
    status, headers, _ = await call_b()
    assert status == 200 and headers["X-Run-Turns"] == "4"
    status, _, body = await call_a()  # A booked turn 3 itself; B's turn 4 reached the cap
    assert status == 429 and body["error"]["type"] == "max_turns_exceeded", body


async def test_a_call_of_a_run_this_replica_never_loaded_is_judged_on_the_stored_run(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    # On Redis a call whose run this process has not cached is admitted without a look-up
    # (its admission stores a new run or reports the stored one): the stored run must still
    # decide, its turns, its policy against X-Policy, and a server-side policy's loop.
    async def call(proc: Proc, run_id: str, **headers: str) -> tuple[int, dict[str, str], Any]:
        return await request(session, "POST", f"{proc.url}/v1/chat/completions", body=chat_body("scripted-plan"),
                             headers={"X-Run-Id": run_id, **headers})

    passing = f"blind-{uuid.uuid4().hex[:8]}"
    status, headers, _ = await call(pair.a, passing)
    assert status == 200 and headers["X-Run-Turns"] == "1"
    status, headers, _ = await call(pair.b, passing)  # B never saw this run
    assert status == 200 and headers["X-Run-Turns"] == "2"

    served = f"blind-{uuid.uuid4().hex[:8]}"
    status, headers, body = await call(pair.a, served, **{"X-Policy": "files"})
    assert status == 200, body
    turns = int(headers["X-Run-Turns"])
    status, _, body = await call(pair.b, served, **{"X-Policy": "passthrough"})
    assert status == 400 and body["error"]["code"] == "policy_mismatch", body
    status, headers, body = await call(pair.b, served)  # the team's default policy is pass-through
    assert status == 200, body
    assert int(headers["X-Run-Turns"]) > turns  # the files policy's loop ran it, as on A
    assert [e["type"] for e in await events(session, pair.a.url, served)].count("run_resumed") == 1
    assert [e["type"] for e in pair.trace_file("b", served)].count("run_resumed") == 1


async def test_a_strict_team_budget_holds_across_replicas(pair: Pair, session: aiohttp.ClientSession) -> None:
    budget = 8 * storm_turn_cost()
    replicas = [pair.a, pair.b] * 20

    async def call(proc: Proc, key: str = THRIFTY, **extra: Any) -> tuple[str, int, dict[str, str], Any]:
        status, headers, body = await request(session, "POST", f"{proc.url}/v1/chat/completions", key=key,
                                              body={**STORM_BODY, **extra}, headers=STORM_HEADERS)
        return proc.url, status, headers, body

    for proc in (pair.a, pair.b):  # warm both (a team without a budget): neither starts the storm late
        assert (await call(proc, OPS))[1] == 200
    # Replica b spends first, so the storm must count b's spending whichever replica serves
    # it: under load one replica may take every call of the storm (its own ledger would then
    # let it pass the budget).
    _, status, headers, body = await call(pair.b)
    assert status == 200, body
    paid: list[float] = [float(headers["X-Run-Cost-Usd"])]
    # An allowance of 30 tokens (a reply is 23): several calls hold reservations at once,
    # from both replicas, instead of the first one holding the whole budget.
    results = await asyncio.gather(*[call(p, max_tokens=30) for p in replicas])
    for url, status, headers, body in results:
        if status == 200:
            paid.append(float(headers["X-Run-Cost-Usd"]))
        else:
            assert status == 429 and body["error"]["type"] == "team_budget_exceeded", body
    assert 1 < len(paid) < len(replicas) + 1  # the storm was served, and the shared ledger stopped it
    assert sum(paid) <= budget + 1e-9, (sum(paid), budget)

    # One call at a time, alternating replicas: strict clamps each to what is left, so the
    # budget is used up to the last affordable token and never passed.
    for proc in [pair.a, pair.b] * 10:
        _, status, headers, body = await call(proc)
        if status != 200:
            break
        paid.append(float(headers["X-Run-Cost-Usd"]))
    assert status == 429 and body["error"]["type"] == "team_budget_exceeded", body
    store = pair.store()
    try:
        spent, reserved = await store.team_spend("thrifty", "total")
    finally:
        await store.close()
    smallest_call = PRICE.cost(Usage(get_counter().count_request(TASK), 1)) + MARGIN_USD
    assert reserved == 0 and budget - smallest_call < spent <= budget + 1e-9, (spent, budget)
    assert sum(paid) == pytest.approx(spent, abs=1e-9)  # the ledger is exactly what the runs were charged


async def test_a_run_paused_on_one_replica_is_approved_and_finished_on_the_other(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{pair.a.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200, body
    run_id = headers["X-Run-Id"]
    assert body["run"]["interruption"]["call_id"] == "c2" and body["run"]["turns"] == 2
    sandbox = pair.sandbox(run_id)  # made by A under the shared runs_dir

    status, _, body = await request(session, "POST", f"{pair.b.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "approve", "reason": "old logs"})
    assert status == 200, body
    status, headers, body = await request(session, "POST", f"{pair.b.url}/v1/runs/{run_id}/resume", body={})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "Deleted access.log to free space."
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "3"

    assert pair.sandbox(run_id) == sandbox  # B worked in A's folder
    journal = [orjson.loads(line)["path"] for line in (sandbox / ".deleted.jsonl").read_bytes().splitlines()]
    assert journal == ["access.log"]
    assert sorted(p.name for p in sandbox.iterdir() if not p.name.startswith(".")) == ["errors.log", "notes.txt"]
    trace = await events(session, pair.a.url, run_id)  # the shared trace, read through A
    assert Counter(e["callId"] for e in trace if e["type"] == "tool_start") == {"c1": 1, "c2": 1}
    assert [e["turn"] for e in trace if e["type"] == "turn"] == [1, 2, 3]
    # who did what: A the first two turns, B the approved delete and the last turn
    assert [e["turn"] for e in pair.trace_file("a", run_id) if e["type"] == "turn"] == [1, 2]
    b_lines = pair.trace_file("b", run_id)
    assert [e["callId"] for e in b_lines if e["type"] == "tool_start"] == ["c2"]
    assert [e["turn"] for e in b_lines if e["type"] == "turn"] == [3]


async def test_a_run_whose_replica_died_is_taken_over_when_its_lease_expires(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    run_id = f"orphan-{uuid.uuid4().hex[:8]}"
    store = pair.store()
    try:  # what the module's other runs of team demo spent
        spent_before, _ = await store.team_spend("demo", period_key("month"))
    finally:
        await store.close()
    call = asyncio.ensure_future(request(session, "POST", f"{pair.a.url}/v1/chat/completions",
                                         body=chat_body("scripted-slow"),
                                         headers={"X-Policy": "files", "X-Run-Id": run_id}))
    await wait_event(session, pair.b.url, run_id, "tool_progress")  # A is inside scan_archive (3 s)
    pair.a.kill()
    killed_at = time.monotonic()
    with pytest.raises(aiohttp.ClientError):
        await call

    refusals: list[str] = []

    async def resumed_on_b() -> tuple[dict[str, str], Any] | None:
        status, headers, body = await request(session, "POST", f"{pair.b.url}/v1/runs/{run_id}/resume", body={})
        if status == 409:
            refusals.append(body["error"]["code"])
            return None
        assert status == 200, body
        return headers, body

    headers, body = await poll(resumed_on_b, timeout=10 * LEASE_TTL_S + 5)
    assert refusals and set(refusals) == {"run_busy"}  # the dead replica's lease held the run...
    assert time.monotonic() - killed_at < LEASE_TTL_S + 3 + 2  # ...about its TTL (+ the 3 s scan), not 15 s
    assert headers["X-Run-Status"] == "completed" and headers["X-Run-Turns"] == "2"
    assert body["choices"][0]["message"]["content"].startswith("The archive scan reported: Scanned 1200")

    run = await get_run(session, pair.b.url, run_id)
    assert run["cost_usd"] == pytest.approx(sum((u["prompt_tokens"] * 2 + u["completion_tokens"] * 12) / 1e6
                                                for u in run["per_turn"]))
    trace = await events(session, pair.b.url, run_id)
    assert [e["turn"] for e in trace if e["type"] == "turn"] == [1, 2]  # turn 1 (paid on A) was not paid again
    assert [(e["callId"], e["ok"]) for e in trace if e["type"] == "tool_result"] == [("c1", True)]
    assert [e["callId"] for e in pair.trace_file("b", run_id) if e["type"] == "tool_start"] == ["c1"]  # rerun on B
    store = pair.store()
    try:
        spent, reserved = await store.team_spend("demo", period_key("month"))  # demo's budget_period
    finally:
        await store.close()
    assert reserved == 0 and spent - spent_before == pytest.approx(run["cost_usd"], abs=1e-9)  # each turn paid once
    pair.sandbox(run_id)  # one sandbox: B found A's


def test_lease_ttl_and_runs_dir_settings(tmp_path: Path) -> None:
    file = tmp_path / "cfg" / "config.yaml"
    config = parse_config(config_data(), file)
    assert config.server.lease_ttl_s == DEFAULT_LEASE_TTL_S == 15.0
    assert config.runs_dir == file.resolve().parent / "runs"  # next to ./gateway.db, which is next to the config
    config = parse_config(config_data(store={"kind": "sqlite", "path": "./data/gw.db"}), file)
    assert config.runs_dir == file.resolve().parent / "data" / "runs"
    config = parse_config(config_data(store={"kind": "redis", "url": "redis://127.0.0.1:1/0"}), file)
    assert config.runs_dir == file.resolve().parent / "runs"  # no file store: next to the config
    config = parse_config({**config_data(server={"lease_ttl_s": 0.5}), "runs_dir": "../shared"}, file)
    assert config.server.lease_ttl_s == 0.5 and config.runs_dir == file.resolve().parent / ".." / "shared"
    for value, problem in ((0, "must be > 0, got 0"), ("soon", "must be a number, got a string ('soon')")):
        with pytest.raises(ConfigError) as caught:
            parse_config(config_data(server={"lease_ttl_s": value}), file)
        assert caught.value.path == "server.lease_ttl_s" and caught.value.problem == problem
    with pytest.raises(ConfigError) as caught:
        parse_config({**config_data(), "runs_dir": 3}, file)
    assert caught.value.path == "runs_dir"
