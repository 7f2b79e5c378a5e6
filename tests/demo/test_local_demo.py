"""`gateway demo --local` without a model: the judge, the table, the config and finding a running model."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config.settings import parse_config
from gateway.demo.local import (
    CHAPTER_REFERENCE,
    DEMO_CALL_DEADLINE_S,
    DEMO_MAX_TOKENS,
    DEMO_MAX_TURNS,
    DEMO_TOOL_ROUNDS,
    TASKS,
    ORACLE,
    DemoError,
    chosen_tasks,
    TaskResult,
    Truth,
    demo_policies,
    ensure_local,
    first_file_named,
    first_number,
    gateway_config,
    judge,
    oracle_transcript,
    served_model,
    total_line,
)
from gateway.cli import LOCAL_TASKS, build_parser
from gateway.harness.loop import ANSWER_NOW
from gateway.tools.catalog import SYSTEM_PROMPT
from tests.local.test_gguf import write_gguf
from tests.support.procs import free_port

SAMPLE = Truth.of()


def test_truth_comes_from_the_packaged_sample() -> None:
    assert SAMPLE.sizes == {"access.log": 52, "errors.log": 87, "notes.txt": 40}
    assert SAMPLE.largest == "errors.log"
    assert [t.question for t in TASKS] == [
        "Which file mentions a timeout?", "How many files are in the directory?",
        "Read notes.txt and tell me what it says.", "List the files and then read each one.",
        "Which file is the largest?", "Is there a file about rotating logs?"]


@pytest.mark.parametrize("kind, answer, right", [
    # the chapter's own answers, marked as the chapter marks them
    ("timeout", "The file timeout.txt does not exist...", False),
    ("count", "There are three files...", True),
    ("notes", "Remember to rotate your logs.", True),
    ("largest", "The largest file is access.log.", False),
    # and the answers it should have given
    ("timeout", "errors.log mentions a timeout: worker 7 timed out after 30000 ms.", True),
    ("timeout", "access.log mentions it, not errors.log.", False),
    ("count", "There are 3 files in the directory.", True),
    ("count", "There are 2 files: access.log and errors.log.", False),
    ("count", "I could not count them.", False),
    ("notes", "notes.txt is a text file.", False),
    ("largest", "errors.log (87 bytes) is larger than access.log (52 bytes).", True),
    ("largest", "I don't know.", False),
    ("rotating", "Yes, notes.txt says to rotate the logs every week.", True),
    ("rotating", "Yes.", True),
    ("rotating", "No, there is no such file.", False),
    ("rotating", "Yes: errors.log.", False),
])
def test_judge_answers_against_the_sample(kind: str, answer: str, right: bool) -> None:
    assert judge(kind, answer, [], SAMPLE) is right  # type: ignore[arg-type]


@pytest.mark.parametrize("runs, right", [
    (["list_files", "read_file:access.log", "read_file:errors.log", "read_file:notes.txt"], True),
    (["read_file:./access.log", "read_file:errors.log", "read_file:notes.txt"], True),
    (["list_files", "read_file:access.log", "read_file:errors.log"], False),
    (["list_files", "read_file:C:\\path\\to\\notes.txt", "read_file:access.log", "read_file:errors.log"], False),
    (["list_files"], False),
])
def test_read_all_is_judged_by_what_was_read(runs: list[str], right: bool) -> None:
    assert judge("read_all", "I read them all.", runs, SAMPLE) is right


def test_truth_follows_the_folder_it_is_given(tmp_path: Path) -> None:
    (tmp_path / "big.log").write_text("x" * 500 + " request timeout\n")
    (tmp_path / "notes.txt").write_text("Rotating the archives happens on Sundays.\n")
    (tmp_path / ".hidden").write_text("y" * 5000)
    truth = Truth.of(tmp_path)

    assert truth.largest == "big.log"
    assert judge("largest", "big.log is the largest.", [], truth)
    assert judge("timeout", "big.log has a request timeout.", [], truth)
    assert judge("count", "Two files.", [], truth)
    assert judge("rotating", "notes.txt talks about rotating archives.", [], truth)
    assert judge("notes", "It says the archives are rotated on Sundays.", [], truth)
    assert not judge("largest", "errors.log", [], truth)


def test_helpers_find_the_first_file_and_number() -> None:
    names = ["access.log", "errors.log", "notes.txt"]
    assert first_file_named("Both ERRORS.LOG and access.log", names) == "errors.log"
    assert first_file_named("nothing here", names) is None
    assert first_number("there are twelve, not 3") == 12
    assert first_number("2 files") == 2
    assert first_number("none") is None


def result(turns: int, tools: int, wall: int, task: str, answer: str, right: bool,
           status: str = "completed", reason: str | None = None, repairs: int = 0) -> TaskResult:
    return TaskResult(task=task, kind="timeout", run_id="r", status=status, reason=reason, turns=turns,
                      repairs=repairs, tool_runs=["list_files"] * tools, prompt_tokens=1, completion_tokens=1, cost_usd=0.0,
                      wall_ms=wall, answer=answer, right=right)


def test_lines_in_the_chapters_format() -> None:
    line = result(2, 1, 15_260, "Which file mentions a timeout?", "The file timeout.txt does not exist...",
                  False).line()
    assert line == ('turns=2 repairs=0 tools=1 wall= 15,260ms  exit=completed          Which file mentions a timeout?'
                    '       -> "The file timeout.txt does not exist..."  WRONG')
    failed = result(5, 3, 900, "Which file is the largest?", "The run failed:\n  repeated call " + "x" * 100,
                    False, "failed", "repeated_call", repairs=4).line()
    assert '-> "The run failed: repeated call xxx' in failed and failed.count("\n") == 0
    assert "turns=5 repairs=4 " in failed and "exit=failed " in failed
    assert failed.endswith('..."  WRONG (repeated_call)')


def test_total_line_reproduces_the_chapters_arithmetic() -> None:
    walls = [15_260, 13_037, 10_121, 21_290, 10_698, 12_490]
    tools = [1, 1, 1, 2, 1, 1]
    rows = [result(2, n, w, "t", "a", i in (1, 2)) for i, (n, w) in enumerate(zip(tools, walls))]
    assert total_line(rows) == ("TOTAL turns=12  repairs=0  toolruns=7  wall=82,896ms  mean turn=6,908ms  "
                                "right=2/6")
    assert "mean turn=6,908ms" in CHAPTER_REFERENCE


def test_gateway_config_is_valid_for_the_real_loader(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    policies = demo_policies(tmp_path)
    path.write_text(yaml.safe_dump(gateway_config("http://127.0.0.1:8081/v1", 9999, policies)))
    config = parse_config(yaml.safe_load(path.read_text()), path)
    local = config.upstreams["local"]
    assert (local.kind, local.tool_repair, local.max_tokens) == ("local", True, DEMO_MAX_TOKENS)
    assert local.timeout_s == DEMO_CALL_DEADLINE_S
    demo_files = yaml.safe_load((policies / "files.yaml").read_text())
    assert demo_files["limits"]["max_turns"] == DEMO_MAX_TURNS and demo_files["tool_rounds"] == DEMO_TOOL_ROUNDS
    always = yaml.safe_load((demo_policies(tmp_path / "x", tool_rounds=None) / "files.yaml").read_text())
    assert "tool_rounds" not in always
    off = gateway_config("http://127.0.0.1:8081/v1", 9999, policies, repair=False)
    assert parse_config(off, path).upstreams["local"].tool_repair is False

    route = config.route("qwen2.5-coder-0.5b")
    assert route is not None and route.upstream == "local" and route.price.input_per_million == 0
    assert route.price.output_per_million == 0
    assert config.upstreams["local"].base_url == "http://127.0.0.1:8081/v1"
    assert (config.policies_dir / "files.yaml").is_file()
    assert config.teams[0].policies == ("files",) and config.teams[0].keys == ("sk-demo",)


async def test_a_model_already_answering_is_used_not_started(tmp_path: Path) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        name, child = await ensure_local(session, str(server.make_url("/v1")), tmp_path)

    assert (name, child) == ("served-model", None)
    assert not (tmp_path / "local.log").exists()


async def test_nothing_answering_where_no_local_model_can_be_started_is_named(tmp_path: Path) -> None:
    url = f"http://127.0.0.2:{free_port()}/v1"  # loopback, but not an address `gateway local` is started on
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DemoError, match=f"nothing answers at {url}, and it is not a local address"):
            await ensure_local(session, url, tmp_path)
    assert not (tmp_path / "local.log").exists()


async def test_the_served_model_is_named_from_its_gguf_header(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", {"general.architecture": "qwen2", "general.name": "Qwen2.5 Coder 0.5B"})
    paths = {"p": str(gguf)}

    async def props(request: web.Request) -> web.Response:
        return web.json_response({"model_path": paths["p"]} if paths["p"] else {})

    app = web.Application()
    app.router.add_get("/props", props)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        base = str(server.make_url("/v1"))
        assert await served_model(session, base) == "Qwen2.5 Coder 0.5B (m.gguf)"
        paths["p"] = str(tmp_path / "gone.gguf")
        assert (await served_model(session, base)).startswith("unknown (gone.gguf:")
        paths["p"] = ""
        assert (await served_model(session, base)).startswith("unknown (the server does not name")


def test_one_task_or_a_few_can_be_chosen() -> None:
    assert LOCAL_TASKS == tuple(t.kind for t in TASKS)
    assert chosen_tasks() == TASKS
    assert [t.kind for t in chosen_tasks(["largest", "timeout"])] == ["timeout", "largest"]  # in the demo's order
    with pytest.raises(DemoError, match="no such task: tiemout"):
        chosen_tasks(["tiemout"])
    args = build_parser().parse_args(["demo", "--local", "--task", "count", "--task", "notes"])
    assert args.task == ["count", "notes"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--local", "--task", "tiemout"])


# What the real Qwen2.5-Coder-0.5B wrote for "Which file is the largest?" (2026-12-01, greedy, through the
# gateway): first a read of a path it invented, then, shown the error, list_files.
INVENTED = {"name": "read_file", "arguments": '{"path": "C:\\\\Users\\\\YourUsername\\\\Desktop\\\\log.txt"}'}
LISTING = {"name": "list_files", "arguments": "{}"}


def small_model_reply(body: dict[str, Any]) -> dict[str, Any]:
    """Like the 0.5B: a call whenever it is offered tools (the invented path first), an answer otherwise."""
    results = [str(m.get("content")) for m in body["messages"] if m.get("role") == "tool"]
    if body.get("tools"):
        call = LISTING if results else INVENTED
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call-{len(results)}", "type": "function", "function": call}]}
        finish = "tool_calls"
    else:
        listed = any("errors.log  87 bytes" in r for r in results)
        message = {"role": "assistant", "content": "The largest file is errors.log." if listed
                   else "The largest file in the specified directory is \"read_file\"."}
        finish = "stop"
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "small",
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}


async def demo_against(reply: Callable[[dict[str, Any]], dict[str, Any]], bodies: list[dict[str, Any]],
                       args: list[str], cwd: Path, timeout_s: float) -> bytes:
    """`gateway demo --local ARGS` (a real process) against a local upstream whose chat answers are
    `reply(body)`; each body it got is appended to `bodies`. The demo's stdout; it must exit 0."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "small", "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        return web.json_response(reply(body))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app, host="127.0.0.1") as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "demo", "--local", *args, "--local-url", str(server.make_url("/v1")),
            cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, err.decode()
    return out


