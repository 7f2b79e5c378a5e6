"""MCP servers as tools of server-side runs, on a real gateway process, driven from the
OpenAI client: the test server written with the `mcp` SDK over stdio and over streamable
HTTP, and two third-party servers from PyPI (mcp-server-time, and mcp-server-git behind
the shipped example policy policies/mcp/git.yaml).

The model is a real HTTP upstream served by this test that follows a plan written in the
task (one call per turn, then an answer quoting every tool result).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from tests.mcptools.fixtures import BIN, http_server, plan_task, planning_upstream, server_log, stdio_server
from tests.server.served import events, get_run, poll, request
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import chat_app, in_thread

DEMO, OPS = "sk-mcp", "sk-mcp-ops"
APPROVAL = {"approvers": ["ops"], "rules": [{"destructive": True, "action": "ask"}]}


@dataclass
class Gateway:
    """A gateway process whose policies name MCP servers (restartable on the same port)."""

    folder: Path
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return self.proc.url

    def openai(self, policy: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=DEMO, max_retries=0, timeout=60,
                                  default_headers={"X-Policy": policy})

    def restart(self) -> None:
        n = len(list(self.folder.glob("gateway-*.log"))) + 1
        self.proc = _spawn(self.folder, self.port, n)


def _spawn(folder: Path, port: int, n: int) -> Proc:
    env = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # where pip put the servers' programs
    return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                         folder / f"gateway-{n}.log", env=env, timeout=START_TIMEOUT_S)


def _policies(folder: Path, log: Path, http_url: str) -> list[str]:
    policies = folder / "policies"
    policies.mkdir(parents=True)  # the folder too
    written = {
        "tests": {"mcp": [stdio_server("tests", log, prefix="t_", exclude=["big"])], "approval": APPROVAL,
                  # no annotations: destructive, so the rule would ask; these overrides say otherwise
                  "tools": [{"name": "t_slow", "read_only": True}, {"name": "t_fail", "destructive": False},
                            {"name": "t_crash", "destructive": False}]},
        "tests_http": {"mcp": [{"name": "tests_http", "url": http_url, "include": ["hang", "lookup", "wipe"]}],
                       "approval": APPROVAL, "tools": [{"name": "hang", "destructive": False}]},
        "clock": {"mcp": [{"name": "time", "command": [str(BIN / "mcp-server-time")]}]},
    }
    for name, body in written.items():
        (policies / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "limits": {"max_turns": 10}, **body}))
    git = yaml.safe_load((ROOT / "policies" / "mcp" / "git.yaml").read_text())  # as shipped...
    assert git["mcp"][0]["command"] == ["mcp-server-git", "--repository", "."]
    git["mcp"][0]["cwd"] = str(_repo(repo_of(folder)))  # ...pinned to the test's repository, as its comment says
    (policies / "git.yaml").write_text(yaml.safe_dump(git, sort_keys=False))
    return [*written, "git"]


def repo_of(folder: Path) -> Path:
    """The one repository the module's git policy may use."""
    return folder / "repo"


