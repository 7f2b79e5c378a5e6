"""A chat-completions request body, parsed once and checked field by field.

The whole body is checked up front, before any run is created or any count is taken:
its depth, every message and tool, and the numbers (see gateway.server.http.chat_schema);
every refusal is a 400 naming the field (`param`) and what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.harness.state import Message
from gateway.server.http.chat_schema import ROLES, check_body, check_messages
from gateway.server.http.errors import InvalidField
from gateway.server.http.validation import check_depth, json_object, kind

__all__ = ["ROLES", "ChatRequest", "parse_chat_request"]


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

    def upstream_body(self, *, max_tokens: int | None, force_usage: bool, model: str | None = None) -> bytes:
        """The body to forward: the raw bytes unless a clamp, a usage request or another model
        name (a deployment's or a fallback's) changes it."""
        changes: dict[str, Any] = {}
        if model is not None and model != self.model:
            changes["model"] = model
        if max_tokens is not None and max_tokens != self.max_tokens:
            changes[self.max_tokens_field] = max_tokens
        if force_usage and self.stream and not self.include_usage:
            options = self.body.get("stream_options") or {}
            changes["stream_options"] = {**options, "include_usage": True}
        if not changes:
            return self.raw
        return orjson.dumps({**self.body, **changes})


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Parse and check a body against the request's schema (gateway.server.http.chat_schema);
    raises InvalidJSON or InvalidField before anything else looks at it."""
    body = json_object(raw, "a JSON object with model and messages")
    check_depth(body, raw=raw)
    model = body.get("model")
    if model is None:
        raise InvalidField("model", "missing required field: model", "missing_field")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", f"model must be a non-empty string, got {kind(model)}", "invalid_type")
    messages = check_messages(body.get("messages"))
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidField("stream_options", "stream_options is only allowed when stream is true", "invalid_value")
    check_body(body)
    include_usage = bool(options.get("include_usage")) if options is not None else False
    tools = body.get("tools")
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(field)
    return ChatRequest(raw, body, model, messages, tools or None, stream, include_usage, max_tokens, field,
                       body.get("n") or 1)
