"""A real `python -m gateway serve` process for the server-side run tests, and HTTP helpers.

The config lives in a temp folder: the shipped policies plus two test policies
(`hybrid`: only list_files runs server-side, so a client-supplied read_file comes back to
the client; `files_expiring`: approvals expire after 50 ms; `limited`: 3 tool calls, no
dedupe; `timed`: 2 s of wall-clock; `files_auto`: resumes by itself after a decision;
`files_ask`: at 2 turns asks ops for 3 more, and goes on by itself after a grant), a SQLite store, teams demo
(sk-demo, runs the policies), ops (sk-ops, the approver), other (sk-other) and poor
(sk-poor, a team budget of $0.001: too little for one turn's reservation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import yaml

from tests.support.procs import ROOT, Proc, free_port, start_gateway

DEMO, OPS, OTHER, POOR = "sk-demo", "sk-ops", "sk-other", "sk-poor"
KEYS = "sk-demo-keys"
"""A key of team demo that may manage the team's keys (`manage_keys: true`)."""
PLAN_ANSWER = "errors.log mentions a timeout: worker 7 timed out after 30000 ms."
TASK = [{"role": "user", "content": "Which file mentions a timeout?"}]
EXPIRES_AFTER_S = 0.05
LIMITED_TOOL_CALLS = 3
TIMED_DURATION_S = 2.0  # under the 3 s scan_archive, over a model turn on a busy machine
"""Less than the 3 s scan_archive takes, far more than a scripted turn."""
ASK_MAX_TURNS = 2
ASK_GRANT_TURNS = 3
"""`files_ask`: the turn cap that asks, and the grant it proposes."""


def _files_policy() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())
    return data