async def test_the_demo_runs_one_task_and_a_failed_read_leaves_the_tools_offered(tmp_path: Path) -> None:
    """`gateway demo --local --task largest` against a local upstream that answers like the real 0.5B:
    the read of an invented path fails, so that turn is not the policy's one tool round (`tool_rounds`),
    the model is offered the tools again, lists the folder, and answers from the listing."""
    bodies: list[dict[str, Any]] = []
    out = await demo_against(small_model_reply, bodies, ["--json", "--task", "largest"], tmp_path, 120)
    rows = [orjson.loads(line) for line in out.splitlines()]
    assert [r["kind"] for r in rows] == ["largest"]  # only the task asked for
    (row,) = rows
    assert row["status"] == "completed" and row["turns"] == 3 and row["right"] is True
    assert row["tool_runs"] == ["read_file:C:\\Users\\YourUsername\\Desktop\\log.txt", "list_files"]
    assert [bool(b.get("tools")) for b in bodies] == [True, True, False]
    assert "Answer my question now" in bodies[-1]["messages"][-1]["content"]


async def test_the_oracle_transcript_is_what_the_real_tools_answer_to_a_right_agents_calls() -> None:
    rotating = next(t for t in TASKS if t.kind == "rotating")
    messages = await oracle_transcript(rotating, ORACLE["enough"]["rotating"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert messages[3]["content"].splitlines()[-1] == "3 files, 179 bytes in total"
    call = messages[4]["tool_calls"][0]
    assert (call["function"]["name"], orjson.loads(call["function"]["arguments"])) == ("read_file",
                                                                                       {"path": "notes.txt"})
    assert messages[5] == {"role": "tool", "tool_call_id": call["id"], "name": "read_file",
                           "content": SAMPLE.texts["notes.txt"]}
    every = await oracle_transcript(rotating, ORACLE["everything"]["rotating"])
    assert [m["content"] for m in every if m["role"] == "tool"][1:] == list(SAMPLE.texts.values())
    assert set(ORACLE["enough"]) == set(ORACLE["everything"]) == {t.kind for t in TASKS} - {"read_all"}


async def test_the_oracle_asks_the_model_as_the_gateways_answer_turn_does(tmp_path: Path) -> None:
    """`gateway demo --local --oracle --task notes`, against a local upstream: one greedy, capped call
    per oracle without tools, the transcript then the gateway's answer line; the answer judged."""
    bodies: list[dict[str, Any]] = []

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        read = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        answer = read[-1].strip() if len(read) == 1 else "To read notes.txt, use the read_file tool."
        return {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}]}

    out = await demo_against(reply, bodies, ["--oracle", "--task", "notes"], tmp_path, 60)
    lines = out.decode().splitlines()
    assert lines[1].startswith("oracle enough     notes     after read_file(notes.txt) ") and lines[1].endswith(
        '-> "Remember to rotate the logs every week."  RIGHT')
    assert lines[2].startswith("oracle enough     right=1/1")
    assert lines[3].endswith("WRONG") and lines[4].startswith("oracle everything right=0/1")
    assert len(bodies) == 2
    for body in bodies:
        assert "tools" not in body and (body["temperature"], body["seed"], body["max_tokens"]) == (0, 0, DEMO_MAX_TOKENS)
        assert body["messages"][-1] == {"role": "user", "content": ANSWER_NOW}
        assert body["messages"][:2] == [{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": "Read notes.txt and tell me what it says."}]
