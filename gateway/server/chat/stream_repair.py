"""Tool-call repair of a streamed reply, before the turn is booked and the client sees its end.

A streamed chat chunk cannot be taken back once sent, so for an upstream with `tool_repair`
and a call offering tools, the stream is passed on as it comes only while it cannot be a
tool call that needs repair. From the first chunk that can (any tool-call delta, or content
with `{`, a backtick or `<`: a call written as JSON, fenced or in `<tool_call>` tags), the
rest of the stream is held. At its end the reassembled reply is repaired by the one repair
function (`gateway.providers.repair.repair_message`) and:

- nothing repaired: the held events are sent as they came, byte for byte;
- repaired: the client gets the repaired reply's rest instead — the text not made a call,
  the tool calls whole (one delta each), the finish reason — then the held usage chunk.

llama.cpp streams the model's text and, when it cannot parse it as the tool call, ends the
stream with an error event ("does not match the expected ... format", code 500) instead of
a finish. While holding, that error is dropped (`parse_error_dropped`) and the text it
could not parse is repaired like any other: no such 500 reaches the client or the run.

The reassembly then holds the repaired message, so the turn is booked (with its
`tool_call_repaired` lines and metric) as the client saw it. Text that reached the client
before holding began stays the message's content. A plain answer streams live unless it
writes one of those characters; then its rest arrives at the end, in one piece.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.providers.repair import (
    Repair,
    RepairedMessage,
    is_tool_parse_failure,
    parse_error_dropped,
    repair_message,
    tool_schemas,
)
from gateway.providers.upstream import Upstream
from gateway.server.chat.stream_events import ChatOutlet, EventKind, Reassembly


_MAY_BE_A_CALL = re.compile(r"[{`<]")
# Fields of the upstream's chunks copied onto the chunks written here.
_CHUNK_FIELDS = ("id", "object", "created", "model", "system_fingerprint")


@dataclass(frozen=True)
class Held:
    """An upstream event not yet passed on: its kind, bytes and parsed chunk."""

    kind: EventKind
    raw: bytes
    chunk: dict[str, Any] | None


@dataclass
class StreamRepair:
    """The holding and repair of one streamed reply (see the module docstring)."""

    tools: Mapping[str, Mapping[str, Any]]
    held: list[Held] = field(default_factory=list)
    sent_parts: int = 0  # content parts of the reassembly already passed on
    sent: str = ""  # their text (set by `repair`)
    template: dict[str, Any] | None = None
    fixed: RepairedMessage | None = None
    parse_error: str | None = None  # the upstream's parse-failure error event, dropped

    @classmethod
    def of(cls, upstream: Upstream, tools: Sequence[Mapping[str, Any]] | None, n: int) -> StreamRepair | None:
        """The repair of a stream from `upstream`, or None when nothing is to be repaired: the
        upstream has no `tool_repair`, no tools are offered, or several choices were asked."""
        schemas = tool_schemas(tools) if upstream.config.tool_repair and n == 1 else {}
        return cls(schemas) if schemas else None

    @property
    def repairs(self) -> tuple[Repair, ...]:
        return self.fixed.repairs if self.fixed is not None else ()

    def pass_on(self, kind: EventKind, raw: bytes, got: Reassembly, out: ChatOutlet) -> bytes:
        """What to write now for this event (just fed to `got`): nothing while holding, what
        was held before an error that ends the stream, else what the outlet makes of it."""
        if self.holds(kind, raw, got):
            return b""
        data = out.event(kind, raw, got.last)
        return self.tail(out) + data if kind == "error" else data

    def holds(self, kind: EventKind, raw: bytes, got: Reassembly) -> bool:
        """Keep this event (just fed to `got`) back? Once one is kept, every later one is,
        except an error: the upstream's parse failure is kept aside (and dropped), any
        other is passed on (`tail` first) and ends the stream."""
        if kind == "error":
            message = _parse_failure(got.last) if self.held else None
            if message is not None:
                self.parse_error = message
                return True
            return False
        if self.template is None and got.last is not None and "choices" in got.last:
            self.template = {k: got.last[k] for k in _CHUNK_FIELDS if k in got.last}
        if not self.held and kind == "chunk":
            new = got.content[self.sent_parts:]
            if got.calls or any(_MAY_BE_A_CALL.search(part) for part in new):
                self.held.append(Held(kind, raw, got.last))
                return True
            self.sent_parts = len(got.content)
        elif self.held:
            self.held.append(Held(kind, raw, got.last))
        return bool(self.held)

    def repair(self, got: Reassembly) -> None:
        """Repair the reassembled reply; when something changed, `got` holds the repaired one."""
        if not self.held:
            return
        message = got.message()
        fixed = repair_message(message, got.finish, self.tools)
        if self.parse_error is not None:  # the stream had no finish: the repaired text is the reply
            fixed = RepairedMessage(fixed.message, fixed.finish or "stop",
                                    (parse_error_dropped(self.parse_error), *fixed.repairs))
        if not fixed.repairs:
            return
        self.sent = "".join(got.content[: self.sent_parts])
        repaired = dict(fixed.message)
        if repaired.get("content") is None and self.sent.strip():
            repaired["content"] = self.sent  # what the client already has stays the message's text
        self.fixed = RepairedMessage(repaired, fixed.finish, fixed.repairs)
        got.content = [repaired["content"]] if isinstance(repaired.get("content"), str) else []
        got.calls = dict(enumerate(repaired.get("tool_calls") or []))
        got.finish = fixed.finish

    def tail(self, out: ChatOutlet) -> bytes:
        """What the client is sent of the held events (once): as they came, or the repaired rest."""
        held, self.held = self.held, []
        if self.fixed is None:
            return b"".join(out.event(h.kind, h.raw, h.chunk) for h in held)
        message = self.fixed.message
        parts: list[bytes] = []
        content = message.get("content")
        unsent = content[len(self.sent):] if isinstance(content, str) else ""
        if unsent:
            parts.append(self._write(out, {"content": unsent}))
        calls = message.get("tool_calls") or []
        if calls:
            parts.append(self._write(out, {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}))
        parts.append(self._write(out, {}, self.fixed.finish or "stop"))
        parts += [out.event(h.kind, h.raw, h.chunk) for h in held if h.kind != "chunk"]
        return b"".join(parts)

    def _write(self, out: ChatOutlet, delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {**(self.template or {"object": "chat.completion.chunk"}),
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return out.event("chunk", b"data: " + orjson.dumps(chunk) + b"\n\n", chunk)


def _parse_failure(chunk: Mapping[str, Any] | None) -> str | None:
    """The message of an error event that is the upstream's tool-call parse failure, else None."""
    error = chunk.get("error") if chunk is not None else None
    if not isinstance(error, Mapping):
        return None
    code, message = error.get("code"), str(error.get("message") or "")
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500 if code is None else 0
    return message if is_tool_parse_failure(status, message) else None
