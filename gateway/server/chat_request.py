"""A chat-completions request body, parsed once and checked field by field.

Only what the gateway relies on is checked (the upstream judges the rest); every
refusal is a 400 naming the field (`param`) and what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.harness.state import Message
from gateway.server.errors import InvalidField, InvalidJSON

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


@dataclass
class ChatRequest:
    """The body as received (`raw`, forwarded untouched when nothing changes) and parsed."""

    raw: bytes
    body: dict[str, Any]
    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    max_tokens_field: str
    n: int = 1

    def upstream_body(self, *, max_tokens: int | None, force_usage: bool) -> bytes:
        """The body to forward: the raw bytes unless a clamp or a usage request changes it."""
        changes: dict[str, Any] = {}
        if max_tokens is not None and max_tokens != self.max_tokens:
            changes[self.max_tokens_field] = max_tokens
        if force_usage and self.stream and not self.include_usage:
            options = self.body.get("stream_options") or {}
            changes["stream_options"] = {**options, "include_usage": True}
        if not changes:
            return self.raw
        return orjson.dumps({**self.body, **changes})


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Parse and check a body; raises InvalidJSON or InvalidField."""
    if not raw.strip():
        raise InvalidJSON("the body is empty (expected a JSON object with model and messages)")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidJSON(f"expected a JSON object, got {_kind(body)}")
    model = body.get("model")
    if model is None:
        raise InvalidField("model", "missing required field: model", "missing_field")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", f"model must be a non-empty string, got {_kind(model)}", "invalid_type")
    messages = _messages(body.get("messages"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidField("stream", f"stream must be a boolean, got {_kind(stream)}", "invalid_type")
    include_usage = _stream_options(body.get("stream_options"), bool(stream))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidField("tools", f"tools must be an array, got {_kind(tools)}", "invalid_type")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise InvalidField(f"tools[{i}]", f"tools[{i}] must be an object, got {_kind(tool)}", "invalid_type")
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _positive_int(body, field)
    if field == "max_completion_tokens" and "max_tokens" in body:
        _positive_int(body, "max_tokens")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InvalidField("n", f"n must be an integer >= 1, got {n!r}", "invalid_type")
    return ChatRequest(raw, body, model, messages, tools or None, bool(stream), include_usage, max_tokens, field,
                       n or 1)


def _messages(messages: Any) -> list[Message]:
    if messages is None:
        raise InvalidField("messages", "missing required field: messages", "missing_field")
    if not isinstance(messages, list):
        raise InvalidField("messages", f"messages must be an array of message objects, got {_kind(messages)}",
                           "invalid_type")
    if not messages:
        raise InvalidField("messages", "messages must hold at least one message", "invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidField(f"messages[{i}]", f"messages[{i}] must be an object, got {_kind(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidField(f"messages[{i}].role",
                               f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
                               "invalid_value")
    return messages


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidField("stream_options", f"stream_options must be an object, got {_kind(options)}", "invalid_type")
    if not stream:
        raise InvalidField("stream_options", "stream_options is only allowed when stream is true", "invalid_value")
    include = options.get("include_usage", False)
    if include is not None and not isinstance(include, bool):
        raise InvalidField("stream_options.include_usage",
                           f"stream_options.include_usage must be a boolean, got {_kind(include)}", "invalid_type")
    return bool(include)


def _positive_int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(field, f"{field} must be an integer, got {_kind(value)}", "invalid_type")
    if value < 1:
        raise InvalidField(field, f"{field} must be >= 1, got {value}", "invalid_value")
    return value
