"""What an upstream answered, as the gateway books and returns it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.harness.state import Message
from gateway.harness.usage import Usage
from gateway.tokens import TokenCounter


def usage_of(data: Any) -> Usage | None:
    """The upstream's own usage, if it reported a usable one."""
    if not isinstance(data, dict):
        return None
    prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int) and prompt >= 0 and completion >= 0:
        return Usage(prompt, completion)
    return None


def counted_usage(counter: TokenCounter, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, message: Message) -> Usage:
    """No usage from the upstream: count both sides with o200k_base."""
    return Usage(counter.count_request(messages, tools), counter.count_completion(message))


def with_run(raw: bytes, run: dict[str, Any]) -> bytes:
    """The upstream's body, byte for byte, with a top-level `run` member added at the end."""
    body = raw.rstrip()
    if not body.endswith(b"}"):
        data = orjson.loads(raw)
        data["run"] = run
        return orjson.dumps(data)
    head = body[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + b'"run":' + orjson.dumps(run) + b"}"
