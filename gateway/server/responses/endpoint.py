"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the Responses API.

A Responses call is translated into a chat-completions call (`responses_wire`) and then
governed by the very code that governs chat completions: the same authentication, run
keying (`resolve_call`), admission (`admit`: turn cap, run and team budgets, strict
clamps), booking (`book_turn`), streaming (`stream_through`, with an outlet that emits
the typed Responses events), metrics and trace. Only the wire differs.

Responses are stored per team (`Store.put_response`) with the conversation they end and
the run they belong to. `previous_response_id` continues that conversation, and when the
client sends no `X-Run-Id` it also continues that run: the chain of responses is the run,
so its turn cap and budget hold for clients that know nothing of runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.harness.state import Message, assistant_message, public_run_id
from gateway.providers.failover import RoutedCall
from gateway.providers.repair import repair_message, tool_schemas
from gateway.server import context as ctx
from gateway.server.chat import server_side
from gateway.server.chat.answers import Answer
from gateway.server.chat.passthrough import awaiting_upstream, chat_body, complete_and_book, governed
from gateway.server.chat.passthrough_stream import stream_through
from gateway.server.chat.stream_events import ChatOutlet, EventKind, Reassembly
from gateway.server.http.chat_request import ChatRequest
from gateway.server.http.errors import InvalidField, NotFound
from gateway.server.http.headers import run_headers
from gateway.server.http.sse import ClientGone, SSEStream
from gateway.server.http.validation import read_body
from gateway.server.runs.forwarding import respond
from gateway.server.responses.wire import (
    ResponseEvents,
    ResponsesRequest,
    finish_of,
    input_items,
    item_references,
    load_body,
    message_of_output,
    new_response_id,
    output_items,
    parse_responses_body,
    response_object,
    response_of_item,
    status_of,
    usage_of_response,
)
from gateway.server.runs import continuations
from gateway.server.runs.booking import Booked, book_turn
from gateway.server.runs.driver import FromClient, StartKind
from gateway.server.runs.governor import Admission
from gateway.server.http.scope import call_user, require_model
from gateway.server.runs.keying import Call, resolve_call, run_id_from
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

ECHO_LOOKUPS = 4
"""Responses named by a replayed history that are looked up for its run, newest first (a
deleted one falls back to the one before; the bound keeps a long junk history cheap)."""