def _repo(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run(["git", "-C", str(path), "config", "user.email", "t@example.com"], check=True)
    subprocess.run(["git", "-C", str(path), "config", "user.name", "T"], check=True)
    return path


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    with in_thread(lambda: chat_app(planning_upstream)) as root:
        yield root + "/v1"


@pytest.fixture(scope="module")
def mcp_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp-log") / "server.jsonl"


@pytest.fixture(scope="module")
def http_url(mcp_log: Path) -> Iterator[str]:
    with http_server(mcp_log) as url:
        yield url


@pytest.fixture(scope="module")
def shared_gateway(tmp_path_factory: pytest.TempPathFactory, upstream_url: str, mcp_log: Path,
                   http_url: str) -> Iterator[Gateway]:
    """One gateway for the module's tests (each its own runs); tests that kill or stop it
    leave it to `gateway` to start again."""
    folder = tmp_path_factory.mktemp("mcp-gw") / "gw"
    names = _policies(folder, mcp_log, http_url)
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "upstreams": [{"name": "planner", "base_url": upstream_url}],
        "models": [{"match": "*", "upstream": "planner", "price_in": 1.0, "price_out": 1.0}],
        "teams": [{"name": "demo", "keys": [DEMO], "budget_usd": None, "policies": names},
                  {"name": "ops", "keys": [OPS], "budget_usd": None, "policies": names}],
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    gw = Gateway(folder, port, _spawn(folder, port, 1))
    yield gw
    gw.proc.stop()


@pytest.fixture
def gateway(shared_gateway: Gateway) -> Gateway:
    """The module's gateway, running (started again on its port if a test before stopped it)."""
    if shared_gateway.proc.popen.poll() is not None:
        shared_gateway.restart()
    return shared_gateway


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # no kept-alive connections: a gateway killed mid-test must not leave dead ones in a pool
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


async def run_plan(gw: Gateway, policy: str, *calls: tuple[str, dict[str, Any]],
                   run_id: str | None = None) -> tuple[str, str]:
    """Drive a server-side run through the OpenAI client; (run id, the final answer)."""
    headers = {"X-Run-Id": run_id} if run_id else {}
    async with gw.openai(policy) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="planner", messages=[{"role": "user", "content": plan_task(*calls)}], extra_headers=headers)
    return raw.headers["X-Run-Id"], raw.parse().choices[0].message.content or ""


async def tool_results(session: aiohttp.ClientSession, gw: Gateway, run_id: str) -> list[str]:
    run = await get_run(session, gw.url, run_id, key=DEMO)
    return [str(m["content"]) for m in run["transcript"] if m.get("role") == "tool"]


async def test_discovered_tools_run_with_argument_checks_progress_and_errors(gateway: Gateway, mcp_log: Path,
                                                                             session: aiohttp.ClientSession) -> None:
    run_id, answer = await run_plan(gateway, "tests", ("t_lookup", {"key": 5}), ("t_lookup", {"key": "k1"}),
                                    ("t_slow", {"steps": 3}), ("t_fail", {"why": "no disk"}),
                                    ("t_big", {"size": 10}))
    results = await tool_results(session, gateway, run_id)
    assert results[0].startswith("Error: invalid arguments for t_lookup (argument 'key'): 5 is not of type 'string'")
    assert results[1] == "value of k1"
    assert results[2] == "done in 3 steps"
    assert results[3] == "Error: Error executing tool fail: failed on purpose: no disk"  # isError: a tool error under the policy's wording
    assert results[4].startswith("Error: there is no tool named 't_big'")  # excluded by the policy
    assert [e["key"] for e in server_log(mcp_log) if e["event"] == "lookup"].count(5) == 0  # checked before sending
    trace = await events(session, gateway.url, run_id, key=DEMO)
    labels = [e["label"] for e in trace if e["type"] == "tool_progress" and e["toolName"] == "t_slow"]
    assert labels == ["step 1 of 3", "step 2 of 3", "step 3 of 3"]
    assert answer.startswith("results: ")


async def test_a_third_party_server_from_pypi_answers_through_a_run(gateway: Gateway,
                                                                    session: aiohttp.ClientSession) -> None:
    args = {"source_timezone": "Europe/Paris", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    run_id, answer = await run_plan(gateway, "clock", ("convert_time", {"time": "12:00"}), ("convert_time", args))
    results = await tool_results(session, gateway, run_id)
    assert "invalid arguments for convert_time" in results[0] and "'source_timezone' is a required property" in results[0]
    assert '"time_difference": "+8.0h"' in results[1]
    assert "+8.0h" in answer


async def test_a_destructive_tool_waits_for_approval_across_a_sigkill_and_runs_once(
        gateway: Gateway, mcp_log: Path, session: aiohttp.ClientSession) -> None:
    run_id, _ = await run_plan(gateway, "tests", ("t_touch", {"target": "a"}), ("t_wipe", {"target": "/data"}))
    before = await get_run(session, gateway.url, run_id, key=DEMO)
    assert before["status"] == "interrupted" and before["interruption"]["tool_name"] == "t_wipe"
    call_id = before["interruption"]["call_id"]
    assert not [e for e in server_log(mcp_log) if e["event"] == "wipe"]

    gateway.proc.kill()  # SIGKILL: no shutdown code runs, the stdio server loses its parent
    gateway.restart()

    status, _, body = await request(session, "POST", f"{gateway.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": call_id, "decision": "approve"})
    assert status == 200, body
    status, headers, body = await request(session, "POST", f"{gateway.url}/v1/runs/{run_id}/resume", key=DEMO,
                                          body={})
    assert status == 200, body
    assert headers["X-Run-Status"] == "completed"
    assert body["choices"][0]["message"]["content"] == "results: touched a | wiped /data"
    assert [e["target"] for e in server_log(mcp_log) if e["event"] == "wipe"] == ["/data"]  # once, after approval
    started = Counter(e["callId"] for e in await events(session, gateway.url, run_id, key=DEMO)
                      if e["type"] == "tool_start")
    assert set(started.values()) == {1}


