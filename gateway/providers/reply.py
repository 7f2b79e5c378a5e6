"""One parser of a non-streamed `chat.completion` reply, for every place that reads one.

`parse_completion(data)` checks the shape the gateway relies on (choice 0 only) and
returns the assistant message as the transcript keeps it, the usage (None when the
upstream sent none) and the finish reason; the other choices (`n` > 1) are kept as they
came, only to be counted when the usage is checked. Anything else raises `MalformedReply`, whose
message names the field (`choices[0].message.tool_calls[0] is not an object`), so a bad
upstream reply becomes a sentence about the upstream, never a crash in the gateway.

Call ids are not checked here: a call without a usable id is the harness's to name
(`gateway.harness.state.own_calls`); a non-string id is dropped for it to do so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.harness.state import Message, assistant_message
from gateway.harness.usage import Usage


class MalformedReply(ValueError):
    """A reply that is not a usable chat completion; the message names the field."""


@dataclass(frozen=True)
class ParsedReply:
    """Choice 0 of a chat completion: its message, the upstream's usage, its finish reason."""

    message: Message
    usage: Usage | None
    finish_reason: str
    others: tuple[Message, ...] = ()
    """The messages of choices 1.. as they came (unchecked: only counted)."""


def parse_completion(data: Any) -> ParsedReply:
    """The checked parts of a chat.completion body (already JSON-decoded)."""
    if not isinstance(data, dict):
        raise MalformedReply("the body is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise MalformedReply("choices is not a list")
    if not choices:
        raise MalformedReply("choices is empty")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedReply("choices[0] is not an object")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedReply("choices[0].finish_reason is not a string")
    message = _message(choice.get("message"), "choices[0].message")
    others = tuple(c["message"] for c in choices[1:] if isinstance(c, dict) and isinstance(c.get("message"), dict))
    return ParsedReply(message, _usage(data.get("usage")), finish or "stop", others)


def _message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise MalformedReply(f"{where} is not an object")
    out = dict(raw)
    role = raw.get("role")
    if role is not None and role != "assistant":
        raise MalformedReply(f"{where}.role is {role!r}, not 'assistant'")
    out["content"] = _content(raw.get("content"), f"{where}.content")
    calls = raw.get("tool_calls")
    if calls is None:
        out.pop("tool_calls", None)
    else:
        out["tool_calls"] = _calls(calls, f"{where}.tool_calls")
    return assistant_message(out)


def _content(raw: Any, where: str) -> str | None:
    """Text or null; content parts (`[{"type": "text", "text": ...}]`) are joined."""
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise MalformedReply(f"{where} is {_kind(raw)}, not a string, null or a list of text parts")
    texts: list[str] = []
    for i, part in enumerate(raw):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise MalformedReply(f"{where}[{i}] is not a text part (an object with a string 'text')")
        texts.append(text)
    return "".join(texts)


def _calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise MalformedReply(f"{where} is {_kind(raw)}, not a list")
    calls: list[dict[str, Any]] = []
    for i, call in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise MalformedReply(f"{at} is not an object")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise MalformedReply(f"{at}.function is not an object")
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not name:
            raise MalformedReply(f"{at}.function.name is not a non-empty string")
        if args is None:
            args = ""
        if not isinstance(args, str):
            raise MalformedReply(f"{at}.function.arguments is {_kind(args)}, not a string")
        kind = call.get("type", "function")
        if kind != "function":
            raise MalformedReply(f"{at}.type is {kind!r}, not 'function'")
        out: dict[str, Any] = {"type": "function", "function": {**fn, "name": name, "arguments": args}}
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id:
            out = {"id": call_id, **out}
        calls.append(out)
    return calls


def _usage(raw: Any) -> Usage | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise MalformedReply(f"usage is {_kind(raw)}, not an object")
    counts: list[int] = []
    for key in ("prompt_tokens", "completion_tokens"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MalformedReply(f"usage.{key} is {value!r}, not a whole number >= 0")
        counts.append(value)
    return Usage(counts[0], counts[1])


def _kind(value: Any) -> str:
    names = {str: "a string", int: "a number", float: "a number", bool: "a boolean", dict: "an object",
             list: "a list"}
    return "null" if value is None else names.get(type(value), "a value of another type")


def response_model(data: Mapping[str, Any]) -> str | None:
    """The model an upstream's answer says produced it (a trace's `gen_ai.response.model`), cut at 256 characters."""
    model = data.get("model")
    return model[:256] if isinstance(model, str) and model else None
