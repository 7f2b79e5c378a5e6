"""OpenTelemetry traces and the access log of real gateway processes (issue 32's acceptance).

Two replicas (A and B) share one SQLite store and export their spans over OTLP/HTTP to a
real receiver served by this test, which decodes them with `opentelemetry-proto` as a
collector would. The model is a real HTTP upstream served here that follows a plan written
in the task and records the `traceparent` of every request; an HTTP tool and an MCP server
over streamable HTTP (the test server of tests/mcptools) record theirs too.

What is driven: a server-side run that calls the HTTP tool, the MCP tool, then a tool that
needs a person's approval (on A); the decision (on A); the resume on B. A pass-through
call that brings the client's own `traceparent`; a pass-through call whose first upstream
answers 500 and whose fallback answers; a server-side run that reaches its turn cap, which
asks a person for more (`on_exceed: ask`): the grant on A, the resume on B. Then the span tree is read back: names, parents,
links across the pause, the GenAI attributes and their values against the run's own
figures, and the `traceparent` each outgoing call carried. A records no content; B records
it (`capture_content`), each attribute cut to `content_max_chars`.

The access log: A writes JSON lines to a file, B logfmt to stderr; each has exactly one line
per request the test sent it (probes excluded), with the fields, and never a key.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web

from tests.mcptools.fixtures import BIN, http_server, next_message, server_log
from tests.support.otlp import Receiver, Span, receiving
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import in_thread

DEMO, OPS = "sk-otel-demo", "sk-otel-ops"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET_PROMPT = "the-prompt-text-nobody-may-see"
CONTENT_MAX = 40
SERVER, CLIENT, INTERNAL = 2, 3, 1  # OTLP span kinds


@dataclass
class Seen:
    """What the test's upstream and HTTP tool were sent (their `traceparent` headers)."""

    upstream: list[tuple[str, str | None]] = field(default_factory=list)  # (path, traceparent)
    tool: list[str | None] = field(default_factory=list)


def _upstream_app(seen: Seen) -> web.Application:
    async def plan(request: web.Request) -> web.Response:
        seen.upstream.append((request.path, request.headers.get("traceparent")))
        body = await request.json()
        message = next_message(body["messages"])
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response({"id": "chatcmpl-otel", "object": "chat.completion", "created": 0,
                                  "model": body["model"] + "-served", "choices": [
                                      {"index": 0, "message": message, "finish_reason": finish}],
                                  "usage": {"prompt_tokens": 20 + len(body["messages"]), "completion_tokens": 5,
                                            "total_tokens": 25 + len(body["messages"])}})

    async def broken(request: web.Request) -> web.Response:
        seen.upstream.append((request.path, request.headers.get("traceparent")))
        return web.json_response({"error": {"message": "down for the test", "type": "server_error"}}, status=500)

    async def tool(request: web.Request) -> web.Response:
        seen.tool.append(request.headers.get("traceparent"))
        body = await request.json()
        return web.Response(text=f"{body['tool']} done")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", plan)
    app.router.add_post("/broken/v1/chat/completions", broken)
    app.router.add_post("/tool", tool)
    return app


