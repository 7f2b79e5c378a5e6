"""Server-sent events: the wire format of streamed answers and followed traces.

Progress travels as SSE comment lines (`: tool_start read_file`), which OpenAI clients
skip; answers as `data:` lines holding chat.completion.chunk objects, ended by
`data: [DONE]`. A write to a client that went away raises `ClientGone`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.harness.state import public_run_id
from gateway.harness.trace import Event

STREAMS_END = web.AppKey("streams_end", asyncio.Event)
"""Set when the gateway starts to shut down (`end_streams`, an on_shutdown hook). Endless
streams (the console inbox, a followed trace) end then: aiohttp's graceful shutdown waits
for open requests, up to a minute, and such a client may not be written to for 15 s."""


async def end_streams(app: web.Application) -> None:
    app[STREAMS_END].set()


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(ConnectionError):
    """The client closed the connection while we were writing to it."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def progress_comment(event: Event) -> str | None:
    """The comment line for a trace event, or None for events a client need not see."""
    tool = str(event.get("toolName", ""))
    if event["type"] in ("run_started", "run_resumed"):
        return f"{event['type']} {public_run_id(str(event.get('runId')))}"
    if event["type"] == "turn":
        return f"turn {event.get('turn')}"
    if event["type"] == "tool_start":
        return f"tool_start {tool}"
    if event["type"] == "tool_progress":
        return f"tool_progress {tool} {event.get('label', '')}"
    if event["type"] == "tool_result":
        return f"tool_result {tool} {'ok' if event.get('ok') else 'error'} {event.get('ms')}ms"
    if event["type"] in ("tool_deduped", "tool_denied", "approval_required"):
        return f"{event['type']} {tool}"
    if event["type"] == "run_stopped":
        return f"run_stopped {event.get('status')} {event.get('reason')}"
    return None


class SSEStream:
    """An open `text/event-stream` response."""

    def __init__(self, response: web.StreamResponse, end: asyncio.Event | None = None) -> None:
        self.response = response
        self._end = end

    @classmethod
    async def open(cls, request: web.Request, headers: Mapping[str, str] | None = None) -> SSEStream:
        """Send the status line and headers now: the client sees the stream start at once."""
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
        try:
            await response.prepare(request)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from exc
        return cls(response, request.config_dict.get(STREAMS_END))

    @property
    def ending(self) -> bool:
        """Whether the gateway is shutting down (an endless stream should end)."""
        return self._end is not None and self._end.is_set()

    async def pause(self, seconds: float) -> bool:
        """Wait `seconds` between two polls of an endless stream: False, at once, when the
        gateway starts to shut down and the stream should end."""
        if self._end is None:
            await asyncio.sleep(seconds)
            return True
        try:
            await asyncio.wait_for(self._end.wait(), seconds)
        except TimeoutError:
            return True
        return False

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:  # aiohttp raises both for a closed transport
            raise ClientGone(str(exc)) from exc

    async def comment(self, text: str) -> None:
        await self._write(f": {_one_line(text)}\n\n".encode())

    async def data(self, payload: Any, *, event: str | None = None, id: int | None = None) -> None:
        """One SSE message; `payload` is JSON-encoded unless it is already a string."""
        body = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
        head = (f"event: {event}\n" if event else "") + (f"id: {id}\n" if id is not None else "")
        await self._write(f"{head}data: {body}\n\n".encode())

    async def done(self) -> None:
        """`data: [DONE]`, then close the response."""
        await self._write(b"data: [DONE]\n\n")
        await self.close()

    async def close(self) -> None:
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
