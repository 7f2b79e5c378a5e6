"""Server-side runs over HTTP: a chat call (or a resume) drives the run and answers it.

`handle_server_side(request, call)`: the chat endpoint resolved the
team, the run (new or loaded) and the policy; here the run is driven by the `RunDriver`
and answered with one chat.completion (or, streamed, SSE progress comments then the
answer as chunks; a streamed call whose run pauses on an approval of an
`on_decision: resume` policy stays open until the run stops for good). A client that goes away mid-run presses the run's Stop: it is saved
as interrupted ("client disconnected") and can be resumed.

The driver itself lives for the app's lifetime (`gateway.server.runs.runtime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.harness.loop import Outcome
from gateway.harness.state import RunState, public_run_id
from gateway.harness.usage import Usage
from gateway.policy.decl import Policy
from gateway.providers.errors import UpstreamError
from gateway.server import context as ctx
from gateway.server.chat.answers import (
    Answer,
    completion_body,
    completion_chunks,
    completion_id,
)
from gateway.server.http.errors import (
    ApiError,
    Conflict,
    InvalidField,
    StoreUnavailable,
    from_store_error,
    upstream_failed,
)
from gateway.server.http.headers import run_headers
from gateway.server.http.sse import ClientGone, SSEStream, progress_comment
from gateway.server.runs import continuations
from gateway.server.runs.cancels import CLIENT_DISCONNECTED, ActiveRuns, RunBusy
from gateway.server.runs.auto_resume import follow_until_stopped, resumes_on_decision, waits_for_decision
from gateway.server.runs.driver import Drive, FromClient, Prepare, StartKind, last_answer
from gateway.server.runs.keying import Call
from gateway.store.base import Event
from gateway.store.errors import SpoolNotReady, StoreError

log = logging.getLogger(__name__)

CLIENT_POLL_S: Final = 0.02
"""How often a waiting handler checks that its client is still connected."""


SAMPLING = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "user")
"""Fields of a chat call that a server-side run passes on to every model call it makes."""


def sampling_of(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in SAMPLING if k in body}


async def handle_server_side(request: web.Request, call: Call) -> web.StreamResponse:
    """Drive the call's run and answer it like a chat completion."""
    server_tools = {t.name for t in call.policy.tools}
    client_tools = list(call.chat.tools or [])
    for i, tool in enumerate(client_tools):
        name = (tool.get("function") or {}).get("name")
        if name in server_tools:
            raise InvalidField(f"tools[{i}]", f"tools[{i}] is named '{name}', like a tool of policy "
                                              f"'{call.policy.name}' (which the gateway runs itself); rename it")
    if call.created:
        continuations.refuse_unanswered_calls(call.chat.messages)
    kind: StartKind = "run_started" if call.created else "run_resumed"
    prepare = continuations.start() if call.created else continuations.continue_chat(call.chat.messages,
                                                                                        call.chat.model)
    client = FromClient(client_tools, sampling_of(call.chat.body), call.chat.max_tokens)
    return await answer(request, call.run.run_id, prepare=prepare, start=kind, client=client,
                        stream=call.chat.stream, include_usage=call.chat.include_usage)


async def answer(request: web.Request, run_id: str, *, prepare: Prepare, start: StartKind,
                 client: FromClient = FromClient(), stream: bool = False,
                 include_usage: bool = False) -> web.StreamResponse:
    """Drive the run and answer: one chat.completion, or an SSE stream when `stream`."""
    if stream:
        return await _stream(request, run_id, prepare, start, client, include_usage)
    drive = await drive_watched(request, run_id, prepare, start, client, [])
    state = drive.state
    request[ctx.RUN] = state
    body = completion_body(state, Answer.of(state, drive.outcome.answer, drive.outcome.kind == "client_tools"),
                           drive.usage)
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers=run_headers(state, await _team_left(request.app, state)))


async def _team_left(app: web.Application, state: RunState) -> float | None:
    team = app[ctx.LIVE].config.team(state.team)
    return None if team is None else await app[ctx.GOVERNOR].team_remaining(team)


def _client_closed() -> web.Response:
    """What the log and metrics see for a client that left before its answer (nginx's 499)."""
    return web.Response(status=499, reason="Client Closed Request")


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _watch_client(request: web.Request, active: ActiveRuns, run_id: str) -> None:
    """When the client goes away, press the run's Stop (as soon as the run is driven here)."""
    while not _client_gone(request):
        await asyncio.sleep(CLIENT_POLL_S)  # aiohttp signals a lost client to no awaitable
    while not active.cancel(run_id, CLIENT_DISCONNECTED, "client"):
        await asyncio.sleep(CLIENT_POLL_S)