async def test_the_shipped_git_policy_commits_once_after_approval_across_a_sigkill(
        gateway: Gateway, session: aiohttp.ClientSession) -> None:
    repo = repo_of(gateway.folder)
    (repo / "notes.txt").write_text("hello\n")
    path = str(repo)
    run_id, _ = await run_plan(gateway, "git", ("git_status", {"repo_path": path}),
                               ("git_add", {"repo_path": path, "files": ["notes.txt"]}),
                               ("git_commit", {"repo_path": path, "message": "Add notes"}))
    before = await get_run(session, gateway.url, run_id, key=DEMO)
    assert before["status"] == "interrupted" and before["interruption"]["tool_name"] == "git_commit"
    assert "notes.txt" in (await tool_results(session, gateway, run_id))[0]

    gateway.proc.kill()
    gateway.restart()
    status, _, body = await request(session, "POST", f"{gateway.url}/v1/runs/{run_id}/approvals", key=OPS,
                                    body={"call_id": before["interruption"]["call_id"], "decision": "approve"})
    assert status == 200, body
    status, headers, body = await request(session, "POST", f"{gateway.url}/v1/runs/{run_id}/resume", key=DEMO,
                                          body={})
    assert status == 200 and headers["X-Run-Status"] == "completed", body
    log = subprocess.run(["git", "-C", path, "log", "--format=%s"], check=True, capture_output=True, text=True)
    assert log.stdout.splitlines() == ["Add notes"]


async def test_the_shipped_git_policy_refuses_a_repository_outside_its_pin(
        gateway: Gateway, tmp_path: Path, session: aiohttp.ClientSession) -> None:
    other = _repo(tmp_path / "elsewhere")
    (other / "secret.txt").write_text("the other team's plans\n")
    subprocess.run(["git", "-C", str(other), "add", "secret.txt"], check=True)
    subprocess.run(["git", "-C", str(other), "commit", "-q", "-m", "Plans"], check=True)
    pinned = str(repo_of(gateway.folder))
    run_id, _ = await run_plan(gateway, "git", ("git_log", {"repo_path": str(other)}),
                               ("git_show", {"repo_path": str(other), "revision": "HEAD:secret.txt"}),
                               ("git_status", {"repo_path": pinned}))
    log, show, status = await tool_results(session, gateway, run_id)
    for refused in (log, show):
        assert f"Repository path '{other}' is outside the allowed repository" in refused, refused
        assert "Plans" not in refused and "the other team's plans" not in refused
    assert "Repository status" in status  # the pinned one still answers


