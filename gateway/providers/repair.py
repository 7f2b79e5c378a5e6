"""Tool-call repair: turn what a small model meant as a tool call into one the harness can run.

Pure functions over an already-decoded chat completion and the request's `tools`. Small
open models (the 0.5B/1.5B Qwen2.5-Coder served by `gateway local`, and their kin behind
Ollama or vLLM) get tool calls wrong in a few recurring ways; each is fixed here and named
by a `Repair`, so the gateway can say exactly what it changed (`tool_call_repaired` trace
events, `gateway_tool_call_repairs_total`):

- `call_from_text`: no `tool_calls`, but the content is, or holds (in a ```json fence,
  `<tool_call>` tags or before trailing prose), a JSON object naming a known tool with its
  arguments (`{"name": "read_file", "arguments": {"path": "notes.txt"}}`);
- `arguments_trimmed`: the arguments string is a JSON object followed by other text;
- `undeclared_keys_dropped`: argument keys the tool's schema does not declare, when the
  schema forbids them (`additionalProperties: false`) or when they are JSON-Schema words
  (`type`, `properties`, `required`...): the model echoed the schema as its arguments;
- `retried_without_tool_parsing`: the upstream (llama.cpp) failed to parse the model's
  tool call and answered 500; the call was retried once with `tool_choice: "none"` (the
  tools stay in the prompt, nothing is parsed) and the text repaired here;
- `parse_error_dropped`: a stream the upstream ended with that parse failure as an error
  event, after streaming the model's text: the error is dropped and the text repaired here
  (the text is already there; nothing is asked again).

Nothing here guesses a tool the model did not name or a value it did not write: a JSON
object naming an unknown tool is left as the answer it is.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from gateway.harness.trace import RepairFields

RepairKind = Literal["call_from_text", "arguments_trimmed", "undeclared_keys_dropped", "retried_without_tool_parsing",
                     "parse_error_dropped"]
REPAIR_KINDS: Final[tuple[RepairKind, ...]] = ("call_from_text", "arguments_trimmed", "undeclared_keys_dropped",
                                               "retried_without_tool_parsing", "parse_error_dropped")

# Words of JSON Schema a model copies from the tool's `parameters` into its arguments.
SCHEMA_WORDS: Final = frozenset({"type", "properties", "required", "additionalProperties", "description", "title",
                                 "$schema", "items", "enum", "default"})
# How llama.cpp words a tool call it could not parse (its 500), across versions.
# ("The model produced output that does not match the expected peg-native format", xllamacpp 2026.10)
_PARSE_FAILURE = re.compile(r"does not match the expected|expected \S* ?format|failed to parse|tool call.*pars",
                            re.IGNORECASE | re.DOTALL)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)
MAX_SCANNED_CHARS: Final = 64_000  # content past this is never searched for calls (bounded work)
MAX_CALLS_FROM_TEXT: Final = 8


@dataclass(frozen=True)
class Repair:
    """One change made to a reply: its kind, the tool it concerns, and what changed, in words."""

    kind: RepairKind
    tool: str
    detail: str

    def to_json(self) -> RepairFields:
        """The trace event's fields (`tool_call_repaired`)."""
        return {"repair": self.kind, "tool": self.tool, "detail": self.detail}


@dataclass(frozen=True)
class RepairedCompletion:
    """A completion after repair (the same object when nothing changed) and the repairs made."""

    data: dict[str, Any]
    repairs: tuple[Repair, ...]


def tool_schemas(tools: Any) -> dict[str, Mapping[str, Any]]:
    """The request's `tools` as name -> parameters schema (entries that are not functions are skipped)."""
    out: dict[str, Mapping[str, Any]] = {}
    if not isinstance(tools, list):
        return out
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str) and name:
            params = fn.get("parameters") if isinstance(fn, Mapping) else None
            out[name] = params if isinstance(params, Mapping) else {}
    return out


def is_tool_parse_failure(status: int, message: str) -> bool:
    """Is this upstream error llama.cpp's "could not parse the tool call" 500?"""
    return status == 500 and bool(_PARSE_FAILURE.search(message))


def retried_without_parsing(message: str) -> Repair:
    """The repair of asking again without tool parsing after the upstream's `message` (its parse-failure 500)."""
    return Repair("retried_without_tool_parsing", "", f"the upstream could not parse the model's tool call "
                                                      f"({message}); asked again without tool parsing")


def parse_error_dropped(message: str) -> Repair:
    """The repair of a stream that ended in the upstream's parse-failure error event `message`."""
    return Repair("parse_error_dropped", "", f"the upstream ended the stream with its tool-call parse error "
                                             f"({message}); the text it streamed was repaired instead")


def without_tool_parsing(body: Mapping[str, Any]) -> dict[str, Any]:
    """The retry's body: the same prompt (tools still rendered), but nothing parsed as a call."""
    return {**body, "tool_choice": "none"}


@dataclass(frozen=True)
class RepairedMessage:
    """An assistant message after repair (the same object when nothing changed), its finish
    reason (`tool_calls` once it has calls) and the repairs made."""

    message: dict[str, Any]
    finish: str | None
    repairs: tuple[Repair, ...]


