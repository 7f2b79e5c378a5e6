"""The real local model behind `gateway local`, spoken to with the real OpenAI client.

Run with `pytest -m local tests/local` (needs `pip install '.[local]'`).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.local.model import MODELS, installed_parts
from gateway.tools.catalog import LIST_FILES, PLAN_TASK, READ_FILE, SYSTEM_PROMPT
from tests.local.conftest import LocalModel, require_local_extra, start_local
from tests.support.procs import ROOT, free_port

pytestmark = pytest.mark.local

TOOLS: Any = [LIST_FILES.openai(), READ_FILE.openai()]
TOOL_NAMES = {LIST_FILES.name, READ_FILE.name}
FIRST_TURN: Any = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}]


CALL_S = 300
"""A call's deadline, against a hang only: beside two busy processes on 2 cores a call took
more than 60 s (tests/local/test_through_gateway.py's figure: under a token a second)."""


def client(served: LocalModel) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=CALL_S)


def test_installed_parts_make_the_expected_size() -> None:
    require_local_extra()
    parts = installed_parts(MODELS["0.5b"])
    assert len(parts) == 6
    assert sum(p.stat().st_size for p in parts) == MODELS["0.5b"].size


def test_ready_line_names_the_served_model(local_model: LocalModel) -> None:
    assert local_model.base_url == f"http://127.0.0.1:{local_model.port}/v1"
    assert local_model.model == "qwen2.5-coder-0.5b"
    listed = [m.id for m in client(local_model).models.list()]
    assert listed == ["qwen2.5-coder-0.5b"]


def test_tool_call_comes_back_as_tool_calls(local_model: LocalModel) -> None:
    reply = client(local_model).chat.completions.create(
        model="any-name-works", messages=FIRST_TURN, tools=TOOLS, temperature=0)

    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert "<tool_call>" not in (choice.message.content or "")
    calls = choice.message.tool_calls or []
    assert calls, choice.message
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in TOOL_NAMES
        assert isinstance(json.loads(call.function.arguments), dict)
    assert reply.model == "qwen2.5-coder-0.5b"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 100  # system + tool catalog + question
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_tool_call_and_final_usage_chunk(local_model: LocalModel) -> None:
    stream = client(local_model).chat.completions.create(
        model="any-name-works", messages=FIRST_TURN, tools=TOOLS, temperature=0,
        stream=True, stream_options={"include_usage": True})

    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish: str | None = None
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish

    assert finish == "tool_calls"
    assert "<tool_call>" not in content
    assert calls, "no tool_calls deltas were streamed"
    for call in calls.values():
        assert call["id"] and call["name"] in TOOL_NAMES
        assert isinstance(json.loads(call["arguments"]), dict)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 100 and last.usage.completion_tokens > 0


def test_second_turn_replays_the_call_and_its_result(local_model: LocalModel) -> None:
    api = client(local_model)
    first = api.chat.completions.create(model="m", messages=FIRST_TURN, tools=TOOLS, temperature=0)
    call = (first.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    history: Any = [
        *FIRST_TURN,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": "access.log 1200\nerrors.log 830\nboot.log 96\n\nerrors.log: 12:03 upstream timeout"},
    ]

    second = api.chat.completions.create(model="m", messages=history, tools=TOOLS, temperature=0)

    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls")
    assert "<tool_call>" not in (choice.message.content or "")
    assert choice.message.content or choice.message.tool_calls
    assert first.usage is not None and second.usage is not None
    # The replayed call and the tool result are in the prompt, not dropped by the template.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 30


def test_sigterm_stops_cleanly_and_frees_the_port(tmp_path: Path) -> None:
    require_local_extra()
    port = free_port()
    served = start_local(port, tmp_path / "local.log")

    served.proc.popen.send_signal(signal.SIGTERM)

    assert served.proc.popen.wait(timeout=30) == 0, served.proc.output()
    assert "gateway local: stopped" in served.proc.output()
    with socket.socket() as sock:
        # SO_REUSEADDR tolerates TIME_WAIT leftovers but still fails if anything listens there.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_port_in_use_is_named(tmp_path: Path) -> None:
    require_local_extra()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "gateway", "local", "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=180)

    assert done.returncode == 2, done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr


def test_sigterm_during_assembly_leaves_no_partial_file(tmp_path: Path) -> None:
    require_local_extra()
    cache = tmp_path / "cache"
    log = tmp_path / "local.log"
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "gateway", "local", "--port", str(free_port()),
                                  "--cache-dir", str(cache)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "assembling qwen2.5-coder-0.5b" not in log.read_text():
            assert popen.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)  # polling the log for the moment assembly starts

        popen.send_signal(signal.SIGTERM)

        assert popen.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if popen.poll() is None:
            popen.kill()
    assert "interrupted (SIGTERM) while preparing the model" in log.read_text()
    assert not cache.exists() or list(cache.iterdir()) == [], "the half-written GGUF must be deleted"


def _complete(base_url: str, prompt: str) -> dict[str, Any]:
    """llama.cpp's own /completion (it reports how many prompt tokens it evaluated), greedy."""
    import urllib.request

    body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "seed": 0, "stop": ["<|im_end|>"]}
    req = urllib.request.Request(base_url.removesuffix("/v1") + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer: dict[str, Any] = json.load(resp)
    return answer


def test_without_the_prompt_cache_every_prompt_is_evaluated_whole_and_answered_alike(tmp_path: Path) -> None:
    """`--no-prompt-cache`: the same prompt is evaluated in full each time, so its greedy answer does not
    depend on what the server was asked before (with the cache, the reused prefix changes the batches
    the rest is evaluated in, and a near tie can go the other way: docs/local-models.md, "The prompt cache")."""
    require_local_extra()
    served = start_local(free_port(), tmp_path / "local.log", "--threads", "1", "--no-prompt-cache")
    try:
        prompt = ("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n" + PLAN_TASK
                  + "<|im_end|>\n<|im_start|>assistant\n")
        other = "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
        first = _complete(served.base_url, prompt)
        again = _complete(served.base_url, prompt)
        _complete(served.base_url, other)  # a prompt sharing the system prefix, as a run's next turn would
        after_other = _complete(served.base_url, prompt)
    finally:
        served.proc.stop()
    evaluated = [r["timings"]["prompt_n"] for r in (first, again, after_other)]
    assert evaluated[0] > 20 and evaluated == [evaluated[0]] * 3, evaluated  # with the cache: 1 token again
    assert first["content"] == again["content"] == after_other["content"]