async def test_cancel_reaches_the_mcp_server_over_http_within_100ms(gateway: Gateway, mcp_log: Path,
                                                                     session: aiohttp.ClientSession) -> None:
    run_id = "mcp-cancel"
    call = asyncio.ensure_future(run_plan(gateway, "tests_http", ("hang", {"tag": run_id}), run_id=run_id))
    await poll(lambda: _logged(mcp_log, "hang_started", run_id), timeout=30)
    status, _, body = await request(session, "POST", f"{gateway.url}/v1/runs/{run_id}/cancel", key=DEMO,
                                    body={"reason": "user pressed Stop"})
    assert status == 200, body
    assert body["run"]["status"] == "interrupted"
    cancelled = await poll(lambda: _logged(mcp_log, "hang_cancelled", run_id), timeout=30)
    asked = next(e for e in await events(session, gateway.url, run_id, key=DEMO) if e["type"] == "cancel_requested")
    assert cancelled["ts"] - asked["ts"] < 0.1  # the server's own clock: it saw the cancel within 100 ms
    _, answer = await call
    assert answer == "The run was interrupted: user pressed Stop."


async def test_a_crashed_server_fails_the_call_in_flight_and_is_restarted(gateway: Gateway, mcp_log: Path,
                                                                         session: aiohttp.ClientSession) -> None:
    run_id, _ = await run_plan(gateway, "tests", ("t_whoami", {}), ("t_crash", {"tag": "boom"}),
                               ("t_lookup", {"key": "after the crash"}))
    first, crashed, after = await tool_results(session, gateway, run_id)
    assert crashed.startswith("Error: the MCP server 'tests' stopped while running crash")
    assert after == "value of after the crash"
    crash = next(e for e in server_log(mcp_log) if e["event"] == "crash" and e["tag"] == "boom")
    lookup = next(e for e in server_log(mcp_log) if e["event"] == "lookup" and e["key"] == "after the crash")
    assert crash["pid"] == int(first) != lookup["pid"]  # a new process answered
    status, _, text = await request(session, "GET", f"{gateway.url}/metrics")
    assert status == 200
    assert 'gateway_mcp_server_up{server="tests"} 1.0' in text
    assert 'gateway_mcp_server_failures_total{server="tests"} 1.0' in text

    gateway.proc.stop()  # SIGTERM: the gateway stops its servers on the way out
    await poll(lambda: _gone(lookup["pid"]), timeout=30)


async def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _logged(log: Path, event: str, tag: str) -> dict[str, Any] | None:
    return next((e for e in server_log(log) if e["event"] == event and e.get("tag") == tag), None)


async def test_with_two_workers_the_mcp_health_metrics_count_every_worker(shared_gateway: Gateway, mcp_log: Path,
                                                                         session: aiohttp.ClientSession) -> None:
    """Each worker runs its own copy of each server: whichever worker a scrape lands on, it
    shows `up` 1 while the server is up in a worker, and the starts and failures of all."""
    port = free_port()
    env = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = start_gateway(["serve", "--config", str(shared_gateway.folder / "config.yaml"), "--port", str(port),
                          "--workers", "2"], "/healthz", port, shared_gateway.folder / "gateway-workers.log",
                         env=env, timeout=2 * START_TIMEOUT_S)
    try:
        await poll(lambda: _logged_text(proc, "2 workers serving"), timeout=2 * START_TIMEOUT_S)
        two = Gateway(shared_gateway.folder, port, proc)
        run_id, _ = await run_plan(two, "tests", ("t_crash", {"tag": "two-workers"}),
                                   ("t_lookup", {"key": "after"}))
        crashed, after = await tool_results(session, two, run_id)
        assert crashed.startswith("Error: the MCP server 'tests' stopped") and after == "value of after"

        def figure(text: str, name: str) -> float:
            line = next(x for x in text.splitlines() if x.startswith(name + '{server="tests"} '))
            return float(line.rsplit(" ", 1)[1])

        for _ in range(6):  # fresh connections: the scrapes land on either worker
            status, _, text = await request(session, "GET", f"{two.url}/metrics")
            assert status == 200
            assert figure(text, "gateway_mcp_server_up") == 1.0
            assert figure(text, "gateway_mcp_server_failures_total") == 1.0
            # each worker started it to discover its tools; the crashed one once more
            assert figure(text, "gateway_mcp_server_starts_total") == 3.0
    finally:
        proc.stop()


async def _logged_text(proc: Proc, text: str) -> bool:
    return text in proc.output()
