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


def embeddings_usage_of(data: Any) -> Usage | None:
    """An embeddings answer's usage, if it reported a usable one: its prompt tokens (and the
    completion tokens an odd upstream may add, which `checked_usage` does not book)."""
    if not isinstance(data, dict):
        return None
    prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens", 0)
    if (isinstance(prompt, int) and isinstance(completion, int) and not isinstance(prompt, bool)
            and prompt >= 0 and completion >= 0):
        return Usage(prompt, completion)
    return None


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
        """Which counts were not believed (`prompt`, `completion`); empty when all were."""
        return () if self.reported is None else tuple(clamped_kinds(self.reported, self.usage))


def checked_usage(reported: Usage | None, *, counter: TokenCounter, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, replies: Sequence[Message] | None, body_bytes: int,
                  allowed_completion: int | None, n: int, counted_prompt: int | None = None) -> CheckedUsage:
    """The usage to book for one upstream answer: the one rule of every route that books
    (chat completions and Responses, pass-through or server-side, streamed or not, and
    embeddings). `replies` are the answer's choices as the gateway received them (None: a
    call that writes no completion, embeddings); `counted_prompt` is the gateway's count of
    the prompt when it has one already (the admission's, or a token array's exact length).

    The upstream's own usage is booked, unless it is absent (then both sides are counted
    with o200k_base) or beyond belief, where the gateway's count is booked instead:
    - completion tokens above what the call allowed (`max_tokens` x `n`, or a ceiling per
      choice without one) are booked at the gateway's count of the replies, and never above
      what was reported: an upstream that wrote past `max_tokens` was paid for what it wrote;
      one that claims more than it wrote is booked at what it wrote. A call that writes no
      completion books none;
    - prompt tokens far above the gateway's count of the prompt (twice it plus slack, plus a
      bound per image or audio part; prompts with file parts, whose size the gateway cannot
      see, are not bounded) are booked at that count.
    """
    if reported is None:
        prompt = counted_prompt if counted_prompt is not None else counter.count_request(messages, tools)
        return CheckedUsage(Usage(prompt, _written(counter, replies)))
    prompt, completion = reported.prompt_tokens, reported.completion_tokens
    ceiling = 0 if replies is None else (
        allowed_completion if allowed_completion is not None else COMPLETION_CEILING_PER_CHOICE * n)
    if completion > ceiling:
        completion = min(completion, _written(counter, replies))
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


def _written(counter: TokenCounter, replies: Sequence[Message] | None) -> int:
    """The gateway's count of what the answer wrote: every choice it received."""
    return sum(counter.count_completion(m) for m in replies) if replies is not None else 0


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
