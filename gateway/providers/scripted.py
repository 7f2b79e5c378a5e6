"""The scripted provider: a real chat-completions server whose model is a script.

`scripted_app()` serves `POST /chat/completions` and `GET /models` (mount it with
`add_subapp("/scripted/v1", scripted_app())`); `gateway scripted --port N` serves it alone
at `/v1` plus `GET /healthz`. The reply is `gateway.providers.scenarios` applied to the
transcript; usage is counted with gateway.tokens (prompt = the received messages and
tools, completion = the sent message), so every dollar in the chapter is arithmetic.

Request headers that shape the answer (for tests and benchmarks):
- `X-Scripted-Latency-Ms`: wait this long before answering (before the first byte of a
  stream); the app-level `latency_ms` is the default.
- `X-Scripted-Chunk-Delay-Ms`: wait this long between stream chunks.
  Both are at most `MAX_DELAY_MS` (60 s; more is a 400 naming the header), so no request
  keeps a handler asleep for long, and a server shutting down cuts the latency wait short.
- `X-Scripted-Reply`: the assistant message to answer with (JSON, at most `MAX_REPLY_BYTES`:
  `content` a string or null, `tool_calls` a list of function calls with string arguments)
  instead of the scenario's, streamed or not like any reply: a test replays a reply recorded
  from a real model this way (the gateway's tool-call repair is tested on them).
- `X-Scripted-Fail`: `500`, `429` (OpenAI-shaped errors; a 429 carries `retry-after` when
  `X-Scripted-Retry-After` (seconds) or the app's `retry_after_s` says so), `malformed` (a body
  that is not JSON), `hang` (no answer until the client gives up), `cut` (the connection drops
  halfway, without `[DONE]` and without usage), `cut-first` (a stream drops right after its
  first chunk; a plain answer as `cut`), `reset` (the connection is reset before any answer).

Failing per process (`gateway scripted --fail MODE [--fail-calls N/M] [--retry-after S]
[--latency-ms MS]`, or `scripted_app(fail=...)`): the same modes for calls that name none,
so two processes behind one gateway route can fail differently. `--fail-calls N/M` fails the
first N of every M chat calls this process serves (`1/2`: every other call, flapping); `N`
alone fails the first N and then heals. `--latency-ms` delays every answer's first byte.
`max_tokens` (or `max_completion_tokens`) is honoured: a reply that does not fit is cut to
fit and finishes with "length".
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.providers.scenarios import Reply, model_names, scenario_for, view_of
from gateway.tokens import TokenCounter, get_counter

FailMode = Literal["500", "429", "malformed", "hang", "cut", "cut-first", "reset"]
FAIL_MODES: tuple[FailMode, ...] = get_args(FailMode)
LATENCY_HEADER = "X-Scripted-Latency-Ms"
CHUNK_DELAY_HEADER = "X-Scripted-Chunk-Delay-Ms"
FAIL_HEADER = "X-Scripted-Fail"
RETRY_AFTER_HEADER = "X-Scripted-Retry-After"
REPLY_HEADER = "X-Scripted-Reply"
MAX_REPLY_BYTES = 8000  # under aiohttp's 8190-byte header line
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_DELAY_MS = 60_000.0
"""The most a request may ask the provider to wait (each X-Scripted-*-Ms header)."""


@dataclass(frozen=True)
class FailCalls:
    """Which of a process's calls fail: the first `fail` of every `every` (None: only the
    first `fail`, then never again)."""

    fail: int
    every: int | None = None

    def fails(self, index: int) -> bool:
        return index < self.fail if self.every is None else index % self.every < self.fail

    @classmethod
    def parse(cls, text: str) -> FailCalls:
        """`N` or `N/M` (0 <= N, 1 <= M); ValueError naming the form otherwise."""
        head, sep, tail = text.partition("/")
        try:
            fail, every = int(head), int(tail) if sep else None
        except ValueError:
            raise ValueError(f"expected N or N/M (e.g. 1/2), got {text!r}") from None
        if fail < 0 or (every is not None and every < 1):
            raise ValueError(f"expected N >= 0 and M >= 1, got {text!r}")
        return cls(fail, every)


@dataclass(frozen=True)
class ScriptedConfig:
    """App-level defaults (headers override them per request)."""

    latency_ms: float = 0.0
    chunk_delay_ms: float = 0.0
    fail: FailMode | None = None
    fail_calls: FailCalls | None = None  # None: every call fails (when `fail` is set)
    retry_after_s: float | None = None


class CallCount:
    """The chat calls this app has served (the `fail_calls` pattern counts them)."""

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value - 1


@dataclass(frozen=True)
class Ask:
    """A validated chat-completions request."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    reply: dict[str, Any] | None = None  # X-Scripted-Reply: the message to answer with


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


