"""Traffic for the metrics tests: a small HTTP client and a driver that makes a real
gateway produce every exit a run can take.

Everything goes over loopback HTTP to a `python -m gateway serve` subprocess; the
scripted upstream chooses its behaviour from the model name (scripted-plan, -runaway,
-destructive, -slow, -forbidden, ...) and the X-Scripted-* headers.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.tools.catalog import PLAN_TASK, SYSTEM_PROMPT
from tests.support.procs import ROOT, free_port

POLL_S = 0.02  # polling interval of the waits below, not a synchronisation sleep

# The policies the proof adds to the shipped ones, each forcing one exit.
EXTRA_POLICIES: dict[str, str] = {
    # server-side, the chapter's tools, a low turn cap and no other stop: runaway hits the cap
    "capped": "limits: {max_turns: 3, max_budget_usd: 1.0}\ndedupe: off\n",
    # server-side, a budget smaller than three turns of runaway
    "tiny": "limits: {max_turns: 50, max_budget_usd: 0.001}\ndedupe: off\n",
}
PASSTHROUGH_CAPPED = "name: passcap\ndescription: pass-through with a one-turn cap\nlimits: {max_turns: 1, max_budget_usd: 1.0}\n"


WEBHOOK_SECRET_ENV = "GATEWAY_PROOF_WEBHOOK_SECRET"
GATEWAY_ENV = {WEBHOOK_SECRET_ENV: "proof-secret"}
"""What the gateway of `write_gateway_config` needs in its environment."""


def write_gateway_config(tmp: Path, *, trace_file: bool = True) -> Path:
    """A config in `tmp`: the shipped policies plus the proof's, three teams, the scripted upstream."""
    policies = tmp / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    for source in (ROOT / "policies").glob("*.yaml"):
        (policies / source.name).write_text(source.read_text())
    files = (ROOT / "policies" / "files.yaml").read_text()
    for name, limits in EXTRA_POLICIES.items():
        text = files.replace("name: files", f"name: {name}", 1)
        text = text.replace("limits: {max_turns: 20, max_budget_usd: 0.50, budget_mode: turn}", limits.strip(), 1)
        text = text.replace("stop_when:\n  - repeated_call: 3", "stop_when: []", 1)
        text = text.replace("dedupe: read_only\n", "", 1)
        assert f"name: {name}" in text and limits.splitlines()[0] in text and "repeated_call: 3" not in text
        (policies / f"{name}.yaml").write_text(text)
    (policies / "passcap.yaml").write_text(PASSTHROUGH_CAPPED)
    config = tmp / "config.yaml"
    lines = [
        "server: {host: 127.0.0.1, port: 8080}",
        "store: {kind: sqlite, path: ./gateway.db}",
        "policies_dir: ./policies",
        "upstreams:",
        "  - {name: scripted, kind: scripted}",
        # nothing listens there: calls to it fail the way a dead upstream does
        f"  - {{name: down, base_url: 'http://127.0.0.1:{free_port()}/v1', timeout_s: 5}}",
        "models:",
        '  - {match: "scripted-*", upstream: scripted, price_in: 2.00, price_out: 12.00}',
        "  - {match: broken-model, upstream: down, price_in: 2.00, price_out: 12.00}",
        # like the shipped config, any other name is routed (to an upstream that is down)
        '  - {match: "*", upstream: down, price_in: 0.0, price_out: 0.0}',
        "teams:",
        "  - {name: demo, keys: [sk-demo], budget_usd: 10.0, budget_period: month,",
        "     policies: [passthrough, files, research, capped, tiny, passcap, supervised]}",
        "  - {name: ops, keys: [sk-ops], budget_usd: null, policies: [passthrough]}",
        "  - {name: tight, keys: [sk-tight], budget_usd: 0.0001, budget_period: total, policies: [passthrough]}",
    ]
    lines += [  # a receiver that is down: every event is a delivery attempt that fails (and is retried)
        "webhooks:",
        f"  - {{url: 'http://127.0.0.1:{free_port()}/hook', secret_env: {WEBHOOK_SECRET_ENV}, name: proof-hook,",
        "     timeout_s: 2, events: [approval_required, approval_decided, run_stopped, budget_threshold]}",
    ]
    if trace_file:
        lines.append("trace_file: ./trace.jsonl")
    config.write_text("\n".join(lines) + "\n")
    return config


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any
    text: str


