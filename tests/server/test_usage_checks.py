"""The usage an upstream reports is checked on every route that books, by one rule.

A real gateway process in front of a real HTTP upstream served by this test that lies:
it answers "ok" (or one embedding of "hello") and reports 10,000,000 tokens of prompt.
Chat completions (pass-through and server-side, streamed or not), the Responses API
(translated to chat, native `api: responses`, server-side) and embeddings (with a run and
without) each book the gateway's own count instead, write a `usage_clamped` trace line
(with a run) and count `gateway_usage_clamped_total{upstream, kind="prompt"}` once; the
team's $0.05 budget is never locked out by the lie.

And an upstream that ignores `max_tokens` (a strict run clamps it to 5; the upstream writes
some 3,000 tokens and says so) is booked at what it wrote, the gateway's count of the
reply, not at the 5 it was allowed: the money was spent upstream (docs/limits.md).
Embeddings honour a route's `deployments[].model`: the upstream is asked for that name.
"""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.harness.usage import Price, Usage
from gateway.tokens import get_counter
from tests.server.test_responses import load_run
from tests.support.procs import ROOT, Proc, free_port, start_gateway
from tests.support.upstreams import in_thread, responses_stream

KEY, WIDE = "sk-test", "sk-wide"
PRICE = Price(2.0, 12.0)
LIE = 10_000_000
ASKED = web.AppKey("asked", list)
LONG = " ".join(f"word{i}" for i in range(1500))
"""What the `verbose` model writes whatever `max_tokens` says: some 3,000 tokens."""


