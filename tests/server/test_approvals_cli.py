"""`gateway approvals` as a person runs it: a real CLI process against a real gateway process."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.approvals_cli import render_list
from tests.server.served import DEMO, OPS, OTHER, Served, chat_body, get_run, request
from tests.support.procs import run_gateway


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("approvals_cli") / "gw")
    yield gateway
    gateway.proc.stop()


def cli(*args: str, key: str | None = OPS, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_URL", "GATEWAY_KEY")}
    if key is not None:
        env["GATEWAY_KEY"] = key
    if url is not None:
        env["GATEWAY_URL"] = url
    return run_gateway(["approvals", *args], env=env)


async def destructive_run(session: aiohttp.ClientSession, served: Served) -> str:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    return headers["X-Run-Id"]


async def test_list_show_approve_with_url_and_key_from_the_environment(served: Served,
                                                                      session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served)
    done = cli("list", url=served.url)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["RUN", "POLICY", "CALL", "TOOL", "ARGUMENTS", "WAITING"]
    row = next(r for r in rows if r.startswith(f"demo/{run_id} "))
    assert row.split()[1:4] == ["files", "c2", "delete_file"] and "access.log" in row

    listed = orjson.loads(cli("list", "--json", "--url", served.url).stdout)
    [item] = [r for r in listed["data"] if r["id"] == run_id]  # one object per pending call
    assert (item["call_id"], item["tool_name"], item["args"], item["run"]) == (
        "c2", "delete_file", {"path": "access.log"}, f"demo/{run_id}")
    assert item["interruption"]["call_id"] == "c2" and item["waiting_s"] >= 0  # the run's fields, as before

    shown = cli("show", f"demo/{run_id}", "--url", served.url)
    assert shown.returncode == 0, shown.stderr
    assert "waiting" in shown.stdout and "call c2: delete_file" in shown.stdout
    assert '    "path": "access.log"' in shown.stdout  # arguments pretty-printed
    assert "last user message" in shown.stdout

    approved = cli("approve", run_id, "c2", "--url", served.url, "--reason", "the audit is done")
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout == (f"approved call c2 of run demo/{run_id}; the run waits for its owner to resume it "
                               f"(POST /v1/runs/{run_id}/resume with team demo's key, or the run's next chat call)\n")
    run = await get_run(session, served.url, run_id)
    assert run["decisions"]["c2"] == {**run["decisions"]["c2"], "decision": "approve", "by": "ops",
                                      "reason": "the audit is done"}
    assert f"demo/{run_id} " not in cli("list", url=served.url).stdout  # decided: no longer pending

    again = cli("approve", run_id, "c2", "--url", served.url)
    assert again.returncode == 1 and again.stderr.startswith("gateway approvals: HTTP 409: ")


async def test_the_gateway_is_found_from_its_config_and_an_auto_resumed_run_says_so(
        served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files_auto"})
    assert status == 200, body
    run_id = headers["X-Run-Id"]
    config = str(served.folder / "config.yaml")  # serves on a free port, not 8080
    listed = cli("list", "--config", config, url="http://127.0.0.1:9")  # --config wins over $GATEWAY_URL
    assert listed.returncode == 0 and f"demo/{run_id} " in listed.stdout, listed.stderr
    approved = cli("approve", run_id, "c2", "--config", config)
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.endswith("the gateway resumes the run now (its policy says on_decision: resume)\n")
    missing = cli("list", "--config", str(served.folder / "nope.yaml"))
    assert missing.returncode == 2 and "--config" in missing.stderr and "file not found" in missing.stderr


async def test_reject_needs_a_reason_and_the_model_reads_it(served: Served, session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served)
    missing = cli("reject", run_id, "c2", "--url", served.url)
    assert missing.returncode == 2 and "--reason" in missing.stderr
    done = cli("reject", run_id, "c2", "--reason", "keep the logs", "--json", "--url", served.url)
    assert done.returncode == 0, done.stderr
    answer = orjson.loads(done.stdout)
    assert answer["decision"]["decision"] == "reject" and answer["decision"]["reason"] == "keep the logs"
    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/resume", key=DEMO, body={})
    assert status == 200, body
    run = await get_run(session, served.url, run_id)
    written = next(m for m in run["transcript"] if m.get("tool_call_id") == "c2")
    assert "keep the logs" in written["content"]


async def test_refusals_are_the_gateways_words(served: Served, session: aiohttp.ClientSession) -> None:
    run_id = await destructive_run(session, served)
    not_approver = cli("approve", run_id, "c2", "--url", served.url, key=DEMO)
    assert not_approver.returncode == 1
    assert "HTTP 403" in not_approver.stderr and "may not decide" in not_approver.stderr
    hidden = cli("show", run_id, "--url", served.url, key=OTHER)
    assert hidden.returncode == 1 and "HTTP 404" in hidden.stderr
    assert cli("list", "--url", served.url, key="sk-nobody").returncode == 1
    no_key = cli("list", "--url", served.url, key=None)
    assert no_key.returncode == 2 and "GATEWAY_KEY" in no_key.stderr
    bad_url = cli("list", "--url", "ftp://example.com")
    assert bad_url.returncode == 2 and "--url" in bad_url.stderr


def test_model_written_text_cannot_drive_the_terminal(tmp_path: Path) -> None:
    run = {"id": "r1", "team": "demo", "policy": "files", "status": "interrupted", "updated_at": 0.0,
           "decisions": {}, "interruption": {"type": "approval", "call_id": "c1", "tool_name": "rm\x1b[2J",
                                              "args": {"path": "\x1b]0;pwned\x07"}}}
    text = render_list([run], 5.0)
    assert "\x1b" not in text and "\x07" not in text
    assert "rm\\x1b[2J" in text
