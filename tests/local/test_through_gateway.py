"""The real local model behind a real gateway: one server-side run of the `files` policy.

The OpenAI client talks to `gateway serve`, which runs the loop against `gateway local`
and executes the model's tool calls itself. What the model chooses is its business; the
test asserts the shape: a real tool call ran, the run stopped at one of the five exits,
and usage and cost were recorded (the local model is priced here, so cost is nonzero).
The upstream is of kind `local`: llama.cpp's 500 for a tool call it could not parse is
repaired by the gateway, never the run's end, and every call asks for at most the cap.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import yaml

from gateway.tools.catalog import FILE_TOOLS, PLAN_TASK, SYSTEM_PROMPT
from tests.local.conftest import LocalModel
from tests.support.procs import ROOT, Proc, free_port, serving_config

# Two capped turns of a CPU model on a loaded 2-core machine (0.1-3 tokens a second measured): minutes.
pytestmark = [pytest.mark.local, pytest.mark.timeout(900)]

KEY = "sk-demo"
PRICE_IN, PRICE_OUT = 1.50, 6.00  # USD per million tokens: nonzero so the cost is checkable
MAX_TURNS = 2  # a tool call and an answer; keeps the run well under a minute on 2 cores
CAP = 128  # a tool call or a one-sentence answer needs under 100 tokens
CALL_S = 300  # a call's deadline: the model writes under a token a second on a loaded 2-core machine
# The chapter's task: the 0.5B model answered its first turn with a tool call 33 times out of 33
# (other questions sometimes get a direct answer, which would leave nothing to execute).
EXITS = {"completed", "failed", "max_turns_exceeded", "budget_exceeded", "interrupted"}


@pytest.fixture
def gateway(local_model: LocalModel, tmp_path: Path) -> Iterator[Proc]:
    policies = tmp_path / "policies"
    policies.mkdir()
    files: dict[str, Any] = yaml.safe_load((ROOT / "policies" / "files.yaml").read_text())
    files["limits"]["max_turns"] = MAX_TURNS
    (policies / "files.yaml").write_text(yaml.safe_dump(files))
    (policies / "passthrough.yaml").write_text((ROOT / "policies" / "passthrough.yaml").read_text())
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "upstreams": [{"name": "local", "kind": "local", "base_url": local_model.base_url, "timeout_s": CALL_S,
                       "max_tokens": CAP}],
        "models": [{"match": "*", "upstream": "local", "price_in": PRICE_IN, "price_out": PRICE_OUT}],
        "teams": [{"name": "demo", "keys": [KEY], "budget_usd": None, "policies": ["files", "passthrough"]}],
    }
    with serving_config(tmp_path, config) as proc:
        yield proc


def get(proc: Proc, path: str) -> bytes:
    request = urllib.request.Request(proc.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:  # a non-2xx answer raises HTTPError
        body: bytes = resp.read()
    return body


def run_task(gateway: Proc, model: str) -> tuple[str, Any, dict[str, Any]]:
    """One server-side run of the chapter's task: (run id, raw HTTP response, the run as GET shows it)."""
    run_id = f"through-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=2 * MAX_TURNS * CALL_S + 60,
                           default_headers={"X-Run-Id": run_id, "X-Policy": "files"})
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}])
    return run_id, raw, orjson.loads(get(gateway, f"/v1/runs/{run_id}"))


def test_the_gateway_runs_the_local_models_tool_calls(gateway: Proc, local_model: LocalModel) -> None:
    run_id, raw, run = run_task(gateway, local_model.model)
    reply = raw.parse()
    # llama.cpp's 500 for a call it cannot parse (a few percent of first turns) is retried and repaired
    assert run["reason"] != "upstream_error", run

    assert raw.headers["x-run-id"] == run_id
    assert reply.choices[0].message.content, "every exit answers with a sentence"
    events = [orjson.loads(line) for line in get(gateway, f"/v1/runs/{run_id}/events").splitlines()]
    started = [e for e in events if e["type"] == "tool_start"]
    assert started, f"the gateway executed no tool call of the model: {events}"
    assert all(e["runId"] == run_id and e["toolName"] in {"list_files", "read_file", "delete_file", "scan_archive"}
               for e in started)
    assert any(e["type"] == "tool_result" for e in events)
    for repaired in (e for e in events if e["type"] == "tool_call_repaired"):
        assert repaired["upstream"] == "local" and repaired["detail"]
    assert all(t["completion_tokens"] <= CAP for t in run["per_turn"])
    stopped = [e for e in events if e["type"] == "run_stopped"]
    assert run["status"] in EXITS and [e["status"] for e in stopped][-1:] == [run["status"]]
    assert raw.headers["x-run-status"] == run["status"]
    assert 1 <= run["turns"] <= MAX_TURNS
    assert run["usage"]["prompt_tokens"] > 100  # system prompt, task and the four tool schemas
    assert run["usage"]["completion_tokens"] > 0
    expected = (run["usage"]["prompt_tokens"] * PRICE_IN + run["usage"]["completion_tokens"] * PRICE_OUT) / 1e6
    assert run["cost_usd"] > 0 and run["cost_usd"] == pytest.approx(expected, rel=1e-6)
    assert sum(t["prompt_tokens"] for t in run["per_turn"]) == run["usage"]["prompt_tokens"]


def test_a_streamed_call_of_the_local_model_arrives_whole_and_repaired(gateway: Proc, local_model: LocalModel) -> None:
    """Pass-through, streamed, tools offered: whatever the model writes, the client's stream ends
    normally (no llama.cpp parse error in it) and any tool call in it is a known tool with JSON
    object arguments; the booked turn is what the client assembled."""
    run_id = f"stream-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_S + 60,
                           default_headers={"X-Run-Id": run_id, "X-Policy": "passthrough"})
    tools: Any = [t.openai() for t in FILE_TOOLS]
    stream = client.chat.completions.create(
        model=local_model.model, stream=True, tools=tools, temperature=0, seed=0,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PLAN_TASK}])
    content, calls, finish = "", {}, None
    for chunk in stream:  # an error event in the stream would raise here
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, ["", ""])
                call[0] += (part.function.name or "") if part.function else ""
                call[1] += (part.function.arguments or "") if part.function else ""
            finish = choice.finish_reason or finish
    assert finish in {"stop", "tool_calls", "length"}
    assert content or calls
    for name, arguments in calls.values():
        assert name in {t["function"]["name"] for t in tools} and isinstance(orjson.loads(arguments), dict)
    run = orjson.loads(get(gateway, f"/v1/runs/{run_id}"))
    assert run["turns"] == 1 and run["status"] != "failed"
    booked = run["transcript"][-1]
    assert [c["function"]["name"] for c in booked.get("tool_calls") or []] == [n for n, _ in calls.values()]