def _usage(body: dict[str, Any], text: str) -> dict[str, int]:
    counter = get_counter()
    if body["model"] == "verbose":  # honest: the prompt and what it really wrote, every choice
        prompt = counter.count_request(body["messages"])
        completion = int(body.get("n") or 1) * counter.count_completion({"content": text})
    else:
        prompt, completion = LIE, 1
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[ASKED].append(body["model"])
    text = LONG if body["model"] == "verbose" else "ok"
    usage, n = _usage(body, text), int(body.get("n") or 1)
    if not body.get("stream"):
        return web.json_response({"id": "chatcmpl-l", "object": "chat.completion", "created": 0,
                                  "model": body["model"], "usage": usage, "choices": [
                                      {"index": i, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "stop"} for i in range(n)]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    base = {"id": "chatcmpl-l", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
    chunks = [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": text}}]} for i in range(n)]
    chunks += [{**base, "choices": [{"index": i, "delta": {}, "finish_reason": "stop"} for i in range(n)]},
               {**base, "choices": [], "usage": usage}]
    for chunk in chunks:
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def responses(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[ASKED].append(body["model"])
    item = {"id": "msg_l", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "ok", "annotations": []}]}
    final = {"id": "resp_l", "object": "response", "created_at": 0, "status": "completed", "model": body["model"],
             "output": [item], "usage": {"input_tokens": LIE, "output_tokens": 1, "total_tokens": LIE + 1}}
    if not body.get("stream"):
        return web.json_response(final)
    return await responses_stream(request, [
        {"type": "response.created", "response": {**final, "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "ok"},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": final}])


async def embeddings(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[ASKED].append(body["model"])
    return web.json_response({"object": "list", "model": body["model"],
                              "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                              "usage": {"prompt_tokens": LIE, "total_tokens": LIE}})


def lying_app() -> web.Application:
    app = web.Application()
    app[ASKED] = []
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    return app


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, list[str]]]:
    """The lying upstream's base URL, and the model names it was asked for (in order)."""
    made: list[web.Application] = []

    def make() -> web.Application:
        made.append(lying_app())
        return made[0]

    with in_thread(make) as root:
        yield root + "/v1", made[0][ASKED]


@pytest.fixture(scope="module")
def gateway(upstream: tuple[str, list[str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder = tmp_path_factory.mktemp("usage") / "gw"
    policies = folder / "policies"
    policies.mkdir(parents=True)
    for path in (ROOT / "policies").glob("*.yaml"):
        shutil.copy(path, policies / path.name)
    (policies / "strict.yaml").write_text(yaml.safe_dump(
        {"name": "strict", "description": "strict", "limits": {"max_turns": None, "max_budget_usd": 1.0,
                                                               "budget_mode": "strict"}}))
    port = free_port()
    price = {"price_in": PRICE.input_per_million, "price_out": PRICE.output_per_million}
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": "./policies",
        "upstreams": [{"name": "liar", "base_url": upstream[0]},
                      {"name": "native-liar", "base_url": upstream[0], "api": "responses"}],
        "models": [{"match": "native-liar", "upstream": "native-liar", **price},
                   {"match": "emb-alias", "deployments": [{"upstream": "liar", "model": "emb-real"}], **price},
                   {"match": "*", "upstream": "liar", **price}],
        "teams": [{"name": "t", "keys": [KEY], "budget_usd": 0.05, "budget_period": "total",
                   "policies": ["passthrough", "files"]},
                  {"name": "wide", "keys": [WIDE], "budget_usd": None, "policies": ["strict"]}],
        "defaults": {"output_allowance_tokens": 256},  # holds well inside the $0.05
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                         folder / "gateway.log")
    yield proc
    proc.stop()


def sdk(proc: Proc, key: str = KEY, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0, default_headers=headers)


def scrape(proc: Proc) -> str:
    return urllib.request.urlopen(proc.url + "/metrics", timeout=10).read().decode()


def metric(text: str, line_prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix + " "))


def clamped(proc: Proc, upstream: str, kind: str = "prompt") -> float:
    return metric(scrape(proc), f'gateway_usage_clamped_total{{kind="{kind}",upstream="{upstream}"}}')


def trace(proc: Proc, run_id: str, key: str = KEY) -> list[dict[str, Any]]:
    request = urllib.request.Request(f"{proc.url}/v1/runs/{run_id}/events",
                                     headers={"Authorization": f"Bearer {key}"})
    raw = urllib.request.urlopen(request, timeout=10).read()
    return [orjson.loads(line) for line in raw.splitlines()]


async def chat_call(client: openai.AsyncOpenAI, model: str, stream: bool, **extra: Any) -> None:
    messages: Any = [{"role": "user", "content": "hello"}]
    if not stream:
        await client.chat.completions.create(model=model, messages=messages, **extra)
        return
    async for _ in await client.chat.completions.create(model=model, messages=messages, stream=True, **extra):
        pass


async def responses_call(client: openai.AsyncOpenAI, model: str, stream: bool) -> None:
    if not stream:
        await client.responses.create(model=model, input="hello")
        return
    async with client.responses.stream(model=model, input="hello") as events:
        async for _ in events:
            pass


ROUTES = [
    ("chat", "liar", "passthrough", False), ("chat", "liar", "passthrough", True),
    ("chat", "liar", "files", False), ("chat", "liar", "files", True),
    ("responses", "liar", "passthrough", False), ("responses", "liar", "passthrough", True),
    ("responses", "native-liar", "passthrough", False), ("responses", "native-liar", "passthrough", True),
    ("responses", "liar", "files", False),
    ("embeddings", "liar", "passthrough", False),
]


@pytest.mark.parametrize(("route", "model", "policy", "stream"), ROUTES,
                         ids=[f"{r}-{m}-{p}-{'stream' if s else 'plain'}" for r, m, p, s in ROUTES])
async def test_a_lying_upstream_is_booked_at_the_gateways_count(gateway: Proc, route: str, model: str,
                                                                policy: str, stream: bool) -> None:
    run_id = f"lie-{route}-{model}-{policy}-{int(stream)}"
    upstream = "native-liar" if model == "native-liar" else "liar"
    before = clamped(gateway, upstream)
    async with sdk(gateway, **{"X-Run-Id": run_id, "X-Policy": policy}) as client:
        if route == "chat":
            await chat_call(client, model, stream)
        elif route == "responses":
            await responses_call(client, model, stream)
        else:
            await client.embeddings.create(model=model, input="hello")
    run = await load_run(gateway, run_id)
    assert run is not None and run.usage.prompt_tokens < 1000, run and run.usage
    assert run.cost_usd < 0.01  # not the $20 the upstream claimed
    lines = [e for e in trace(gateway, run_id) if e["type"] == "usage_clamped"]
    assert len(lines) == 1, lines
    assert lines[0]["upstream"] == upstream and lines[0]["reported"]["prompt_tokens"] == LIE
    assert "prompt" in lines[0]["kinds"] and lines[0]["booked"]["prompt_tokens"] == run.usage.prompt_tokens
    assert clamped(gateway, upstream) - before == 1


async def test_lying_embeddings_without_a_run_leave_the_team_budget_whole(gateway: Proc) -> None:
    before = clamped(gateway, "liar")
    async with sdk(gateway) as client:
        result = await client.embeddings.create(model="emb-liar", input="hello")
        assert result.data[0].embedding == [0.5, 0.25]
        text = scrape(gateway)
        assert metric(text, 'gateway_usage_clamped_total{kind="prompt",upstream="liar"}') - before == 1
        spent = metric(text, 'gateway_team_spend_usd{team="t"}')
        assert 0 < spent < 0.01, spent  # the $0.05 team budget is not locked out by the lie
        again = await client.embeddings.create(model="emb-liar", input="hello")  # still admitted
        assert again.data


@pytest.mark.parametrize(("n", "stream"), [(1, False), (1, True), (2, False), (2, True)])
async def test_an_upstream_that_ignores_max_tokens_is_booked_for_what_it_wrote(gateway: Proc, n: int,
                                                                               stream: bool) -> None:
    """A strict run clamps the call to 5 tokens a choice; the upstream writes ~3,000 a choice
    and reports so. It was paid for that: it is booked (the gateway's count of every choice
    it received), not the 5 x n it was allowed."""
    run_id = f"verbose-{n}-{int(stream)}"
    async with sdk(gateway, WIDE, **{"X-Run-Id": run_id}) as client:
        await chat_call(client, "verbose", stream, max_tokens=5, n=n)
    written = n * get_counter().count_completion({"content": LONG})
    assert written > 2500 * n
    run = await load_run(gateway, run_id, team="wide")
    assert run.usage.completion_tokens == written, run.usage
    assert run.cost_usd == pytest.approx(PRICE.cost(Usage(run.usage.prompt_tokens, written)), abs=1e-9)
    assert not [e for e in trace(gateway, run_id, WIDE) if e["type"] == "usage_clamped"]  # it told the truth


async def test_embeddings_ask_the_upstream_for_the_deployments_model(gateway: Proc,
                                                                    upstream: tuple[str, list[str]]) -> None:
    asked = upstream[1]
    start = len(asked)
    async with sdk(gateway) as client:
        await client.embeddings.create(model="emb-alias", input="hello")
    assert asked[start:] == ["emb-real"]
