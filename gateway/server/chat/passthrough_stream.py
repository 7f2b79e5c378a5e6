"""A streamed pass-through call: upstream SSE events go to the client as they arrive.

Each event is forwarded with the bytes the upstream sent (tool_calls deltas included);
it is parsed once on the way to rebuild the reply for the transcript and to find the
usage. The upstream is always asked for `stream_options.include_usage`; the usage-only
chunk is dropped if the client did not ask for it. Without usage, both sides are counted
with o200k_base. The turn is booked before `data: [DONE]`, preceded by an SSE comment
`: run {...}` with the run's figures (OpenAI clients skip comments).

A stream the upstream cuts (or that stalls past the timeout) is charged for what was
received and ends with an OpenAI-shaped `data: {"error": ...}` event, without [DONE]; a
client that goes away is charged the same way. Nothing received: nothing is charged.
A turn the store cannot take once the stream is open is spooled (booked when the store is
back) and the stream ends as usual; a refusal about the run itself (deleted, changed
elsewhere) ends it with that error event instead of [DONE].

What the client is sent is the `Outlet`'s business: `ChatOutlet` passes the upstream's
bytes on; the Responses API's outlet translates them (the governance is the same).

An upstream with `tool_repair` has the tool calls of its streams repaired before the turn
is booked (`stream_repair`): the events that may need it are held and the repaired reply's
rest is sent in their place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson
from aiohttp import web

from gateway.config.upstreams import Endpoint
from gateway.harness.state import Message
from gateway.harness.usage import Usage
from gateway.providers.errors import UpstreamError
from gateway.providers.failover import RoutedCall
from gateway.providers.repair import Repair
from gateway.server import context as ctx
from gateway.server.chat.stream_repair import StreamRepair
from gateway.server.http.errors import ApiError, from_store_error, upstream_failed
from gateway.server.http.headers import run_headers
from gateway.server.runs.booking import Booked, book_turn
from gateway.server.runs.forwarding import Body, open_stream
from gateway.server.runs.governor import Admission
from gateway.server.runs.keying import Call
from gateway.server.runs.replies import usage_of
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EventKind = Literal["chunk", "usage_only", "done", "error", "malformed", "other"]


class Reassembly:
    """The reply rebuilt from chunk deltas (choice 0), its finish reason and usage."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.chunks = 0
        self.last: dict[str, Any] | None = None  # the chunk fed last (an outlet may translate it)

    def feed(self, event: bytes) -> EventKind:
        data = event_data(event)
        if data is None:
            return "other"
        if data == b"[DONE]":
            return "done"
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "malformed"
        if not isinstance(chunk, dict):
            return "malformed"
        self.last = chunk
        if "error" in chunk and "choices" not in chunk:
            return "error"
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage_of(usage) or self.usage
        choices = chunk.get("choices")
        if not choices:
            return "usage_only" if isinstance(usage, dict) else "other"
        self.chunks += 1
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)
        return "chunk"

    def _choice(self, choice: Mapping[str, Any]) -> None:
        # The chunk was forwarded as it came (the client judges it); only well-typed
        # parts are kept for the transcript and the count, so a malformed one never crashes the booking.
        if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
            self.finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        parts = delta.get("tool_calls")
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            if isinstance(index, bool) or not isinstance(index, int):
                continue
            call = self.calls.setdefault(index,
                                         {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            if isinstance(part.get("id"), str) and part["id"]:
                call["id"] = part["id"]
            function = part.get("function")
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("name"), str):
                call["function"]["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                call["function"]["arguments"] += function["arguments"]

    def message(self) -> Message:
        out: Message = {"role": "assistant", "content": "".join(self.content) if self.content else None}
        if self.calls:
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return out


def event_data(event: bytes) -> bytes | None:
    """The data of one SSE event (data lines joined), or None if it has none."""
    lines = [line[5:].lstrip(b" ").rstrip(b"\r") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


class ChatOutlet:
    """What a streamed chat-completions client is sent: the upstream's events as they came."""

    def __init__(self, include_usage: bool) -> None:
        self.include_usage = include_usage

    def start(self) -> bytes:
        """Written as soon as the upstream answered, before its first event."""
        return b""

    def event(self, kind: EventKind, raw: bytes, chunk: dict[str, Any] | None) -> bytes:
        """What to write for one upstream event: its bytes and, when it is JSON, its object."""
        if kind == "usage_only" and not self.include_usage:
            return b""
        return raw

    async def end(self, booked: Booked | None, got: Reassembly, finish: str, run: dict[str, Any]) -> bytes:
        """Written once the turn is booked."""
        return b": run " + orjson.dumps(run) + b"\n\ndata: [DONE]\n\n"

    def failed(self, error: dict[str, Any]) -> bytes:
        """Written when the upstream failed mid-stream (the received part is booked)."""
        return b"data: " + orjson.dumps(error) + b"\n\n"


async def stream_through(request: web.Request, call: Call, adm: Admission, routed: RoutedCall, body: Body,
                         client_headers: Mapping[str, str], outlet: ChatOutlet | None = None,
                         got: Reassembly | None = None, endpoint: Endpoint = "chat") -> web.StreamResponse:
    """Forward a streamed call; see the module docstring for what happens on failures.
    `got` reads the upstream's events (a subclass reads another wire), `endpoint` is the
    upstream API they are asked of (chat, or responses for a native Responses upstream). The client's response starts with the upstream's first event: until
    then a failure is retried on the route (`RoutedCall.stream`), never after."""
    out = outlet or ChatOutlet(call.chat.include_usage)
    app = request.app
    metrics = app[ctx.METRICS]
    started = time.perf_counter()
    got = got or Reassembly()
    repair: StreamRepair | None = None
    response: web.StreamResponse | None = None
    failure: UpstreamError | None = None
    client_gone = False
    upstream_name = call.route.upstream
    try:
        async with open_stream(routed, body, client_headers, endpoint) as opened:
            upstream_name = opened.answer.upstream.name
            repair = StreamRepair.of(opened.answer.upstream, call.chat.tools, call.chat.n)
            metrics.on_ttft(upstream_name, call.chat.model, time.perf_counter() - started)
            start_headers = run_headers(call.run)
            start_headers["X-Run-Status"] = "running"
            response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **start_headers})
            await response.prepare(request)
            head = out.start()
            if head:
                await response.write(head)
            async for event in opened.events():
                kind = got.feed(event)
                if kind == "done":
                    break
                if kind == "malformed":  # never passed on: the client's parser would choke on it
                    failure = UpstreamError("upstream_malformed", f"upstream '{upstream_name}' sent a "
                                            f"chunk that is not JSON: {event[:80]!r}", upstream_name, 200)
                    opened.outcome = "malformed"
                    break
                data = repair.pass_on(kind, event, got, out) if repair is not None else out.event(kind, event, got.last)
                try:
                    if data:
                        await response.write(data)
                except (ConnectionError, RuntimeError):
                    client_gone = True
                    break
                if kind == "error" and (repair is None or repair.parse_error is None):  # not dropped by the repair
                    failure = UpstreamError("upstream_error", f"upstream '{upstream_name}' sent an error "
                                            "in the stream", upstream_name, 200)
                    opened.outcome = "malformed"
                    break
    except UpstreamError as exc:
        if response is None:  # nothing sent yet: an ordinary error answer (the admission releases)
            raise
        failure = exc
    except BaseException:  # cancelled: by a client that left (aiohttp may cancel the handler) or a shutdown
        transport = request.transport
        gone = transport is None or transport.is_closing()
        await _charge_received(request, call, adm, got, "client_disconnected" if gone else "cancelled", routed)
        raise
    seconds = time.perf_counter() - started
    request[ctx.UPSTREAM_SECONDS] = seconds
    metrics.on_upstream(upstream_name, call.chat.model, seconds)
    assert response is not None
    if repair is not None and failure is None and not client_gone:
        repair.repair(got)
    finish = got.finish or ("client_disconnected" if client_gone else "cut" if failure else "stop")
    unbooked: ApiError | None = None
    try:
        booked = await _charge_received(request, call, adm, got, finish, routed,
                                        repair.repairs if repair is not None else ())
    except StoreError as exc:  # the stream is open: it ends with the store's error, not a cut
        log.warning("run %s: the streamed turn could not be saved: %s", call.run.run_id, exc)
        booked, unbooked = None, from_store_error(exc)
    if client_gone:
        return response
    try:
        if repair is not None:
            await response.write(repair.tail(out))
        if unbooked is not None:
            await response.write(b"data: " + orjson.dumps(unbooked.body()) + b"\n\n")
        elif failure is not None:
            if failure.upstream_status is None:  # it answered 200, then failed mid-stream
                failure.upstream_status = 200
            await response.write(out.failed(upstream_failed(failure).body()))
        else:
            summary = booked.run.summary() if booked is not None else call.run.summary()
            await response.write(await out.end(booked, got, finish, summary))
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return response


async def _charge_received(request: web.Request, call: Call, adm: Admission, got: Reassembly,
                           finish: str, routed: RoutedCall, repairs: Sequence[Repair] = ()) -> Booked | None:
    """Book what was received as the turn (counted if the upstream gave no usage), or release."""
    if got.chunks == 0 and got.usage is None:
        await request.app[ctx.GOVERNOR].release(adm)
        return None
    return await book_turn(request, call, adm, reported=got.usage, message=got.message(), finish=finish,
                           routed=routed, repairs=repairs)
