"""What an upstream answered, as the gateway books and returns it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.harness.state import Message
from gateway.harness.usage import Usage, clamped_kinds
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


COMPLETION_CEILING_PER_CHOICE = 262_144
"""Completion tokens one choice may bill when no `max_tokens` bounds it (above any model's
output limit; reasoning tokens included)."""
PROMPT_SLACK_TOKENS = 2048
MEDIA_PART_TOKENS = 8192
"""What one image (or audio) part of a prompt may cost beyond its text, at most."""


@dataclass(frozen=True)
class CheckedUsage:
    """The usage to book, and what the upstream reported when it was not believed."""

    usage: Usage
    reported: Usage | None = None

    @property
    def clamped(self) -> tuple[str, ...]:
        return () if self.reported is None else tuple(clamped_kinds(self.reported, self.usage))


def checked_usage(reported: Usage | None, *, counter: TokenCounter, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, message: Message, body_bytes: int,
                  allowed_completion: int | None, n: int, counted_prompt: int | None = None) -> CheckedUsage:
    """The usage to book for one reply: the upstream's own, unless it is absent (then both
    sides are counted with o200k_base) or beyond belief, where the gateway's count is booked
    instead: completion tokens above what the call allowed (`max_tokens` x `n`, or a ceiling
    per choice without one), or prompt tokens far above the gateway's count of the prompt
    (twice it plus slack, plus a bound per image or audio part; prompts with file parts,
    whose size the gateway cannot see, are not bounded)."""
    if reported is None:
        return CheckedUsage(counted_usage(counter, messages, tools, message))
    prompt, completion = reported.prompt_tokens, reported.completion_tokens
    ceiling = allowed_completion if allowed_completion is not None else COMPLETION_CEILING_PER_CHOICE * n
    if completion > ceiling:
        completion = min(ceiling, counter.count_completion(message))
    media, files = _media_parts(messages)
    slack = PROMPT_SLACK_TOKENS + media * MEDIA_PART_TOKENS
    if not files:
        if counted_prompt is None and prompt > body_bytes + slack:
            # More tokens than bytes sent (o200k_base makes no token of less than a byte):
            # worth counting the prompt to compare.
            counted_prompt = counter.count_request(messages, tools)
        if counted_prompt is not None and prompt > 2 * counted_prompt + slack:
            prompt = counted_prompt
    if (prompt, completion) == (reported.prompt_tokens, reported.completion_tokens):
        return CheckedUsage(reported)
    return CheckedUsage(Usage(prompt, completion), reported)


def _media_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[int, bool]:
    media, files = 0, False
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "input_image", "input_audio"):
                media += 1
            elif kind in ("file", "input_file"):
                files = True
    return media, files
