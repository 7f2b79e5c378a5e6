"""What a streamed chat reply is made of, on its way through the gateway.

`Reassembly` reads the upstream's SSE events (`event_data`) into the reply the turn books:
choice 0's text and tool calls, its finish reason, the usage, and the other choices' text
to count. `ChatOutlet` decides what the client is sent of each event (a chat client: the
upstream's bytes as they came; the Responses API has an outlet of its own). Both the
streaming of a pass-through call (`passthrough_stream`) and the repair of its tool calls
(`stream_repair`) use them: this module imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson

from gateway.harness.state import Message
from gateway.harness.usage import Usage
from gateway.server.runs.booking import Booked
from gateway.server.runs.replies import usage_of

EventKind = Literal["chunk", "usage_only", "done", "error", "malformed", "other"]


class Reassembly:
    """The reply rebuilt from chunk deltas (choice 0), its finish reason and usage; of the
    other choices (`n` > 1), only their text, to count what the upstream wrote."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.other_text: dict[int, list[str]] = {}
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.chunks = 0
        self.last: dict[str, Any] | None = None  # the chunk fed last (an outlet may translate it)

    def decoded(self, event: bytes, done: bytes | None = None) -> dict[str, Any] | EventKind:
        """An SSE event's JSON object (kept as `last`), or what else it is: no data (`other`),
        the `done` marker, or data that is not a JSON object (`malformed`)."""
        data = event_data(event)
        if data is None:
            return "other"
        if done is not None and data == done:
            return "done"
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "malformed"
        if not isinstance(parsed, dict):
            return "malformed"
        self.last = parsed
        return parsed

    def feed(self, event: bytes) -> EventKind:
        chunk = self.decoded(event, b"[DONE]")
        if not isinstance(chunk, dict):
            return chunk
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
            if isinstance(choice, dict):
                index = choice.get("index", 0)
                if index == 0:
                    self._choice(choice)
                elif isinstance(index, int) and not isinstance(index, bool):
                    self._other(index, choice)
        return "chunk"

    def _other(self, index: int, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        text = self.other_text.setdefault(index, [])
        if isinstance(delta.get("content"), str):
            text.append(delta["content"])
        parts = delta.get("tool_calls")
        for part in parts if isinstance(parts, list) else ():
            function = part.get("function") if isinstance(part, dict) else None
            if isinstance(function, dict):
                text += [v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str)]

    def others(self) -> tuple[Message, ...]:
        """The other choices' text, as messages to count."""
        return tuple({"role": "assistant", "content": "".join(self.other_text[i])} for i in sorted(self.other_text))

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