async def _stored(request: web.Request, response_id: str, param: str | None = None) -> dict[str, Any]:
    """The caller's team's stored response (404 for a missing one and another team's alike)."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    got = await app[ctx.STORE].get_response(response_id)
    record: dict[str, Any] | None = orjson.loads(got[1]) if got is not None and got[0] == team.name else None
    if record is None or "response" not in record:  # missing, another team's, or created with store: false
        raise NotFound(f"response '{response_id}' not found", code="response_not_found", param=param)
    return record


async def get_response(request: web.Request) -> web.Response:
    """A stored response, as it was answered."""
    record = await _stored(request, request.match_info["id"])
    return web.Response(body=orjson.dumps(record["response"]), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    """Forget a stored response (it can no longer be continued)."""
    response_id = request.match_info["id"]
    await _stored(request, response_id)
    await request.app[ctx.STORE].delete_response(response_id)
    return web.Response(body=orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True}),
                        content_type="application/json")


async def create_response(request: web.Request) -> web.StreamResponse:
    """The route handler: every refusal happens before anything is forwarded or stored."""
    app = request.app
    team = await app[ctx.KEYRING].authenticate(request)
    body = load_body(await read_body(request, app[ctx.LIVE].config.server.max_body_bytes))
    await _resolve_references(request, team.name, body)
    req = parse_responses_body(body)
    request[ctx.MODEL] = req.model
    route = app[ctx.LIVE].config.route(req.model)
    if route is None:
        raise NotFound(f"model '{req.model}' is not routed by this gateway (see GET /v1/models)",
                       code="model_not_found", param="model")
    require_model(team, req.model)
    user = call_user(team, body, request.headers)
    headers: CIMultiDict[str] = CIMultiDict(request.headers)
    earlier: list[Message] = []
    chained: str | None = None  # the run this response continues, when no X-Run-Id says
    if req.previous_response_id is not None:
        previous = await _stored(request, req.previous_response_id, "previous_response_id")
        earlier = list(previous["messages"])
        chained = public_run_id(str(previous["run_id"]))
    else:  # a client that replays a history this gateway answered goes on with its latest run
        for echoed in list(dict.fromkeys(reversed(req.echoed)))[:ECHO_LOOKUPS]:
            got = await app[ctx.STORE].get_response(echoed)
            if got is not None and got[0] == team.name:
                chained = public_run_id(str(orjson.loads(got[1])["run_id"]))
                break
    if chained is not None and run_id_from(request.headers) is None:  # the chain of responses is the run
        headers["X-Run-Id"] = chained
    messages = req.conversation(earlier)
    chat_body = req.chat_body(messages, stream=req.stream)
    chat = ChatRequest(orjson.dumps(chat_body), chat_body, req.model, messages, req.chat_tools(), req.stream, False,
                       req.max_output_tokens, "max_tokens")
    call = await resolve_call(app[ctx.STORE], app[ctx.POLICIES], team, headers, chat, route, user=user)
    request[ctx.RUN] = call.run
    if call.policy.server_side:
        return await _server_side(request, call, Exchange(req, earlier))
    return await _pass_through(request, call, Exchange(req, earlier))


async def _resolve_references(request: web.Request, team: str, body: dict[str, Any]) -> None:
    """Replace each `item_reference` of the input by the stored output item it names (Vercel's
    `ai` SDK sends its earlier assistant items so); an unknown id is a 400 naming the item."""
    stored: dict[str, dict[str, Any] | None] = {}
    for index, item_id in item_references(body):
        response_id = response_of_item(item_id)
        if response_id is not None and response_id not in stored:
            got = await request.app[ctx.STORE].get_response(response_id)
            stored[response_id] = orjson.loads(got[1]).get("response") if got is not None and got[0] == team else None
        response = stored.get(response_id) if response_id is not None else None
        found = next((o for o in (response or {}).get("output", ()) if o.get("id") == item_id), None)
        if found is None:
            raise InvalidField(f"input[{index}].id", f"input[{index}] references item '{item_id}', which is not an "
                               "output item of a response stored for this team", "invalid_value")
        body["input"][index] = dict(found)


class Exchange:
    """One response being made: the request, its id, and the conversation it continues."""

    def __init__(self, req: ResponsesRequest, earlier: list[Message]) -> None:
        self.req = req
        self.earlier = earlier
        self.id = new_response_id()
        self.created_at = float(int(time.time()))

    def response(self, message: Message, finish: str, booked: Booked) -> dict[str, Any]:
        status, incomplete = status_of(finish)
        return response_object(self.id, self.req, created_at=self.created_at, status=status,
                               output=output_items(self.id, message), usage=booked.usage, incomplete=incomplete)

    async def keep(self, request: web.Request, call: Call, response: dict[str, Any], message: Message) -> None:
        """Store the response with its conversation (instructions are not carried over). With
        `store: false` only its run is kept (no content), so that a client replaying its
        history still continues the run; it cannot be fetched or continued by id."""
        record: dict[str, Any] = {"run_id": call.run.public_id}  # responses are per team, as run ids
        if self.req.store:
            record.update(response=response, messages=[*self.earlier, *self.req.input, message])
        try:
            await request.app[ctx.STORE].put_response(self.id, call.team.name, orjson.dumps(record))
        except StoreError as exc:  # the turn is paid and booked: answer it, it just cannot be continued
            log.warning("cannot store response %s of run %s: %s", self.id, call.run.run_id, exc)


class ResponsesOutlet(ChatOutlet):
    """A streamed response: the upstream's chunks as typed Responses events."""

    def __init__(self, request: web.Request, call: Call, exchange: Exchange) -> None:
        super().__init__(include_usage=False)
        self.request = request
        self.call = call
        self.exchange = exchange
        self.events = ResponseEvents(exchange.id, exchange.req, exchange.created_at)

    def start(self) -> bytes:
        return self.events.start()

    def event(self, kind: EventKind, raw: bytes, chunk: dict[str, Any] | None) -> bytes:
        if kind == "chunk" and chunk is not None:
            return self.events.chunk(chunk)
        return b""

    async def end(self, booked: Booked | None, got: Reassembly, finish: str, run: dict[str, Any]) -> bytes:
        data, final = self.events.finish(finish, booked.usage if booked is not None else got.usage)
        await self.exchange.keep(self.request, self.call, final, got.message())
        return data

    def failed(self, error: dict[str, Any]) -> bytes:
        return self.events.failed(error.get("error") or {})