class Client:
    """A team's view of the gateway (its key on every request)."""

    def __init__(self, base_url: str, key: str | None) -> None:
        self.base_url = base_url
        self.key = key

    def request(self, method: str, path: str, body: Any = None, headers: Mapping[str, str] | None = None,
                timeout: float = 60.0) -> Reply:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if self.key is not None:
            req.add_header("Authorization", f"Bearer {self.key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, resp_headers, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            status, resp_headers, raw = exc.code, dict(exc.headers), exc.read()
        text = raw.decode(errors="replace")
        try:
            parsed: Any = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return Reply(status, resp_headers, parsed, text)

    def chat(self, model: str, *, policy: str | None = None, run_id: str | None = None, stream: bool = False,
             messages: list[dict[str, Any]] | None = None, headers: Mapping[str, str] | None = None) -> Reply:
        extra = dict(headers or {})
        if policy is not None:
            extra["X-Policy"] = policy
        if run_id is not None:
            extra["X-Run-Id"] = run_id
        body: dict[str, Any] = {"model": model, "messages": messages or [{"role": "user", "content": "Go."}]}
        if stream:
            body["stream"] = True
        return self.request("POST", "/v1/chat/completions", body, extra)

    def run(self, run_id: str) -> dict[str, Any]:
        reply = self.request("GET", f"/v1/runs/{run_id}")
        assert reply.status == 200, (reply.status, reply.text)
        body: dict[str, Any] = reply.body
        return body

    def events(self, run_id: str) -> list[dict[str, Any]]:
        reply = self.request("GET", f"/v1/runs/{run_id}/events")
        assert reply.status == 200, (reply.status, reply.text)
        return [json.loads(line) for line in reply.text.splitlines() if line.strip()]


def run_status(reply: Reply) -> str:
    """The run's status after the call. A stream's headers leave before the answer; its
    run summary comes as the SSE comment `: run {...}` before `data: [DONE]`."""
    if reply.headers.get("Content-Type", "").startswith("text/event-stream"):
        for line in reversed(reply.text.splitlines()):
            if line.startswith(": run {"):
                return str(json.loads(line[len(": run "):])["status"])
        return ""
    return reply.headers.get("X-Run-Status", "")


def finished_passthrough_transcript() -> list[dict[str, Any]]:
    """A client-side loop's transcript after two tool rounds: scripted-plan answers in prose."""
    def call(call_id: str, name: str, args: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return [
        {"role": "user", "content": "Find the errors."},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "list_files", "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "errors.log 120\naccess.log 300\nnotes.txt 40"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "read_file", '{"path": "errors.log"}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "ERROR timeout talking to the database"},
    ]


@dataclass
class Exits:
    """What one round of traffic did: run ids by the exit they took."""

    runs: dict[str, str] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, exit_name: str, reply: Reply, expect_status: int, expect_run_status: str | None) -> str:
        assert reply.status == expect_status, f"{exit_name}: HTTP {reply.status} {reply.text[:500]}"
        run_id = reply.headers.get("X-Run-Id", "")
        if expect_run_status is not None:
            assert run_status(reply) == expect_run_status, f"{exit_name}: {dict(reply.headers)} {reply.text[:500]}"
            assert run_id, f"{exit_name}: no X-Run-Id"
        self.runs[exit_name] = run_id
        self.statuses[exit_name] = reply.status
        return run_id


def drive_every_exit(demo: Client, ops: Client, tight: Client) -> Exits:
    """One round of traffic taking every exit: completed, max_turns, max_budget, team_budget,
    approval (one decided, one left pending), limit (a request for more, left pending), cancelled, permanent_error, repeated_call,
    upstream_error, plus streaming, tool errors and deduped calls."""
    exits = Exits()
    # completed, server-side: list, read, answer (the chapter's `plan` run, to the token)
    chapter = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]
    exits.add("completed", demo.chat("scripted-plan", policy="files", messages=chapter), 200, "completed")
    # completed, pass-through, streamed (time to first token)
    streamed = demo.chat("scripted-plan", stream=True, messages=finished_passthrough_transcript())
    assert streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-300:]
    exits.add("completed_stream", streamed, 200, "completed")
    # a tool error the model recovers from; a deduped read
    exits.add("recover", demo.chat("scripted-recover", policy="files"), 200, "completed")
    exits.add("dedupe", demo.chat("scripted-repeat", policy="files"), 200, "completed")
    # max_turns: server-side runaway under a cap of 3; pass-through refused at its cap (429)
    exits.add("max_turns", demo.chat("scripted-runaway", policy="capped"), 200, "max_turns_exceeded")
    first = demo.chat("scripted-runaway", policy="passcap")
    run_id = exits.add("passcap_first", first, 200, "running")
    exits.add("max_turns_429", demo.chat("scripted-runaway", run_id=run_id), 429, "max_turns_exceeded")
    # max_budget: runaway with $0.001
    exits.add("max_budget", demo.chat("scripted-runaway", policy="tiny"), 200, "budget_exceeded")
    # team budget: the team's whole budget is smaller than one call's reservation
    exits.add("team_budget", tight.chat("scripted-plan"), 429, "budget_exceeded")
    # repeated_call: runaway under files asks for the same list_files three times
    exits.add("repeated_call", demo.chat("scripted-runaway", policy="files"), 200, "failed")
    # permanent error: a read outside the sandbox
    exits.add("permanent_error", demo.chat("scripted-forbidden", policy="files"), 200, "failed")
    # approval: one approved by ops (then completes), one left waiting
    approved = exits.add("approval", demo.chat("scripted-destructive", policy="files"), 200, "interrupted")
    exits.add("approval_pending", demo.chat("scripted-destructive", policy="files"), 200, "interrupted")
    decided = ops.request("POST", f"/v1/runs/{approved}/approvals", {"call_id": "c2", "decision": "approve"})
    assert decided.status == 200, (decided.status, decided.text)
    if run_status(decided) != "completed":
        resumed = demo.request("POST", f"/v1/runs/{approved}/resume", {})
        assert resumed.status == 200 and run_status(resumed) == "completed", (resumed.status, resumed.text)
    # limit: the shipped supervised policy asks ops for more at 2 turns (left waiting)
    exits.add("limit", demo.chat("scripted-plan", policy="supervised"), 200, "interrupted")
    # upstream failure: a server-side run whose upstream is down fails with a reason; a
    # pass-through call the scripted upstream answers 500 is answered 502 (the client may retry)
    exits.add("upstream_error", demo.chat("broken-model", policy="files"), 200, "failed")
    exits.add("upstream_error_502", demo.chat("scripted-plan", headers={"X-Scripted-Fail": "500"}), 502, None)
    # cancelled: Stop pressed while the slow tool runs
    exits.add("cancelled", cancel_slow_run(demo), 200, "interrupted")
    return exits


def cancel_slow_run(client: Client, timeout: float = 30.0) -> Reply:
    """Start scripted-slow (a 3 s archive scan), press Stop once the tool runs, return its reply."""
    run_id = "run_slow_" + uuid.uuid4().hex[:12]
    replies: list[Reply] = []
    worker = threading.Thread(target=lambda: replies.append(client.chat("scripted-slow", policy="files", run_id=run_id)))
    worker.start()
    deadline = time.monotonic() + timeout
    while True:
        probe = client.request("GET", f"/v1/runs/{run_id}/events")
        if probe.status == 200 and '"tool_start"' in probe.text:
            break
        assert time.monotonic() < deadline, f"scripted-slow never started its tool: {probe.status} {probe.text[:300]}"
        time.sleep(POLL_S)
    cancel = client.request("POST", f"/v1/runs/{run_id}/cancel", {"reason": "user pressed Stop"})
    assert cancel.status in (200, 202), (cancel.status, cancel.text)
    worker.join(timeout)
    assert replies, "the slow run's request never returned after Stop"
    return replies[0]