def _config(folder: Path, port: int, upstream: str, mcp_url: str, otlp: str, *, replica: str, capture: bool,
            access_log: dict[str, Any]) -> dict[str, Any]:
    policy = {
        "name": "agent", "limits": {"max_turns": 10},
        "mcp": [{"name": "tests_http", "url": mcp_url, "include": ["lookup"]}],
        "tools": [
            {"name": "fetch", "description": "Fetch a thing.", "read_only": True,
             "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
             "executor": {"http": {"url": upstream + "/tool"}}},
            {"name": "remove", "description": "Remove a thing.", "read_only": False, "needs_approval": True,
             "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
             "executor": {"http": {"url": upstream + "/tool"}}},
        ],
        "approval": {"approvers": ["ops"]},
    }
    asking = {  # a run whose turn cap asks a person for more
        "name": "asking", "limits": {"max_turns": 1, "on_exceed": "ask",
                                     "ask": {"approvers": ["ops"], "grant": {"max_turns": 5}}},
        "tools": [{"name": "note", "description": "Note a thing.", "read_only": True,
                   "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
                   "executor": {"http": {"url": upstream + "/tool"}}}],
    }
    policies = folder / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "agent.yaml").write_text(yaml.safe_dump(policy))
    (policies / "asking.yaml").write_text(yaml.safe_dump(asking))
    (policies / "passthrough.yaml").write_text(yaml.safe_dump({"name": "passthrough", "limits": {"max_turns": 50}}))
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": str(folder / "gateway.db")},
        "policies_dir": str(policies), "runs_dir": str(folder / "runs"),
        "upstreams": [{"name": "model", "base_url": upstream + "/v1"},
                      {"name": "broken", "base_url": upstream + "/broken/v1"}],
        "models": [{"match": "plan", "upstream": "model", "price_in": 2.0, "price_out": 12.0},
                   {"match": "flaky", "upstream": "broken", "fallbacks": ["plan"], "price_in": 2.0,
                    "price_out": 12.0}],
        "teams": [{"name": "demo", "keys": [DEMO], "policies": ["passthrough", "agent", "asking"]},
                  {"name": "ops", "keys": [OPS], "policies": ["passthrough"]}],
        "telemetry": {"otlp_endpoint": otlp, "service_name": "gateway-test", "resource": {"deployment.environment": "test",
                                                                                        "test.replica": replica},
                      "capture_content": capture, "content_max_chars": CONTENT_MAX},
        "access_log": access_log,
    }


@dataclass
class Replica:
    proc: Proc
    sent: list[tuple[str, str]] = field(default_factory=list)  # (method, route template) of every request sent

    def call(self, method: str, path: str, route: str, body: Any = None, *, key: str = DEMO,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = orjson.dumps(body) if body is not None else None
        request = urllib.request.Request(self.proc.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})})
        self.sent.append((method, route))
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, orjson.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, orjson.loads(exc.read())


@dataclass
class World:
    a: Replica
    b: Replica
    receiver: Receiver
    seen: Seen
    mcp_log: Path
    access_file: Path
    run: dict[str, Any]
    passthrough: dict[str, Any]
    flaky: dict[str, Any]
    spans: list[Span]


def plan(*calls: tuple[str, dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": orjson.dumps({"plan": [[n, a] for n, a in calls],
                                                      "secret": SECRET_PROMPT}).decode()}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("otel")
    seen = Seen()
    mcp_log = folder / "mcp.jsonl"
    with receiving() as receiver, in_thread(lambda: _upstream_app(seen)) as upstream, http_server(mcp_log) as mcp:
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        access_file = folder / "access.log"
        replicas = []
        for name, capture, access in (("a", False, {"file": str(access_file)}), ("b", True, {"format": "logfmt"})):
            port = free_port()
            (folder / f"{name}.yaml").write_text(yaml.safe_dump(_config(
                folder, port, upstream, mcp, receiver.url, replica=name, capture=capture, access_log=access)))
            replicas.append(Replica(start_gateway(["serve", "--config", str(folder / f"{name}.yaml")], "/healthz",
                                                  port, folder / f"{name}.log", env=env, timeout=START_TIMEOUT_S)))
        a, b = replicas
        try:
            yield drive(a, b, receiver, seen, mcp_log, access_file)
        finally:
            for replica in replicas:
                replica.proc.stop()