class NativeReassembly(Reassembly):
    """A native upstream's typed events read into the reply the run books (as chat chunks are)."""

    def feed(self, event: bytes) -> EventKind:
        parsed = self.decoded(event)
        if not isinstance(parsed, dict):
            return parsed
        kind = parsed.get("type")
        if kind == "response.output_text.delta":
            self.content.append(str(parsed.get("delta") or ""))
        elif kind == "response.output_item.added" and (parsed.get("item") or {}).get("type") == "function_call":
            item = parsed["item"]
            self.calls[int(parsed.get("output_index", 0))] = {
                "id": item.get("call_id") or "", "type": "function",
                "function": {"name": item.get("name") or "", "arguments": ""}}
        elif kind == "response.function_call_arguments.delta":
            call = self.calls.get(int(parsed.get("output_index", 0)))
            if call is not None:
                call["function"]["arguments"] += str(parsed.get("delta") or "")
        elif kind in ("response.completed", "response.incomplete"):
            response = parsed.get("response") or {}
            self.usage = usage_of_response(response.get("usage")) or self.usage
            self.finish = finish_of(response, bool(self.calls))
            return "done"
        elif kind in ("response.failed", "error"):
            return "error"
        else:
            return "other"
        self.chunks += 1
        return "chunk"


class NativeOutlet(ResponsesOutlet):
    """A native upstream's stream, re-issued as this gateway's response (its ids, its events)."""

    def event(self, kind: EventKind, raw: bytes, chunk: dict[str, Any] | None) -> bytes:
        event = chunk or {}
        if kind != "chunk":
            return b""
        if "choices" in event:  # a chat chunk of the repaired rest (stream_repair)
            return self.events.chunk(event)
        index = int(event.get("output_index", 0))
        if event.get("type") == "response.output_text.delta":
            delta: dict[str, Any] = {"content": str(event.get("delta") or "")}
        elif event.get("type") == "response.output_item.added":
            item = event.get("item") or {}
            delta = {"tool_calls": [{"index": index, "id": item.get("call_id"),
                                     "function": {"name": item.get("name") or ""}}]}
        else:
            delta = {"tool_calls": [{"index": index, "function": {"arguments": str(event.get("delta") or "")}}]}
        return self.events.chunk({"choices": [{"index": 0, "delta": delta}]})


async def _native(request: web.Request, call: Call, exchange: Exchange, adm: Admission,
                  routed: RoutedCall) -> web.StreamResponse:
    """An upstream that speaks Responses: it gets the whole conversation (it stores nothing:
    the chain is kept here) and its answer is booked and re-issued under this gateway's ids."""
    req = exchange.req
    body = {k: v for k, v in req.body.items() if k not in ("previous_response_id", "input", "store")}
    body.update(input=input_items([*exchange.earlier, *req.input]), store=False)
    if adm.max_tokens is not None:
        body["max_output_tokens"] = adm.max_tokens

    def raw(model: str) -> bytes:
        return orjson.dumps({**body, "model": model})

    if req.stream:
        return await stream_through(request, call, adm, routed, raw, request.headers,
                                    NativeOutlet(request, call, exchange), NativeReassembly(), "responses")
    reply, upstream = await awaiting_upstream(request, call, adm, routed, respond(routed, raw, request.headers))
    request[ctx.UPSTREAM_SECONDS] = reply.seconds
    request.app[ctx.METRICS].on_upstream(upstream.name, call.chat.model, reply.seconds)
    message, finish = message_of_output(reply.data)
    fixed = repair_message(message, finish, tool_schemas(call.chat.tools) if upstream.config.tool_repair else {})
    message, finish = assistant_message(fixed.message), fixed.finish or finish
    booked = await book_turn(request, call, adm, reported=usage_of_response(reply.data.get("usage")),
                             message=message, finish=finish, routed=routed, repairs=fixed.repairs)
    response = exchange.response(message, finish, booked)
    await exchange.keep(request, call, response, message)
    return web.Response(body=orjson.dumps({**response, "run": booked.run.summary()}), content_type="application/json",
                        headers=booked.headers())


