"""A client that leaves gives its `max_in_flight` slot back at once, streamed or not.

A real gateway process (SQLite) in front of a real upstream served by this test that
holds its answer (30 s) unless its connection is closed, and notes when it is. The team
has `rate_limits: {max_in_flight: 1}`. A client sends a call, and leaves once the upstream
has it (a non-streamed call: before any answer; a streamed one: after its first chunk).
Then:

- the team's next call is admitted while the left call's upstream would still be
  holding its answer (before the fix: 429 `in_flight` until the upstream answered);
- the upstream saw the gateway close that connection;
- the ledger holds what docs/limits.md says is booked: the prompt (counted with
  o200k_base) for a call whose answer never came, the prompt plus the completion text
  received for a stream; the run has that one turn, and no reservation is left.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.harness.usage import Price, Usage
from gateway.server.runs.replies import checked_usage
from gateway.store.sqlite import SqliteStore
from gateway.tokens import get_counter
from tests.server.served import poll
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway
from tests.support.upstreams import chat_app, in_thread

KEYS = {"json": "sk-narrow-json", "stream": "sk-narrow-stream", "embeddings": "sk-narrow-embeddings"}
"""One team per mode, each `max_in_flight: 1`: a test's slot is its own."""
PRICE = Price(2.0, 12.0)
HOLD_S = 30.0
"""How long the upstream holds an answer its client does not close first."""
ADMIT_WITHIN_S = 10.0
"""The next call must be admitted well before the upstream would have answered."""
TASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
FIRST_CHUNK = "Once upon a time, a keeper"


