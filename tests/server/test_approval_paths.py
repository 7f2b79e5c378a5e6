"""Approval globs see the path an argument names, not its spelling, on a real gateway process."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from tests.server.served import Served, chat_body, events, request


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("paths") / "gw")
    yield gateway
    gateway.proc.stop()


async def test_the_runbook_deny_rule_catches_dot_slash_notes(served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-sidestep"), headers={"X-Policy": "files"})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "I did not delete notes.txt: the policy denied it."
    run_id = headers["X-Run-Id"]
    denied = [e for e in await events(session, served.url, run_id) if e["type"] == "tool_denied"]
    assert [(e["toolName"], e["args"]) for e in denied] == [("delete_file", '{"path":"./notes.txt"}')]
    assert "runbook" in denied[0]["reason"]
    assert served.deleted(run_id) == [] and (served.sandbox(run_id) / "notes.txt").exists()