async def drive_watched(request: web.Request, run_id: str, prepare: Prepare, start: StartKind,
                         client: FromClient, listeners: list[Any]) -> Drive:
    """Drive the run for this request; a client that goes away presses the run's Stop."""
    driver = request.app[ctx.DRIVER]
    task = asyncio.ensure_future(driver.drive(run_id, prepare=prepare, client=client,
                                              listeners=listeners, start=start))
    watcher = asyncio.ensure_future(_watch_client(request, driver.active, run_id))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:  # the server cancelled the handler: the client is gone
        driver.active.cancel(run_id, CLIENT_DISCONNECTED, "client")
        with contextlib.suppress(Exception):
            await task
        raise
    except RunBusy as exc:  # it stops soon: a retry can succeed
        raise Conflict(str(exc), code="run_busy", headers={"x-should-retry": "true", "retry-after": "1"}) from None
    except StoreError as exc:  # an ApiError here, so a stream already open ends with it too
        error = from_store_error(exc)
        if isinstance(error, StoreUnavailable) and not isinstance(exc, SpoolNotReady):  # logged once until it recovers
            request.app[ctx.STORE_HEALTH].fail(f"{exc} (driving run {run_id})")
        raise error from None
    finally:
        watcher.cancel()


async def _stream(request: web.Request, run_id: str, prepare: Prepare, start: StartKind,
                  client: FromClient, include_usage: bool) -> web.StreamResponse:
    """SSE: progress comments while the run is driven, then the answer as chunks, then [DONE].

    The stream opens on the run's first trace line, so a refusal before the run starts
    (busy, bad input) is still an ordinary JSON error.
    """
    queue: asyncio.Queue[Event] = asyncio.Queue()
    task = asyncio.ensure_future(drive_watched(request, run_id, prepare, start, client, [queue.put_nowait]))
    sse: SSEStream | None = None
    gone = False
    event: Event | None = None  # the last line of the drive (where a follow after a pause starts)
    try:
        while not (task.done() and queue.empty()):
            if queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait((task, getter), return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                event = getter.result()
            else:
                event = queue.get_nowait()
            comment = progress_comment(event)
            if gone or comment is None:
                continue
            try:
                if sse is None:
                    sse = await SSEStream.open(request, {"X-Run-Id": public_run_id(run_id),
                                                         "X-Run-Status": "running"})
                await sse.comment(comment)
            except ClientGone:
                gone = True
                request.app[ctx.DRIVER].active.cancel(run_id, CLIENT_DISCONNECTED, "client")
        drive = task.result()
    except (ApiError, UpstreamError) as exc:
        if sse is None:
            raise
        error = upstream_failed(exc) if isinstance(exc, UpstreamError) else exc
        request[ctx.ERROR_CODE] = error.code or error.type  # the stream's 200 ended in this error
        if not gone:
            with contextlib.suppress(ClientGone):
                await sse.data(error.body())
                await sse.done()
        return sse.response
    finally:
        if not task.done():
            task.cancel()
    state = drive.state
    request[ctx.RUN] = state
    if gone:
        return sse.response if sse is not None else _client_closed()
    if sse is None:
        try:
            sse = await SSEStream.open(request, run_headers(state, await _team_left(request.app, state)))
        except ClientGone:
            return _client_closed()
    if drive.driven and waits_for_decision(state) and resumes_on_decision(request.app[ctx.DRIVER].policy_of(state)):
        try:  # paused for a decision that resumes the run: stay open, answer when it stops
            drive = await _follow_paused(request, sse, drive, event)
        except ClientGone:
            return sse.response
        state = request[ctx.RUN] = drive.state
    answer_ = Answer.of(state, drive.outcome.answer, drive.outcome.kind == "client_tools")
    with contextlib.suppress(ClientGone):
        for chunk in completion_chunks(state, answer_, drive.usage if include_usage else None, cid=completion_id()):
            await sse.data(chunk)
        await sse.done()
    return sse.response


async def _follow_paused(request: web.Request, sse: SSEStream, paused: Drive, last: Event | None) -> Drive:
    """Follow a run that paused on an approval of an `on_decision: resume` policy until it
    stops for good, wherever it is driven; the Drive to answer with (its usage: this call's
    drive plus what the run spent after the pause). The stream showed the drive's lines up
    to `last`; whatever the store has after that one is shown next."""
    driver = request.app[ctx.DRIVER]
    store = driver.store
    state = paused.state
    after = _stored_seq(await store.events(state.run_id), last)

    async def emit(seq: int, event: Event) -> None:
        comment = progress_comment(event)
        if comment is not None:
            await sse.comment(comment)

    async def keepalive() -> None:
        await sse.comment(f"waiting for a decision on run {state.public_id}")

    def policy_of(run: RunState) -> Policy | None:
        return driver.policies.for_run(run.policy, run.policy_version)

    final = await follow_until_stopped(store, policy_of, state, after, emit, keepalive)
    usage = paused.usage + Usage(final.usage.prompt_tokens - state.usage.prompt_tokens,
                                 final.usage.completion_tokens - state.usage.completion_tokens)
    answer_ = last_answer(final)
    return Drive(Outcome(final, "stopped", answer_), usage)


def _stored_seq(stored: list[tuple[int, Event]], last: Event | None) -> int:
    """The sequence number `last` (a line the stream showed) was stored under; the last one
    stored when it is not found. Not simply the last one: the decision, and the lines of
    the drive it resumed, may be stored already (a client that decides on seeing
    `approval_required` can be that fast), and they must be shown too."""
    if last is not None:
        for seq, event in reversed(stored):
            if event.get("ts") == last.get("ts") and event.get("type") == last.get("type"):
                return seq
    return stored[-1][0] if stored else 0