@dataclass
class Holding:
    """An upstream that holds `hang-*` answers until its client closes the connection."""

    url: str = ""
    arrived: Counter[str] = field(default_factory=Counter)
    closed: Counter[str] = field(default_factory=Counter)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body["model"]
        self.arrived[model] += 1
        if request.path.endswith("/embeddings") and not model.startswith("hang"):
            return web.json_response({"object": "list", "model": model, "usage": {"prompt_tokens": 5, "total_tokens": 5},
                                      "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}]})
        if not model.startswith("hang"):
            return web.json_response({
                "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}})
        response: web.StreamResponse | None = None
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": FIRST_CHUNK}}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                self.closed[model] += 1
                return response or web.Response(status=499)
            await asyncio.sleep(0.01)  # polling the connection: aiohttp tells a handler nothing
        if response is not None:
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({
            "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "late"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}})


@pytest.fixture(scope="module")
def upstream() -> Iterator[Holding]:
    state = Holding()
    def app() -> web.Application:
        made = chat_app(state.handle)
        made.router.add_post("/v1/embeddings", state.handle)
        return made

    with in_thread(app) as root:
        state.url = root + "/v1"
        yield state


@dataclass
class Gateway:
    proc: Proc
    folder: Path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstream: Holding) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("client_gone")
    policies = folder / "policies"
    policies.mkdir()
    (policies / "passthrough.yaml").write_text((ROOT / "policies" / "passthrough.yaml").read_text())
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "upstreams": [{"name": "holding", "base_url": upstream.url}],
        "models": [{"match": "*", "upstream": "holding", "price_in": PRICE.input_per_million,
                    "price_out": PRICE.output_per_million}],
        "teams": [{"name": f"narrow-{mode}", "keys": [key], "budget_usd": 10.0, "budget_period": "total",
                   "policies": ["passthrough"], "rate_limits": {"max_in_flight": 1}} for mode, key in KEYS.items()],
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                         folder / "gateway.log", timeout=START_TIMEOUT_S)
    try:
        yield Gateway(proc, folder)
    finally:
        proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        yield s


def headers(mode: str, run_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[mode]}", "X-Run-Id": run_id}


async def leave(session: aiohttp.ClientSession, gw: Gateway, upstream: Holding, mode: str, run_id: str) -> None:
    """Send a call and leave: a non-streamed one once the upstream has it, a streamed one
    after its first chunk (the connection closes; nothing waits for an answer)."""
    model, stream = f"hang-{mode}", mode == "stream"
    body = {"model": model, "messages": TASK, **({"stream": True} if stream else {})}
    path = "/v1/embeddings" if mode == "embeddings" else "/v1/chat/completions"
    if mode == "embeddings":
        body = {"model": model, "input": TASK[0]["content"]}
    got_first = asyncio.Event()

    async def call() -> None:
        async with session.post(f"{gw.proc.url}{path}", data=orjson.dumps(body),
                                headers=headers(mode, run_id)) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if FIRST_CHUNK.encode() in line:
                    got_first.set()
            raise AssertionError("the stream ended before the client left")

    task = asyncio.ensure_future(call())
    if stream:
        await asyncio.wait_for(got_first.wait(), ADMIT_WITHIN_S)
    else:
        await poll(lambda: _true(upstream.arrived[model] >= 1), timeout=ADMIT_WITHIN_S)
    task.cancel()  # aiohttp closes the connection of a request it gives up
    with pytest.raises(asyncio.CancelledError):
        await task


async def _true(value: bool) -> bool:
    return value


async def next_call_admitted(session: aiohttp.ClientSession, gw: Gateway, mode: str) -> dict[str, Any]:
    """The team's next call (its run object), retried while it is refused for max_in_flight."""
    path, sent = "/v1/chat/completions", {"model": "fast", "messages": TASK}
    if mode == "embeddings":
        path, sent = "/v1/embeddings", {"model": "fast", "input": "hello"}

    async def attempt() -> dict[str, Any] | None:
        async with session.post(f"{gw.proc.url}{path}", headers=headers(mode, f"next-{uuid.uuid4().hex[:6]}"),
                                data=orjson.dumps(sent)) as resp:
            body = await resp.json()
        if resp.status == 429 and body["error"]["type"] == "in_flight":
            return None
        assert resp.status == 200, body
        run: dict[str, Any] = body["run"]
        return run

    found: dict[str, Any] = await poll(attempt, timeout=ADMIT_WITHIN_S)
    return found


async def stored(gw: Gateway, mode: str, run_id: str) -> tuple[Any, float, float]:
    store = SqliteStore(gw.folder / "gateway.db")
    try:
        run = await store.load_run(f"narrow-{mode}/{run_id}")
        spent, reserved = await store.team_spend(f"narrow-{mode}", "total")
    finally:
        await store.close()
    return run, spent, reserved


@pytest.mark.parametrize("mode", list(KEYS))
async def test_a_client_that_leaves_frees_its_slot_and_its_upstream_call(
        gateway: Gateway, upstream: Holding, session: aiohttp.ClientSession, mode: str) -> None:
    run_id = f"gone-{mode}"
    await leave(session, gateway, upstream, mode, run_id)

    next_run = await next_call_admitted(session, gateway, mode)  # before the fix: 429 until the upstream answers
    await poll(lambda: _true(upstream.closed[f"hang-{mode}"] == 1), timeout=ADMIT_WITHIN_S)

    run, spent, reserved = await stored(gateway, mode, run_id)
    message = {"role": "assistant", "content": FIRST_CHUNK if mode == "stream" else None}
    usage = checked_usage(None, counter=get_counter(), messages=TASK, tools=None, replies=[message],  # type: ignore[list-item]
                          body_bytes=0, allowed_completion=None, n=1).usage
    if mode == "embeddings":  # not a turn: the input, counted, at the input price
        usage = Usage(usage.prompt_tokens, 0)
    assert run is not None and run.turns == (0 if mode == "embeddings" else 1), run
    assert (run.usage.prompt_tokens, run.usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert run.cost_usd == pytest.approx(PRICE.cost(usage))
    assert spent == pytest.approx(run.cost_usd + next_run["cost_usd"])
    assert reserved == 0