def drive(a: Replica, b: Replica, receiver: Receiver, seen: Seen, mcp_log: Path, access_file: Path) -> World:
    headers = {"X-Run-Id": "otel-run", "X-Policy": "agent"}
    status, first = a.call("POST", "/v1/chat/completions", "/v1/chat/completions", {
        "model": "plan", "messages": plan(("fetch", {"what": "news"}), ("lookup", {"key": "k1"}),
                                          ("remove", {"what": "old"}))}, headers=headers)
    assert status == 200 and first["run"]["status"] == "interrupted", first
    call_id = first["run"]["interruption"]["call_id"]
    status, decided = a.call("POST", "/v1/runs/otel-run/approvals", "/v1/runs/{id}/approvals",
                             {"call_id": call_id, "decision": "approve"}, key=OPS)
    assert status == 200, decided
    status, resumed = b.call("POST", "/v1/runs/otel-run/resume", "/v1/runs/{id}/resume", {})
    assert status == 200 and resumed["run"]["status"] == "completed", resumed
    status, run = b.call("GET", "/v1/runs/otel-run", "/v1/runs/{id}")
    assert status == 200
    status, passthrough = a.call("POST", "/v1/chat/completions", "/v1/chat/completions", {
        "model": "plan", "messages": plan()},
        headers={"X-Run-Id": "otel-pass", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert status == 200, passthrough
    status, flaky = b.call("POST", "/v1/chat/completions", "/v1/chat/completions", {
        "model": "flaky", "messages": plan()}, headers={"X-Run-Id": "otel-flaky"})
    assert status == 200, flaky
    status, refused = a.call("GET", "/v1/runs/nobody", "/v1/runs/{id}")
    assert status == 404
    a.call("GET", "/healthz", "/healthz")  # excluded from the access log
    b.call("GET", "/readyz", "/readyz")
    # a run at its turn cap asks for more (on A), ops grants it (on A), it resumes on B
    status, asked = a.call("POST", "/v1/chat/completions", "/v1/chat/completions", {
        "model": "plan", "messages": plan(("note", {"what": "x"}))}, headers={"X-Run-Id": "otel-limit",
                                                                          "X-Policy": "asking"})
    assert status == 200 and asked["run"]["interruption"]["type"] == "limit", asked
    status, granted = a.call("POST", "/v1/runs/otel-limit/approvals", "/v1/runs/{id}/approvals",
                             {"call_id": asked["run"]["interruption"]["call_id"], "decision": "approve"}, key=OPS)
    assert status == 200, granted
    status, resumed = b.call("POST", "/v1/runs/otel-limit/resume", "/v1/runs/{id}/resume", {})
    assert status == 200 and resumed["run"]["status"] == "completed", resumed

    def complete(spans: list[Span]) -> list[Span] | None:
        names = [s.name for s in spans]
        done = (names.count("invoke_agent agent") >= 2 and names.count("execute_tool remove") >= 1
                and names.count("invoke_agent asking") >= 2
                and sum(1 for s in spans if s.name == "POST" and s.attr("gateway.attempt.outcome") == "server_error")
                and sum(1 for s in spans if s.kind == SERVER) >= 10)
        return spans if done else None

    spans = receiver.wait_for(complete)
    return World(a, b, receiver, seen, mcp_log, access_file, run, passthrough, flaky, spans)


def parent(traceparent: str | None) -> tuple[str, str] | None:
    """(trace id, parent span id) of a `traceparent` header (its flags: sampled, and maybe random)."""
    if traceparent is None:
        return None
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent
    return trace_id, span_id


def by_id(spans: list[Span]) -> dict[str, Span]:
    return {s.span_id: s for s in spans}


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return sorted((s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)),
                  key=lambda s: s.start_ns)


def test_the_run_is_one_trace_per_drive_with_its_turns_tools_and_attempts(world: World) -> None:
    spans = world.spans
    drives = sorted((s for s in spans if s.name == "invoke_agent agent"), key=lambda s: s.start_ns)
    assert len(drives) == 2
    first, second = drives
    for drive in drives:
        assert drive.kind == INTERNAL
        assert drive.attr("gen_ai.operation.name") == "invoke_agent"
        assert drive.attr("gen_ai.agent.name") == "agent" and drive.attr("gateway.team") == "demo"
        assert drive.attr("gateway.run.id") == drive.attr("gen_ai.conversation.id") == "otel-run"
        server = by_id(spans)[drive.parent_id]  # each drive under the request that drove it
        assert server.kind == SERVER and server.trace_id == drive.trace_id
    assert by_id(spans)[first.parent_id].name == "POST /v1/chat/completions"
    assert by_id(spans)[second.parent_id].name == "POST /v1/runs/{id}/resume"
    assert (first.attr("gateway.run.status"), first.attr("gateway.run.stop_reason")) == ("interrupted", "approval")
    assert (second.attr("gateway.run.status"), second.attr("gateway.run.stop_reason")) == ("completed", "completed")
    assert first.resource["service.instance.id"] != second.resource["service.instance.id"]  # another replica
    assert first.resource["service.name"] == "gateway-test" and first.resource["deployment.environment"] == "test"

    # the first drive: three turns (each with its upstream attempt), the HTTP tool, the MCP tool
    tools = [s.name for s in children(spans, first) if s.name.startswith("execute_tool")]
    assert tools == ["execute_tool fetch", "execute_tool lookup"]
    turns = children(spans, first, "chat plan")
    assert len(turns) == 3
    for turn in turns:
        assert turn.kind == CLIENT
        [attempt] = children(spans, turn, "POST")
        assert attempt.kind == CLIENT and attempt.attr("gateway.attempt.outcome") == "ok"
        assert attempt.attr("http.response.status_code") == 200 and attempt.attr("gateway.upstream") == "model"
    # the second drive: the approved call ran, then the answering turn
    assert [s.name for s in children(spans, second)] == ["execute_tool remove", "chat plan"]
    [approval] = [e for e in first.events if e.name == "gateway.approval.required"]
    remove = children(spans, second)[0]
    assert approval.attributes["gen_ai.tool.name"] == "remove"
    assert approval.attributes["gen_ai.tool.call.id"] == remove.attr("gen_ai.tool.call.id")
    for tool in [*children(spans, first), *children(spans, second)]:
        if tool.name.startswith("execute_tool"):
            assert tool.attr("gen_ai.operation.name") == "execute_tool"
            assert tool.attr("gen_ai.tool.name") == tool.name.removeprefix("execute_tool ")
            assert tool.attr("gen_ai.tool.call.id")
            assert tool.attr("gateway.tool.outcome") == "ok" and tool.attr("gateway.tool.deduped") is False


def test_a_resumed_run_links_to_its_earlier_drive_and_to_the_decision(world: World) -> None:
    spans = world.spans
    first, second = sorted((s for s in spans if s.name == "invoke_agent agent"), key=lambda s: s.start_ns)
    decision = next(s for s in spans if s.name == "POST /v1/runs/{id}/approvals"
                    and s.events[0].attributes.get("gateway.run.id") == "otel-run")
    [decided] = [e for e in decision.events if e.name == "gateway.approval.decided"]
    assert decided.attributes["gateway.approval.decision"] == "approve"
    assert decided.attributes["gateway.approval.by"] == "ops"  # the actor: the team, and its key's id
    assert decided.attributes["gateway.key.id"].startswith("cfg_")
    assert decided.attributes["gen_ai.tool.name"] == "remove"
    links = {(link.trace_id, link.span_id): link.attributes.get("gateway.link") for link in second.links}
    assert links == {(first.trace_id, first.span_id): "earlier_drive",
                     (decision.trace_id, decision.span_id): "approval_decision"}
    assert len({first.trace_id, decision.trace_id, second.trace_id}) == 3  # three requests, three traces


def test_a_run_resumed_after_a_limit_grant_links_to_the_grant(world: World) -> None:
    spans = world.spans
    first, second = sorted((s for s in spans if s.name == "invoke_agent asking"), key=lambda s: s.start_ns)
    assert (first.attr("gateway.run.status"), first.attr("gateway.run.stop_reason")) == ("interrupted", "limit")
    [reached] = [e for e in first.events if e.name == "gateway.limit.reached"]
    assert reached.attributes["gateway.limit"] == "max_turns" and reached.attributes["gateway.run.id"] == "otel-limit"
    assert (reached.attributes["gateway.limit.used"], reached.attributes["gateway.limit.cap"]) == (1, 1)
    grant = next(s for s in spans if s.name == "POST /v1/runs/{id}/approvals"
                 and s.events[0].attributes.get("gateway.run.id") == "otel-limit")
    [decided] = [e for e in grant.events if e.name == "gateway.approval.decided"]
    assert decided.attributes["gateway.limit"] == "max_turns" and decided.attributes["gateway.approval.by"] == "ops"
    assert decided.attributes["gateway.limit.request_id"] == reached.attributes["gateway.limit.request_id"]
    assert decided.attributes["gateway.key.id"].startswith("cfg_") and "gen_ai.tool.name" not in decided.attributes
    links = {(link.trace_id, link.span_id): link.attributes.get("gateway.link") for link in second.links}
    assert links == {(first.trace_id, first.span_id): "earlier_drive", (grant.trace_id, grant.span_id): "limit_grant"}
    assert (second.attr("gateway.run.status"), second.attr("gateway.run.turns")) == ("completed", 2)


def test_tokens_and_cost_on_the_spans_are_the_runs(world: World) -> None:
    spans, run = world.spans, world.run
    turns = [s for s in spans if s.name == "chat plan" and s.attr("gateway.run.id") == "otel-run"]
    assert len(turns) == run["turns"] == 4
    assert sum(s.attr("gen_ai.usage.input_tokens") for s in turns) == run["usage"]["prompt_tokens"]
    assert sum(s.attr("gen_ai.usage.output_tokens") for s in turns) == run["usage"]["completion_tokens"]
    assert sum(s.attr("gateway.turn.cost_usd") for s in turns) == pytest.approx(run["cost_usd"], abs=1e-9)
    for turn in turns:
        assert turn.attr("gen_ai.operation.name") == "chat" and turn.attr("gen_ai.request.model") == "plan"
        assert turn.attr("gen_ai.response.model") == "plan-served"  # what the upstream's answer says
        assert turn.attr("gateway.deployment") == "plan" and turn.attr("gateway.upstream") == "model"
        assert turn.attr("gen_ai.provider.name") == "openai"
        assert turn.attr("gen_ai.response.finish_reasons") in (("tool_calls",), ("stop",))
        assert [e.name for e in turn.events] == ["gateway.admission", "gateway.booking"]
    drives = sorted((s for s in spans if s.name == "invoke_agent agent"), key=lambda s: s.start_ns)
    assert drives[-1].attr("gateway.run.cost_usd") == pytest.approx(run["cost_usd"], abs=1e-9)
    assert drives[-1].attr("gateway.run.turns") == run["turns"]
    assert sum(d.attr("gen_ai.usage.input_tokens") for d in drives) == run["usage"]["prompt_tokens"]


def test_a_pass_through_call_keeps_the_clients_trace_and_hands_it_to_the_upstream(world: World) -> None:
    spans = world.spans
    server = next(s for s in spans if s.trace_id == CLIENT_TRACE and s.kind == SERVER)
    assert server.parent_id == CLIENT_SPAN and server.name == "POST /v1/chat/completions"
    assert server.attr("http.route") == "/v1/chat/completions" and server.attr("http.response.status_code") == 200
    [chat] = children(spans, server, "chat plan")
    [attempt] = children(spans, chat, "POST")
    run = world.passthrough["run"]
    assert chat.attr("gen_ai.usage.input_tokens") == run["usage"]["prompt_tokens"]
    assert chat.attr("gateway.turn.cost_usd") == pytest.approx(run["cost_usd"], abs=1e-9)
    assert chat.attr("gateway.policy") == "passthrough"
    # the upstream was sent the attempt's span as its parent, in the client's trace
    assert ("/v1/chat/completions", (CLIENT_TRACE, attempt.span_id)) in [(p, parent(t)) for p, t in world.seen.upstream]


def test_a_failover_is_one_span_per_attempt(world: World) -> None:
    spans = world.spans
    chat = next(s for s in spans if s.name == "chat flaky")
    failed, answered = children(spans, chat, "POST")
    assert (failed.attr("gateway.upstream"), failed.attr("gateway.attempt.outcome")) == ("broken", "server_error")
    assert failed.attr("http.response.status_code") == 500 and failed.attr("error.type") == "server_error"
    assert failed.status == 2  # ERROR
    assert (answered.attr("gateway.upstream"), answered.attr("gateway.attempt.outcome")) == ("model", "ok")
    assert answered.attr("gateway.attempt.fallback") is True and answered.attr("gateway.attempt.number") == 2
    assert answered.attr("http.request.resend_count") == 1
    assert chat.attr("gateway.upstream") == "model" and chat.attr("gateway.deployment") == "plan"
    sent = dict(world.seen.upstream)
    assert parent(sent["/broken/v1/chat/completions"]) == (failed.trace_id, failed.span_id)


def test_tools_get_the_traceparent_of_their_span(world: World) -> None:
    spans = world.spans
    fetch = next(s for s in spans if s.name == "execute_tool fetch")
    remove = next(s for s in spans if s.name == "execute_tool remove")
    note = next(s for s in spans if s.name == "execute_tool note")
    assert [parent(t) for t in world.seen.tool] == [(fetch.trace_id, fetch.span_id), (remove.trace_id, remove.span_id),
                                                    (note.trace_id, note.span_id)]
    lookup = next(s for s in spans if s.name == "execute_tool lookup")
    [called] = [e for e in server_log(world.mcp_log) if e["event"] == "lookup"]
    assert parent(called["meta_traceparent"]) == (lookup.trace_id, lookup.span_id)  # MCP's _meta (SEP-414)
    assert parent(called["header_traceparent"]) == (lookup.trace_id, lookup.span_id)  # and the HTTP header


def test_no_content_unless_capture_content(world: World) -> None:
    spans = world.spans
    on_a = [s for s in spans if s.resource["test.replica"] == "a"]
    on_b = [s for s in spans if s.resource["test.replica"] == "b"]
    assert on_a and on_b
    for span in on_a:
        assert SECRET_PROMPT not in repr(span.attributes) and SECRET_PROMPT not in repr(span.events)
        assert "gen_ai.input.messages" not in span.attributes
    captured = [s.attr("gen_ai.input.messages") for s in on_b if s.name == "chat flaky"]
    assert captured and all(c is not None and len(c) == CONTENT_MAX for c in captured)  # bounded
    outputs = [s.attr("gen_ai.output.messages") for s in on_b if s.name.startswith("chat ")]
    assert outputs and all(o is not None and len(o) <= CONTENT_MAX for o in outputs)
    args = [s.attr("gen_ai.tool.call.arguments") for s in on_b if s.name == "execute_tool remove"]
    assert args == ['{"what":"old"}']


def _json_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _logfmt_lines(text: str) -> list[dict[str, str]]:
    import shlex

    out = []
    for line in text.splitlines():
        if line.startswith("time=") and " route=" in line:
            out.append(dict(item.split("=", 1) for item in shlex.split(line)))
    return out


FIELDS = ["time", "method", "route", "status", "duration_ms", "bytes", "team", "key_id", "run_id", "model", "turns",
          "cost_usd", "trace_id", "error_code"]


def test_the_access_log_has_one_line_per_request_and_never_a_key(world: World) -> None:
    world.a.proc.stop()  # every line written
    world.b.proc.stop()
    # A line is written after its answer's last byte, so with two workers the next request
    # (served by the other one) may be written first: the lines are ordered by their start.
    lines = sorted(_json_lines(world.access_file), key=lambda line: str(line["time"]))
    assert [(line["method"], line["route"]) for line in lines] == \
        [sent for sent in world.a.sent if sent[1] not in ("/healthz", "/readyz")]
    for line in lines:
        assert list(line) == FIELDS
        assert line["duration_ms"] > 0 and line["bytes"] > 0 and line["time"].endswith("Z")
    first, decision, passthrough, missing = lines[:4]
    assert (first["status"], first["team"], first["run_id"], first["model"], first["turns"]) == \
        (200, "demo", "otel-run", "plan", 3)
    assert first["key_id"].startswith("cfg_") and len(first["trace_id"]) == 32
    assert decision["team"] == "ops" and decision["run_id"] == "otel-run"
    assert passthrough["trace_id"] == CLIENT_TRACE and passthrough["cost_usd"] == world.passthrough["run"]["cost_usd"]
    assert (missing["status"], missing["error_code"]) == (404, "run_not_found")
    b_lines = sorted(_logfmt_lines(world.b.proc.output()), key=lambda line: line["time"])
    assert [(line["method"], line["route"]) for line in b_lines] == \
        [sent for sent in world.b.sent if sent[1] not in ("/healthz", "/readyz")]
    resume = b_lines[0]
    assert resume["run_id"] == "otel-run" and resume["turns"] == "4" and resume["status"] == "200"
    for text in (world.access_file.read_text(), world.b.proc.output()):
        assert DEMO not in text and OPS not in text