def repair_message(message: Mapping[str, Any], finish: str | None,
                   tools: Mapping[str, Mapping[str, Any]]) -> RepairedMessage:
    """Repair one assistant message against `tools` (`tool_schemas`): the one repair every
    path runs (a non-streamed reply, a reassembled stream, a Responses output, the demo's
    model). `message` itself is not changed."""
    same = RepairedMessage(message if isinstance(message, dict) else dict(message), finish, ())
    if not tools:
        return same
    repairs: list[Repair] = []
    fixed = dict(message)
    calls = message.get("tool_calls")
    if not calls:
        found = calls_in_text(message.get("content"), tools)
        if found:
            calls = found
            fixed["content"] = None
            for call in found:
                name = call["function"]["name"]
                repairs.append(Repair("call_from_text", name, "a tool call written as JSON in the content was made "
                                                                "a tool call"))
    if isinstance(calls, list):
        fixed_calls = [_repair_call(call, tools, repairs) for call in calls]
        if repairs:
            fixed["tool_calls"] = fixed_calls
    if not repairs:
        return same
    if fixed.get("tool_calls") and finish in (None, "stop"):
        finish = "tool_calls"
    return RepairedMessage(fixed, finish, tuple(repairs))


def repair_completion(data: dict[str, Any], tools: Mapping[str, Mapping[str, Any]]) -> RepairedCompletion:
    """Repair choice 0's message of a chat completion (`repair_message`); `data` itself is not changed.

    A shape this cannot read is left alone: the reply parser names what is wrong with it.
    """
    choices = data.get("choices")
    if not tools or not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return RepairedCompletion(data, ())
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        return RepairedCompletion(data, ())
    fixed = repair_message(message, choice.get("finish_reason"), tools)
    if not fixed.repairs:
        return RepairedCompletion(data, ())
    new_choice = {**choice, "message": fixed.message, "finish_reason": fixed.finish}
    return RepairedCompletion({**data, "choices": [new_choice, *choices[1:]]}, fixed.repairs)


def calls_in_text(content: Any, tools: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls of known tools written as JSON in `content`, as `tool_calls` entries ([] if none)."""
    if not isinstance(content, str) or "{" not in content:
        return []
    text = content[:MAX_SCANNED_CHARS]
    calls: list[dict[str, Any]] = []
    for obj in _json_objects(text):
        call = _as_call(obj, tools)
        if call is None:
            continue
        name, args = call
        digest = hashlib.sha256(f"{len(calls)}:{text}".encode()).hexdigest()[:24]
        calls.append({"id": f"call_{digest}", "type": "function",
                      "function": {"name": name, "arguments": orjson.dumps(args).decode()}})
        if len(calls) >= MAX_CALLS_FROM_TEXT:
            break
    return calls


def _json_objects(text: str) -> Iterator[Any]:
    """Each JSON object in `text`: those in code fences first, else every top-level one in order."""
    fenced = [m.group(1) for m in _FENCE.finditer(text)]
    sources = fenced or [text]
    for source in sources:
        at = source.find("{")
        while at != -1:
            value, end = _decode_at(source, at)
            if value is None:
                at = source.find("{", at + 1)
                continue
            yield value
            at = source.find("{", end)


def _decode_at(text: str, at: int) -> tuple[Any, int]:
    """The JSON value starting at `text[at]` and where it ends, or (None, at).

    orjson has no raw_decode: the stdlib decoder is the one that says where a value ends."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None, at
    return value, end


def _as_call(obj: Any, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) if `obj` names a known tool with object arguments, in one of the shapes models use."""
    if not isinstance(obj, dict):
        return None
    for wrapper in ("function", "tool_call"):  # {"function": {...}} and llama.cpp's generic {"tool_call": {...}}
        inner = obj.get(wrapper)
        if isinstance(inner, dict) and "name" in inner:
            obj = inner
            break
    name = obj.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            return None
    return (name, args) if isinstance(args, dict) else None


def _repair_call(call: Any, tools: Mapping[str, Mapping[str, Any]], repairs: list[Repair]) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    raw = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in tools or not isinstance(raw, str) or not raw.strip():
        return call
    assert isinstance(fn, dict) and isinstance(call, dict)
    changed = False
    try:
        args = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value, end = _decode_at(raw, raw.find("{")) if "{" in raw else (None, 0)
        if not isinstance(value, dict):
            return call  # not ours to guess: the harness answers the model that the arguments are invalid
        args, changed = value, True
        repairs.append(Repair("arguments_trimmed", name, f"text after the arguments object was dropped: "
                                                         f"{_clip(raw[end:].strip())!r}"))
    if not isinstance(args, dict):
        return call
    kept, dropped = split_undeclared(args, tools[name])
    if dropped:
        changed = True
        repairs.append(Repair("undeclared_keys_dropped", name, "argument keys the schema does not declare were "
                                                               f"dropped: {', '.join(sorted(dropped))}"))
    if not changed:
        return call
    return {**call, "function": {**fn, "arguments": orjson.dumps(kept).decode()}}


def split_undeclared(args: dict[str, Any], schema: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the arguments to keep, the keys dropped): keys the schema does not declare go when it
    forbids them (`additionalProperties: false`) or when they are JSON-Schema words.

    Values the model put under an echoed `properties` for declared keys (`{"properties":
    {"path": "notes.txt"}}`) are kept as those arguments when the arguments lack them."""
    props = schema.get("properties")
    declared = set(props) if isinstance(props, Mapping) else set()
    forbids = schema.get("additionalProperties") is False
    dropped = [k for k in args if k not in declared and (forbids or k in SCHEMA_WORDS)]
    if not dropped:
        return args, []
    kept = {k: v for k, v in args.items() if k not in dropped}
    echoed = args.get("properties")
    if "properties" in dropped and isinstance(echoed, dict):
        for key, value in echoed.items():
            if key in declared and key not in kept and not isinstance(value, dict):
                kept[key] = value  # a value, not a schema ({"type": "string"}) for it
    return kept, dropped


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
