"""The OpenAI SDK against a real `python -m gateway serve` process (SQLite store on disk).

The client runs the chapter's plan task in its own loop, executing the file tools
locally; the gateway keys every call to the run named by a fixed X-Run-Id header.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.harness.state import scoped_run_id
from gateway.harness.usage import Price, Usage
from gateway.providers.scenarios import PLAN_ANSWER
from gateway.providers.scripted import scripted_app
from gateway.store import open_store
from gateway.tools.catalog import FILE_TOOLS
from gateway.tools.files import Sandbox, fresh_sandbox
from tests.server.conftest import KEY, config_data, plan_start, run_tools_locally, write_config
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import in_thread

TOOLS = [t.openai() for t in FILE_TOOLS]
PRICE = Price(2.0, 12.0)


def serve(folder: Path, data: dict[str, Any]) -> Proc:
    port = free_port()
    data["server"] = {"host": "127.0.0.1", "port": port}
    path = write_config(folder, data)
    return start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log",
                         timeout=START_TIMEOUT_S)


@dataclass
class Counted:
    """The scripted provider at /v1 of a server of the test process, recording every chat call's body."""

    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.endswith("/chat/completions"):
                self.bodies.append(orjson.loads(await request.read()))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.add_subapp("/v1", scripted_app())
        return app

    def calls(self, model: str) -> int:
        return sum(1 for body in self.bodies if body["model"] == model)


@pytest.fixture(scope="module")
def counted() -> Iterator[tuple[Counted, str]]:
    """One counting upstream for the module: (its record, its base URL)."""
    record = Counted()
    with in_thread(record.app) as root:
        yield record, root + "/v1"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, counted: tuple[Counted, str]) -> Iterator[Proc]:
    """One gateway for the module's tests (each its own run ids), every model routed to the
    counting upstream; its database is next to its log."""
    upstream = {"name": "counted", "base_url": counted[1], "timeout_s": 5}
    proc = serve(tmp_path_factory.mktemp("sdk") / "gw", config_data(
        upstreams=[upstream], models=[{"match": "*", "upstream": "counted", "price_in": 2.0, "price_out": 12.0}]))
    yield proc
    proc.stop()


def client(proc: Proc, run_id: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, default_headers={"X-Run-Id": run_id, **headers},
                         max_retries=2)


def reassemble(stream: Any) -> tuple[dict[str, Any], Usage | None]:
    """The assistant message and usage of a streamed answer, as a client rebuilds them."""
    content, calls, usage = [], {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = Usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["id"] = part.id or call["id"]
                if part.function and part.function.name:
                    call["function"]["name"] += part.function.name
                if part.function and part.function.arguments:
                    call["function"]["arguments"] += part.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_client_runs_the_plan_task(gateway: Proc, tmp_path: Path, stream: bool) -> None:
    sandbox = Sandbox(fresh_sandbox(tmp_path / "sandbox"))
    run_id = f"sdk-{'stream' if stream else 'json'}"
    sdk = client(gateway, run_id)
    messages = plan_start()
    turns, costs, usages = [], [], []
    for _ in range(6):
        if stream:
            raw = await asyncio.to_thread(sdk.chat.completions.with_raw_response.create, model="scripted-plan",
                                          messages=messages, tools=TOOLS, stream=True,
                                          stream_options={"include_usage": True})
            message, usage = await asyncio.to_thread(reassemble, raw.parse())
            assert usage is not None
        else:
            raw = await asyncio.to_thread(sdk.chat.completions.with_raw_response.create, model="scripted-plan",
                                          messages=messages, tools=TOOLS)
            completion = raw.parse()
            assert completion.model_extra is not None and completion.model_extra["run"]["id"] == run_id
            message = completion.choices[0].message.model_dump(exclude_none=True)
            message.setdefault("content", None)
            usage = Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens)  # type: ignore[union-attr]
        assert raw.headers["X-Run-Id"] == run_id
        turns.append(int(raw.headers["X-Run-Turns"]))
        costs.append(float(raw.headers["X-Run-Cost-Usd"]))
        usages.append(usage)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        messages.extend(await run_tools_locally(sandbox, message))
    assert messages[-1]["content"] == PLAN_ANSWER
    # headers grow: a stream's headers are the run as admitted (before its turn), a JSON answer's after it
    assert turns == ([0, 1, 2] if stream else [1, 2, 3])
    assert costs == sorted(costs) and len(set(costs)) == 3
    store = open_store({"kind": "sqlite", "path": str(gateway.log.parent / "gateway.db")})
    try:
        run = await store.load_run(scoped_run_id("t", run_id))
    finally:
        await store.close()
    assert run is not None and run.turns == 3 and run.status == "completed"
    assert run.per_turn == usages
    assert abs(run.cost_usd - sum(PRICE.cost(u) for u in usages)) < 1e-12
    if not stream:
        assert abs(costs[-1] - run.cost_usd) < 1e-9