def write_config(folder: Path, port: int) -> Path:
    policies = folder / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    for path in (ROOT / "policies").glob("*.yaml"):
        (policies / path.name).write_text(path.read_text())
    hybrid = _files_policy()
    hybrid.update(name="hybrid", tools=[t for t in hybrid["tools"] if t["name"] == "list_files"], approval={})
    (policies / "hybrid.yaml").write_text(yaml.safe_dump(hybrid))
    expiring = _files_policy()
    expiring["name"] = "files_expiring"
    expiring["approval"]["expires_after_s"] = EXPIRES_AFTER_S
    (policies / "files_expiring.yaml").write_text(yaml.safe_dump(expiring))
    limited = _files_policy()  # every call runs (no dedupe, no repeat stop): only the tool-call cap stops runaway
    limited.update(name="limited", dedupe="off", stop_when=[])
    limited["limits"].update(max_tool_calls=LIMITED_TOOL_CALLS)
    (policies / "limited.yaml").write_text(yaml.safe_dump(limited))
    timed = _files_policy()
    timed["name"] = "timed"
    timed["limits"].update(max_duration_s=TIMED_DURATION_S)
    (policies / "timed.yaml").write_text(yaml.safe_dump(timed))
    auto = _files_policy()  # resumes by itself once a call is decided
    auto["name"] = "files_auto"
    auto["approval"]["on_decision"] = "resume"
    (policies / "files_auto.yaml").write_text(yaml.safe_dump(auto))
    asks = _files_policy()  # asks ops for more turns at 2, and goes on by itself after a grant
    asks["name"] = "files_ask"
    asks["limits"].update(max_turns=ASK_MAX_TURNS, on_exceed="ask", ask={"grant": {"max_turns": ASK_GRANT_TURNS}})
    asks["approval"]["on_decision"] = "resume"
    (policies / "files_ask.yaml").write_text(yaml.safe_dump(asks))
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "trace_file": "./trace.jsonl",
        "upstreams": [{"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "scripted-*", "upstream": "scripted", "price_in": 2.0, "price_out": 12.0}],
        "teams": [
            {"name": "demo", "keys": [DEMO, {"key": KEYS, "manage_keys": True, "name": "key manager"}],
             "budget_usd": 10.0,
             "policies": ["passthrough", "files", "research", "hybrid", "files_expiring", "limited", "timed",
                          "files_auto", "files_ask"]},
            {"name": "ops", "keys": [OPS], "budget_usd": None, "policies": ["passthrough"]},
            {"name": "other", "keys": [OTHER], "budget_usd": None, "policies": ["passthrough", "files"]},
            {"name": "poor", "keys": [POOR], "budget_usd": 0.001, "budget_period": "total", "policies": ["files"]},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Served:
    """One gateway process (restartable on the same port, config and database)."""

    folder: Path
    port: int
    proc: Proc

    @classmethod
    def start(cls, folder: Path) -> Served:
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        write_config(folder, port)
        return cls(folder, port, cls._spawn(folder, port, 1))

    @staticmethod
    def _spawn(folder: Path, port: int, n: int) -> Proc:
        return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                             folder / f"gateway-{n}.log")

    def restart(self) -> None:
        """A new process on the same port, config and database (after `kill`)."""
        n = len(list(self.folder.glob("gateway-*.log"))) + 1
        self.proc = self._spawn(self.folder, self.port, n)

    def replica(self) -> Proc:
        """Another gateway process on the same config and database, on its own port."""
        port = free_port()
        return start_gateway(["serve", "--config", str(self.folder / "config.yaml"), "--port", str(port)],
                             "/healthz", port, self.folder / f"replica-{port}.log")

    @property
    def url(self) -> str:
        return self.proc.url

    def openai(self, key: str = DEMO, **headers: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                                  default_headers=headers, timeout=30)

    def sandbox(self, run_id: str, team: str = "demo") -> Path:
        """The run's own copy of the sample folder (runs/<team>/<run id>/<folder>)."""
        folders = [p for p in (self.folder / "runs" / team / run_id).iterdir() if p.is_dir()]
        assert len(folders) == 1, folders
        return folders[0]

    def deleted(self, run_id: str) -> list[str]:
        """Every delete the run's sandbox executed, in order (its journal)."""
        journal = self.sandbox(run_id) / ".deleted.jsonl"
        if not journal.exists():
            return []
        return [orjson.loads(line)["path"] for line in journal.read_bytes().splitlines() if line.strip()]


def served_fixture(name: str) -> Any:
    """A module-scoped pytest fixture: one gateway process (`Served`) for the module's tests."""

    @pytest.fixture(scope="module")
    def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
        gateway = Served.start(tmp_path_factory.mktemp(name) / "gw")
        yield gateway
        gateway.proc.stop()

    return served


def auth(key: str = DEMO, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def request(session: aiohttp.ClientSession, method: str, url: str, *, key: str = DEMO,
                  body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One call; returns (status, headers, parsed JSON or raw text)."""
    data = orjson.dumps(body) if body is not None else None
    async with session.request(method, url, data=data, headers=auth(key, **(headers or {}))) as resp:
        raw = await resp.read()
        try:
            parsed: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            parsed = raw.decode()
    return resp.status, dict(resp.headers), parsed


async def get_run(session: aiohttp.ClientSession, url: str, run_id: str, key: str = DEMO) -> dict[str, Any]:
    status, _, body = await request(session, "GET", f"{url}/v1/runs/{run_id}", key=key)
    assert status == 200, body
    run: dict[str, Any] = body
    return run


async def events(session: aiohttp.ClientSession, url: str, run_id: str, key: str = DEMO) -> list[dict[str, Any]]:
    async with session.get(f"{url}/v1/runs/{run_id}/events", headers=auth(key)) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/x-ndjson"
        text = await resp.text()
    return [orjson.loads(line) for line in text.splitlines()]


async def poll(check: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
    """Await `check()` until it returns something truthy (the readiness probe of a condition)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


async def wait_event(session: aiohttp.ClientSession, url: str, run_id: str, kind: str,
                     count: int = 1) -> list[dict[str, Any]]:
    """Poll the run's trace until it holds `count` events of `kind`."""
    async def check() -> list[dict[str, Any]] | None:
        try:
            found = [e for e in await events(session, url, run_id) if e["type"] == kind]
        except AssertionError:  # the run is not created yet
            return None
        return found if len(found) >= count else None

    result: list[dict[str, Any]] = await poll(check)
    return result


def chat_body(model: str, messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages or TASK, **extra}
