"""Real HTTP upstreams served by the test process itself, on loopback.

`serving(handler)` runs on the test's own event loop (an async context manager: the upstream
lives as long as one test). `in_thread(app)` serves an aiohttp app on an event loop of its
own thread (a plain context manager), so one upstream can outlive a test's event loop and be
shared by the tests of a module through a module-scoped fixture. State a handler keeps (call
counters, delays) is then read and written from both threads: keep it to plain dicts and
counters, and do not share asyncio objects (events, futures) across the two loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import orjson
from aiohttp import web

from tests.support.procs import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def never_answering(seen: list[object], release: asyncio.Event) -> Handler:
    """A handler that notes "hang started" in `seen` and answers only once `release` is set:
    an http tool's server that never answers (until the test lets it)."""

    async def hang(request: web.Request) -> web.Response:
        seen.append("hang started")
        await release.wait()
        return web.Response(text="late")

    return hang


async def responses_stream(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    """A Responses-API upstream's stream: each event typed and numbered, as OpenAI sends them."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for n, event in enumerate(events):
        await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                             + orjson.dumps({**event, "sequence_number": n}) + b"\n\n")
    await response.write_eof()
    return response


def response_of(output: list[dict[str, Any]], usage: tuple[int, int], model: str,
                **fields: Any) -> dict[str, Any]:
    """A Responses-API upstream's response object: `output`, `usage` (input, output tokens)
    and `model`, completed unless `fields` say otherwise (status, incomplete_details, id)."""
    given, made = usage
    return {"id": "resp_upstream", "object": "response", "created_at": 0, "status": "completed", "model": model,
            "output": output, "usage": {"input_tokens": given, "output_tokens": made, "total_tokens": given + made,
                                        "input_tokens_details": {"cached_tokens": 0},
                                        "output_tokens_details": {"reasoning_tokens": 0}}, **fields}


def response_events(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The typed events of a stream that ends in `final`, as OpenAI sends them: created and
    in progress, each output item added, its text or arguments in deltas and done, then
    `response.completed` (or `response.incomplete`) with the whole response."""
    start = {**final, "status": "in_progress", "output": [], "incomplete_details": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": start},
                                    {"type": "response.in_progress", "response": start}]
    for index, item in enumerate(final["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "content": [], "status": "in_progress"}})
            for part_index, part in enumerate(item["content"]):
                part_at = {**at, "content_index": part_index}
                text = part["text"]
                events.append({"type": "response.content_part.added", **part_at, "part": {**part, "text": ""}})
                events += [{"type": "response.output_text.delta", **part_at, "delta": d} for d in (text[:3], text[3:])]
                events += [{"type": "response.output_text.done", **part_at, "text": text},
                           {"type": "response.content_part.done", **part_at, "part": part}]
        else:
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    ended = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    return [*events, {"type": ended, "response": final}]


async def answer_response(request: web.Request, body: dict[str, Any], final: dict[str, Any]) -> web.StreamResponse:
    """A Responses-API upstream's answer: `final` as JSON, or streamed when `body` asks."""
    if not body.get("stream"):
        return web.json_response(final)
    return await responses_stream(request, response_events(final))


def chat_app(handler: Handler) -> web.Application:
    """An app answering `POST /v1/chat/completions` with `handler`."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


@contextlib.asynccontextmanager
async def serving_app(app: web.Application, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """`app` on a free loopback port of the running loop (over TLS with `ssl_context`);
    yields its root URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """A real HTTP upstream on loopback answering chat completions with `handler`; yields
    its base URL (`.../v1`)."""
    async with serving_app(chat_app(handler)) as root:
        yield root + "/v1"


@contextlib.contextmanager
def in_thread(make_app: Callable[[], web.Application], timeout: float = 30.0,
              ssl_context: ssl.SSLContext | None = None) -> Iterator[str]:
    """The app `make_app()` builds (on the thread's loop, as aiohttp wants), served on a free
    loopback port by a thread of its own (over TLS with `ssl_context`) until the block ends;
    yields its root URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-upstream", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()

    async def up() -> str:
        return await stack.enter_async_context(serving_app(make_app(), ssl_context))

    try:
        yield asyncio.run_coroutine_threadsafe(up(), loop).result(timeout)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            loop.close()