def _requests_429(proc: Proc) -> float:
    import urllib.request

    text = urllib.request.urlopen(proc.url + "/metrics", timeout=5).read().decode()
    line = next((ln for ln in text.splitlines()
                 if ln.startswith("gateway_requests_total{") and 'code="429"' in ln
                 and 'route="/v1/chat/completions"' in ln), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


async def test_a_run_past_its_cap_gets_rate_limit_error_at_once_and_nothing_goes_upstream(
        gateway: Proc, counted: tuple[Counted, str]) -> None:
    upstream = counted[0]
    sdk = client(gateway, "sdk-cap", **{"X-Policy": "capped"})
    body = {"model": "scripted-runaway", "messages": [{"role": "user", "content": "go"}]}
    for _ in range(3):
        await asyncio.to_thread(sdk.chat.completions.create, **body)
    assert upstream.calls("scripted-runaway") == 3
    refused_before = await asyncio.to_thread(_requests_429, gateway)  # (none of the module's other tests is refused)
    with pytest.raises(openai.RateLimitError) as info:
        await asyncio.to_thread(sdk.chat.completions.create, **body)
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "max_turns_exceeded"
    payload = json.loads(info.value.response.text)
    assert payload["run"]["status"] == "max_turns_exceeded" and payload["run"]["turns"] == 3
    assert info.value.response.headers["x-should-retry"] == "false"
    assert upstream.calls("scripted-runaway") == 3  # nothing was forwarded
    # at once: the SDK (max_retries=2) did not retry, on x-should-retry: false
    assert await asyncio.to_thread(_requests_429, gateway) == refused_before + 1


def test_shipped_config_serves_on_a_fresh_folder(tmp_path: Path) -> None:
    """`gateway serve` with the shipped config shape (scripted upstream, SQLite) answers a call."""
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "config.yaml").read_text())
    data["policies_dir"] = str(Path(__file__).resolve().parents[2] / "policies")
    data["trace_file"] = None
    port = free_port()
    data["server"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    # A fresh interpreter, not the tests' zygote: the shipped way to start must work from nothing.
    proc = start_gateway(["serve", "--config", str(path)], "/healthz", port, tmp_path / "log", fresh=True)
    try:
        sdk = openai.OpenAI(base_url=proc.url + "/v1", api_key="sk-demo", max_retries=0)
        reply = sdk.chat.completions.create(model="scripted-plan", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.tool_calls
        assert {m.id for m in sdk.models.list()} >= {"scripted-plan", "scripted-runaway"}
    finally:
        proc.stop()
    assert (tmp_path / "gateway.db").exists()


def test_sighup_reloads_policies_for_new_runs(tmp_path: Path) -> None:
    import signal
    import urllib.error
    import urllib.request

    proc = serve(tmp_path / "gwh", config_data())
    try:
        def call(run_id: str) -> int:
            req = urllib.request.Request(proc.url + "/v1/chat/completions", method="POST",
                                         data=json.dumps({"model": "scripted-runaway",
                                                          "messages": [{"role": "user", "content": "go"}]}).encode(),
                                         headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id,
                                                  "X-Policy": "capped", "Content-Type": "application/json"})
            try:
                return int(urllib.request.urlopen(req, timeout=5).status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        assert [call("before") for _ in range(2)] == [200, 200]  # cap 3
        policy = tmp_path / "gwh" / "policies" / "capped.yaml"
        policy.write_text(yaml.safe_dump({"name": "capped", "limits": {"max_turns": 1}}))
        proc.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        n = 0
        while True:  # poll: the reload happens on the gateway's loop, soon after the signal
            n += 1
            if [call(f"after-{n}") for _ in range(2)] == [200, 429]:
                break
            assert time.monotonic() < deadline, proc.output()
        assert call("before") == 200  # the run started before keeps the version it started under
    finally:
        proc.stop()
