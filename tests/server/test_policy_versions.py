"""Which policy governs a run when the version it started under is gone: one rule
(`PolicyRegistry.for_run`) for every path, against a real gateway restarted after an edit.

- the file was edited (a new version): the run goes on under the current version, whether
  it is continued by a chat call, approved and resumed through the runs API, or read;
- the policy is gone altogether: every path that must govern the run answers 409
  `policy_not_found`, and its owner can still read it.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import yaml

from tests.server.served import TASK, Served, chat_body, request


async def test_a_run_goes_on_under_the_current_version_and_stops_when_its_policy_is_gone(tmp_path: Path) -> None:
    served = Served.start(tmp_path / "gw")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:  # restarts
            chat = f"{served.url}/v1/chat/completions"
            status, _, body = await request(session, "POST", chat, body=chat_body("scripted-destructive", TASK),
                                            headers={"X-Run-Id": "edited", "X-Policy": "files"})
            assert status == 200 and body["run"]["interruption"]["type"] == "approval", body
            old_version = (await request(session, "GET", f"{served.url}/v1/runs/edited"))[2]["policy_version"]

            served.proc.stop()
            policy_file = served.folder / "policies" / "files.yaml"
            policy = yaml.safe_load(policy_file.read_text())
            policy["description"] = "edited while a run waited"
            policy_file.write_text(yaml.safe_dump(policy))
            served.restart()  # the old version is not loaded any more: the file changed

            status, _, run = await request(session, "GET", f"{served.url}/v1/runs/edited")
            assert status == 200 and run["policy_version"] == old_version
            status, _, body = await request(session, "POST", f"{served.url}/v1/runs/edited/approvals", key="sk-ops",
                                            body={"call_id": run["interruption"]["call_id"], "decision": "approve"})
            assert status == 200, body  # the approvers of the current version decide
            status, _, body = await request(session, "POST", f"{served.url}/v1/runs/edited/resume", body={})
            assert status == 200 and body["run"]["status"] == "completed", body

            served.proc.stop()
            config = yaml.safe_load((served.folder / "config.yaml").read_text())
            for team in config["teams"]:
                team["policies"] = [p for p in team["policies"] if p not in ("files", "files_expiring", "research")] or ["passthrough"]
            (served.folder / "config.yaml").write_text(yaml.safe_dump(config))
            policy_file.unlink()
            (served.folder / "policies" / "files_expiring.yaml").unlink()
            (served.folder / "policies" / "research.yaml").unlink()
            served.restart()

            status, _, body = await request(session, "POST", chat, body=chat_body("scripted-plan", [
                *TASK, {"role": "assistant", "content": "done"}, {"role": "user", "content": "again"}]),
                headers={"X-Run-Id": "edited"})
            assert status == 409 and body["error"]["code"] == "policy_not_found", body
            status, _, body = await request(session, "POST", f"{served.url}/v1/runs/edited/resume",
                                            body={"max_turns": 50})
            assert status == 409 and body["error"]["code"] == "policy_not_found", body
            status, _, run = await request(session, "GET", f"{served.url}/v1/runs/edited")
            assert status == 200 and run["status"] == "completed"  # its owner still reads it
    finally:
        served.proc.stop()