CONFIG_KEY = web.AppKey("scripted_config", ScriptedConfig)
CLOSING_KEY = web.AppKey("scripted_closing", asyncio.Event)
COUNTER_KEY = web.AppKey("scripted_counter", TokenCounter)
CALLS_KEY = web.AppKey("scripted_calls", CallCount)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
           headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(message, type_, code, param)),
                        content_type="application/json", headers=headers)


def _header_number(request: web.Request, name: str, most: float, unit: str) -> float | None:
    """A header's number from 0 to `most` (None when absent); a 400 naming it otherwise."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= most:  # also refuses NaN and infinities
        raise BadRequest(400, f"header {name} must be a number of {unit} from 0 to {most:.0f}, got {raw!r}", name)
    return value


def _ms_header(request: web.Request, name: str, default: float) -> float:
    value = _header_number(request, name, MAX_DELAY_MS, "milliseconds")
    return default if value is None else value


def _reply_header(request: web.Request) -> dict[str, Any] | None:
    """The X-Scripted-Reply message, checked (a 400 naming what is wrong), or None."""
    raw = request.headers.get(REPLY_HEADER)
    if raw is None:
        return None
    if len(raw) > MAX_REPLY_BYTES:
        raise BadRequest(400, f"header {REPLY_HEADER} is over {MAX_REPLY_BYTES} bytes", None)
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(400, f"header {REPLY_HEADER} is not JSON", None) from None
    if not isinstance(message, dict) or not isinstance(message.get("content"), (str, type(None))):
        raise BadRequest(400, f"header {REPLY_HEADER} must be an object whose content is a string or null", None)
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), str) for c in calls)):
        raise BadRequest(400, f"header {REPLY_HEADER}: tool_calls must be function calls with a name and string "
                         "arguments", None)
    out = {"role": "assistant", "content": message.get("content")}
    if calls:
        out["tool_calls"] = [{"id": str(c.get("id") or f"call_{i}"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                             for i, c in enumerate(calls)]
    return out


def _parse(body: bytes, reply: dict[str, Any] | None = None) -> Ask:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(data, dict):
        raise BadRequest(400, "request body must be a JSON object", None)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "'model' is required and must be a string", "model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' is required and must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    tools = data.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest(400, "'tools' must be an array of objects", "tools")
    limits: list[int] = []
    for key in ("max_tokens", "max_completion_tokens"):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(400, f"'{key}' must be an integer >= 1, got {value!r}", key)
        limits.append(value)
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest(400, "'stream_options' must be an object", "stream_options")
    if scenario_for(model) is None:
        raise BadRequest(404, f"The model '{model}' does not exist. Scripted models: {', '.join(model_names())}",
                         "model", "model_not_found")
    return Ask(model, messages, tools or None, bool(data.get("stream")), bool(options.get("include_usage")),
               min(limits, default=None), reply)


def fit(message: dict[str, Any], finish: str, max_tokens: int,
        counter: TokenCounter) -> tuple[dict[str, Any], str]:
    """Cut a reply to at most `max_tokens` completion tokens, as a provider does at the limit.

    Text is cut token-wise; tool calls are kept while they fit, the first that does not is
    kept with its arguments cut short (or dropped if even its name does not fit). A reply
    that had to be cut finishes with "length".
    """
    if counter.count_completion(message) <= max_tokens:
        return message, finish
    calls: list[dict[str, Any]] = message.get("tool_calls") or []
    if not calls:
        tokens = counter.encoding.encode_ordinary(message.get("content") or "")
        keep = min(len(tokens), max_tokens - counter.count_completion({"content": ""}))
        while keep > 0:
            cut = {"role": "assistant", "content": counter.encoding.decode(tokens[:keep])}
            if counter.count_completion(cut) <= max_tokens:
                return cut, "length"
            keep -= 1  # a cut inside a character can re-encode longer
        return {"role": "assistant", "content": ""}, "length"

    def with_calls(kept: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": kept}

    def shortened(call: dict[str, Any], length: int) -> dict[str, Any]:
        fn = call["function"]
        return {**call, "function": {**fn, "arguments": fn["arguments"][:length]}}

    def fits(kept: list[dict[str, Any]]) -> bool:
        return counter.count_completion(with_calls(kept)) <= max_tokens

    kept: list[dict[str, Any]] = []
    for call in calls:
        if fits([*kept, call]):
            kept.append(call)
            continue
        if fits([*kept, shortened(call, 0)]):
            lo, hi = 0, len(call["function"]["arguments"])
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits([*kept, shortened(call, mid)]) else (lo, mid - 1)
            kept.append(shortened(call, lo))
        break
    if kept:
        return with_calls(kept), "length"
    return {"role": "assistant", "content": ""}, "length"


def build_reply(ask: Ask, counter: TokenCounter) -> tuple[dict[str, Any], str, dict[str, int]]:
    """The assistant message, its finish reason and usage for a validated request."""
    scenario = scenario_for(ask.model)
    assert scenario is not None  # _parse refused unknown models
    reply = scenario(view_of(ask.messages)) if ask.reply is None else Reply(raw=ask.reply)
    message = reply.message()
    finish = "tool_calls" if reply.calls or (reply.raw is not None and reply.raw.get("tool_calls")) else "stop"
    if ask.max_tokens is not None and (reply.raw is None or ask.reply is not None):
        message, finish = fit(message, finish, ask.max_tokens, counter)
    prompt = counter.count_request(ask.messages, ask.tools)
    try:
        completion = counter.count_completion(message)
    except (AttributeError, TypeError):  # a deliberately malformed reply: count its JSON
        completion = counter.count_text(orjson.dumps(message).decode())
    return message, finish, {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}


def completion_body(ask: Ask, message: dict[str, Any], finish: str, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-scripted-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ask.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }


def _pieces(text: str, n: int) -> list[str]:
    """`text` in up to n non-empty consecutive pieces (that join back to it)."""
    if not text:
        return []
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream_chunks(ask: Ask, message: dict[str, Any], finish: str, usage: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The chat.completion.chunk objects of a streamed reply, in order."""
    base = {"id": f"chatcmpl-scripted-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": ask.model}
    extra: dict[str, Any] = {"usage": None} if ask.include_usage else {}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                **extra}

    calls = message.get("tool_calls") or []
    content = message.get("content")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):  # malformed on purpose
        yield chunk(dict(message))
        yield chunk({}, finish)
        if ask.include_usage:
            yield {**base, "choices": [], "usage": usage}
        return
    yield chunk({"role": "assistant", "content": None if calls and not content else ""})
    for piece in _pieces(content or "", 4):
        yield chunk({"content": piece})
    for index, call in enumerate(calls):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": index, "id": call.get("id"), "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _pieces(fn["arguments"], 3):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    yield chunk({}, finish)
    if ask.include_usage:
        yield {**base, "choices": [], "usage": usage}


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _hang(request: web.Request) -> web.StreamResponse:
    """Answer nothing until the client goes away (or the server shuts down)."""
    closing = request.app[CLOSING_KEY]
    while not closing.is_set():
        transport = request.transport
        if transport is None or transport.is_closing():
            break
        try:
            # Poll the socket: aiohttp does not cancel handlers when the client leaves.
            await asyncio.wait_for(closing.wait(), timeout=0.02)
        except TimeoutError:
            continue
    return web.Response(status=204)