async def _server_side(request: web.Request, call: Call, exchange: Exchange) -> web.StreamResponse:
    """The policy runs tools: the server-side harness drives the run, exactly as for a chat
    call, and its one answer (the final text, the client's own tool calls, or the honest
    sentence of an exit) becomes one response. A stream sends that response's events."""
    server_tools = {t.name for t in call.policy.tools}
    for i, tool in enumerate(exchange.req.tools):
        if tool["name"] in server_tools:
            raise InvalidField(f"tools[{i}].name", f"tools[{i}] is named '{tool['name']}', like a tool of policy "
                               f"'{call.policy.name}' (which the gateway runs itself); rename it")
    kind: StartKind = "run_started" if call.created else "run_resumed"
    prepare = continuations.start() if call.created else continuations.continue_chat(call.chat.messages,
                                                                                        call.chat.model)
    client = FromClient(call.chat.tools or [], server_side.sampling_of(call.chat.body), call.chat.max_tokens)
    drive = await server_side.drive_watched(request, call.run.run_id, prepare, kind, client, [])
    state = drive.state
    call.run = state
    request[ctx.RUN] = state
    answer = Answer.of(state, drive.outcome.answer, drive.outcome.kind == "client_tools")
    headers = run_headers(state, await request.app[ctx.GOVERNOR].team_remaining(call.team))
    if not call.chat.stream:
        booked = Booked(state, None, drive.usage)
        response = exchange.response(answer.message, answer.finish_reason, booked)
        await exchange.keep(request, call, response, answer.message)
        return web.Response(body=orjson.dumps({**response, "run": state.summary()}), content_type="application/json",
                            headers=headers)
    events = ResponseEvents(exchange.id, exchange.req, exchange.created_at)
    calls = [{"index": i, **c} for i, c in enumerate(answer.message.get("tool_calls") or [])]
    body = events.start() + events.chunk({"choices": [{"index": 0, "delta": {"content": answer.message.get("content"),
                                                                               "tool_calls": calls}}]})
    end, final = events.finish(answer.finish_reason, drive.usage)
    await exchange.keep(request, call, final, answer.message)
    stream = await SSEStream.open(request, headers)
    with contextlib.suppress(ClientGone):
        await stream.response.write(body + end)
        await stream.close()
    return stream.response


async def _pass_through(request: web.Request, call: Call, exchange: Exchange) -> web.StreamResponse:
    """The chat pass-through's admission and booking, with the Responses wire on both ends."""
    async with governed(request, call) as (adm, routed):
        if routed.api == "responses":
            return await _native(request, call, exchange, adm, routed)
        body = chat_body(call, adm)
        if call.chat.stream:
            return await stream_through(request, call, adm, routed, body, request.headers,
                                        ResponsesOutlet(request, call, exchange))
        _, parsed, booked = await complete_and_book(request, call, adm, routed, body, request.headers)
        response = exchange.response(parsed.message, parsed.finish_reason, booked)
        await exchange.keep(request, call, response, parsed.message)
        return web.Response(body=orjson.dumps({**response, "run": booked.run.summary()}),
                            content_type="application/json", headers=booked.headers())