def _drop(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def _answer_json(request: web.Request, ask: Ask, fail: FailMode | None, counter: TokenCounter) -> web.StreamResponse:
    message, finish, usage = build_reply(ask, counter)
    body = orjson.dumps(completion_body(ask, message, finish, usage))
    if fail == "malformed":
        return web.Response(body=body[: len(body) // 2] + b"<<not json", content_type="application/json")
    if fail in ("cut", "cut-first"):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        _drop(request)
        return resp
    return web.Response(body=body, content_type="application/json")


async def _answer_stream(request: web.Request, ask: Ask, fail: FailMode | None, counter: TokenCounter,
                         delay_s: float) -> web.StreamResponse:
    message, finish, usage = build_reply(ask, counter)
    chunks = list(stream_chunks(ask, message, finish, usage))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    if fail == "cut":
        chunks = chunks[: max(1, len(chunks) // 2)]
    elif fail == "cut-first":
        chunks = chunks[:1]
    for i, obj in enumerate(chunks):
        if i and delay_s:
            await asyncio.sleep(delay_s)
        await resp.write(b"data: {not json\n\n" if fail == "malformed" and i == 1 else _sse(obj))
    if fail in ("cut", "cut-first"):
        _drop(request)
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /chat/completions."""
    config = request.app[CONFIG_KEY]
    try:
        latency_ms = _ms_header(request, LATENCY_HEADER, config.latency_ms)
        delay_ms = _ms_header(request, CHUNK_DELAY_HEADER, config.chunk_delay_ms)
        raw_fail = request.headers.get(FAIL_HEADER)
        if raw_fail is not None and raw_fail not in FAIL_MODES:
            raise BadRequest(400, f"header {FAIL_HEADER} must be one of {', '.join(FAIL_MODES)}, got {raw_fail!r}", None)
        fail = next((m for m in FAIL_MODES if m == raw_fail), None)
        retry_after = _header_number(request, RETRY_AFTER_HEADER, MAX_DELAY_MS / 1000, "seconds")
        retry_after = config.retry_after_s if retry_after is None else retry_after
        ask = _parse(await request.read(), _reply_header(request))
    except BadRequest as exc:
        type_ = "invalid_request_error"
        return _error(exc.status, exc.message, type_, exc.code, exc.param)
    index = request.app[CALLS_KEY].next()
    if fail is None and config.fail is not None and (config.fail_calls is None or config.fail_calls.fails(index)):
        fail = config.fail
    if fail == "reset":
        _drop(request)
        return web.Response(status=204)  # never sent: the connection is gone
    if fail == "hang":
        return await _hang(request)
    if latency_ms:
        try:  # the wait is the latency asked for; shutdown ends it early
            await asyncio.wait_for(request.app[CLOSING_KEY].wait(), timeout=latency_ms / 1000)
        except TimeoutError:
            pass
    if fail == "500":
        return _error(500, f"The scripted upstream failed on purpose ({FAIL_HEADER}: 500).", "server_error",
                      "internal_error")
    if fail == "429":
        return _error(429, f"Rate limit reached for {ask.model} ({FAIL_HEADER}: 429).", "requests",
                      "rate_limit_exceeded", headers=None if retry_after is None else {"retry-after": f"{retry_after:g}"})
    counter = request.app[COUNTER_KEY]
    if ask.stream:
        return await _answer_stream(request, ask, fail, counter, delay_ms / 1000)
    return await _answer_json(request, ask, fail, counter)


async def list_models(request: web.Request) -> web.Response:
    """GET /models."""
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "scripted"} for name in model_names()]
    return web.json_response({"object": "list", "data": data}, dumps=lambda o: orjson.dumps(o).decode())


async def get_model(request: web.Request) -> web.Response:
    """GET /models/{model}."""
    name = request.match_info["model"]
    if scenario_for(name) is None:
        return _error(404, f"The model '{name}' does not exist.", "invalid_request_error", "model_not_found", "model")
    return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "scripted"})


EMBEDDING_DIMENSIONS = 8


async def embeddings(request: web.Request) -> web.Response:
    """POST /embeddings: a deterministic vector per input text (from its sha256), with usage
    counted by o200k_base, so that a test knows what the call must cost."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "body is not JSON", "invalid_request_error", "invalid_json")
    texts = body.get("input") if isinstance(body, dict) else None
    if isinstance(texts, str) or (isinstance(texts, list) and texts and all(isinstance(t, int) for t in texts)):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, (str, list)) for t in texts):
        return _error(400, "input must be a string, an array of strings or an array of token arrays",
                      "invalid_request_error", "invalid_value", "input")
    counter = request.app[COUNTER_KEY]
    data = []
    tokens = 0
    for i, text in enumerate(texts):
        digest = hashlib.sha256(orjson.dumps(text)).digest()
        data.append({"object": "embedding", "index": i,
                     "embedding": [b / 255 - 0.5 for b in digest[:EMBEDDING_DIMENSIONS]]})
        tokens += counter.count_text(text) if isinstance(text, str) else len(text)
    return web.json_response({"object": "list", "data": data, "model": body.get("model"),
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                             dumps=lambda o: orjson.dumps(o).decode())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes and methods answer in the OpenAI error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{request.method} {request.path}: {exc.reason}", "invalid_request_error",
                      exc.reason.lower().replace(" ", "_"))


def scripted_app(*, latency_ms: float = 0.0, chunk_delay_ms: float = 0.0, guard: Middleware | None = None,
                 fail: FailMode | None = None, fail_calls: FailCalls | None = None,
                 retry_after_s: float | None = None) -> web.Application:
    """The provider as an aiohttp app with routes `/chat/completions`, `/models` and `/embeddings`.

    `guard` runs before every route (the gateway's mount checks keys with it); without
    one the app is open, as `gateway scripted` serves it: a test upstream started on purpose.
    """
    middlewares: list[Middleware] = [json_errors] if guard is None else [json_errors, guard]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = ScriptedConfig(latency_ms, chunk_delay_ms, fail, fail_calls, retry_after_s)
    app[CALLS_KEY] = CallCount()
    app[CLOSING_KEY] = asyncio.Event()
    app[COUNTER_KEY] = get_counter()

    async def closing(app: web.Application) -> None:
        app[CLOSING_KEY].set()

    app.on_shutdown.append(closing)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/models", list_models)
    app.router.add_get("/models/{model}", get_model)
    app.router.add_post("/embeddings", embeddings)
    return app


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def standalone_app(*, latency_ms: float = 0.0, fail: FailMode | None = None, fail_calls: FailCalls | None = None,
                   retry_after_s: float | None = None) -> web.Application:
    """The provider alone: `/v1/...` plus `GET /healthz` (what `gateway scripted` serves)."""
    root = web.Application(client_max_size=MAX_BODY_BYTES)
    root.router.add_get("/healthz", healthz)
    root.add_subapp("/v1", scripted_app(latency_ms=latency_ms, fail=fail, fail_calls=fail_calls,
                                        retry_after_s=retry_after_s))
    return root


def _usage(problem: str) -> int:
    print(f"gateway scripted: {problem}", file=sys.stderr)
    return 2


def scripted_command(args: argparse.Namespace) -> int:
    """`gateway scripted --host H --port P [failure flags]`: serve the provider until interrupted."""
    host, port = str(args.host), int(args.port)
    fail = next((m for m in FAIL_MODES if m == args.fail), None)
    if args.fail is not None and fail is None:
        return _usage(f"--fail must be one of {', '.join(FAIL_MODES)}, got {args.fail!r}")
    try:
        fail_calls = FailCalls.parse(args.fail_calls) if args.fail_calls is not None else None
    except ValueError as exc:
        return _usage(f"--fail-calls: {exc}")
    latency, retry_after = float(args.latency_ms), args.retry_after
    if not 0 <= latency <= MAX_DELAY_MS:
        return _usage(f"--latency-ms must be from 0 to {MAX_DELAY_MS:.0f}")
    if retry_after is not None and not 0 <= retry_after <= MAX_DELAY_MS / 1000:
        return _usage(f"--retry-after must be from 0 to {MAX_DELAY_MS / 1000:.0f} seconds")
    print(f"scripted provider on http://{host}:{port}/v1 (models: {', '.join(model_names())})", flush=True)
    app = standalone_app(latency_ms=latency, fail=fail, fail_calls=fail_calls, retry_after_s=retry_after)
    web.run_app(app, host=host, port=port, print=None, access_log=None)
    return 0
