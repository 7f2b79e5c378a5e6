"""The Responses API on the wire, translated to and from chat completions (pure functions).

`parse_responses_request` checks a `POST /v1/responses` body field by field (every refusal
is a 400 naming the field; unsupported features such as built-in tools or `background`
are refused, never dropped); `chat_messages` and `chat_body` turn it into the
chat-completions request the upstream gets; `response_object` builds the `response` the
client gets from the assistant message the upstream answered; `ResponseEvents` turns the
upstream's chat chunks into the typed semantic events of a streamed response, as they come.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.harness.state import Message
from gateway.harness.usage import Usage
from gateway.server.http.errors import InvalidField
from gateway.server.http.validation import json_object
from gateway.server.http.validation import kind as _kind

SUPPORTED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "metadata", "store", "previous_response_id", "stream", "user", "text", "include",
    "truncation", "reasoning", "background", "service_tier", "prompt_cache_key", "safety_identifier",
    "stream_options",
})
"""Fields the gateway understands; any other is refused by name."""
ROLES = frozenset({"user", "system", "developer", "assistant"})


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_item_id(kind: str) -> str:
    return f"{kind}_" + uuid.uuid4().hex


def item_id(response_id: str, kind: str, index: int) -> str:
    """The id of a response's output item: it names the response, so that a client that sends
    the item back (the Agents SDK replays its history) says which conversation it continues."""
    return f"{kind}_{response_id.removeprefix('resp_')}_{index}"


def wrap_call_id(response_id: str, original: str) -> str:
    """The call id a client sees: it names the response (clients that replay history without
    item ids, like Vercel's `ai` SDK, still say which run they continue); the upstream's own
    id follows, and is what the upstream gets back."""
    return f"call_{response_id.removeprefix('resp_')}_{original}"


def unwrap_call_id(value: Any) -> tuple[str | None, str]:
    """(the response a wrapped call id names, the upstream's id); (None, value) otherwise."""
    if not isinstance(value, str):
        return None, str(value)
    head, hexpart, rest = value[:5], value[5:37], value[37:]
    if head != "call_" or len(rest) < 2 or rest[0] != "_" or any(c not in "0123456789abcdef" for c in hexpart) \
            or len(hexpart) != 32:
        return None, value
    return "resp_" + hexpart, rest[1:]


def response_of_item(value: Any) -> str | None:
    """The response an output item id of this gateway names, or None."""
    if not isinstance(value, str):
        return None
    kind, _, rest = value.partition("_")
    hexpart, _, index = rest.rpartition("_")
    if kind not in ("msg", "fc") or len(hexpart) != 32 or not index.isdigit():
        return None
    if any(c not in "0123456789abcdef" for c in hexpart):
        return None
    return "resp_" + hexpart


@dataclass
class ResponsesRequest:
    """A checked Responses request: its fields, and its input as chat messages."""

    body: dict[str, Any]
    model: str
    input: list[Message]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    max_output_tokens: int | None
    stream: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str] | None
    echoed: list[str] = field(default_factory=list)  # responses whose output items the input sends back
    response_format: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat-completions shape."""
        if not self.tools:
            return None
        out = []
        for tool in self.tools:
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, dict):
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def conversation(self, earlier: Sequence[Message]) -> list[Message]:
        """The messages sent upstream: instructions (never carried over), earlier turns, input."""
        head: list[Message] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return [*head, *earlier, *self.input]

    def chat_body(self, messages: Sequence[Message], *, stream: bool) -> dict[str, Any]:
        """The chat-completions request for the upstream (max_tokens clamped later by admission)."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), **self.sampling}
        tools = self.chat_tools()
        if tools:
            body["tools"] = tools
            if self.tool_choice is not None:
                body["tool_choice"] = self.chat_tool_choice()
            if "parallel_tool_calls" in self.body:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if stream:
            body["stream"] = True
        return body


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    """Parse and check a body; raises InvalidJSON or InvalidField (naming the field)."""
    return parse_responses_body(load_body(raw))


def load_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or InvalidJSON."""
    return json_object(raw, "a JSON object with model and input")


def item_references(body: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(index, id) of each `item_reference` in the input, to resolve before parsing."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    return [(i, item["id"]) for i, item in enumerate(items)
            if isinstance(item, dict) and item.get("type") == "item_reference" and isinstance(item.get("id"), str)]


def parse_responses_body(body: dict[str, Any]) -> ResponsesRequest:
    """Check a body (item references already resolved); raises InvalidField (naming the field)."""
    for name in body:
        if name not in SUPPORTED:
            raise InvalidField(name, f"{name} is not supported by this gateway's Responses API", "unsupported_field")
    model = body.get("model")
    if model is None:
        raise InvalidField("model", "missing required field: model", "missing_field")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", f"model must be a non-empty string, got {_kind(model)}", "invalid_type")
    if body.get("background"):
        raise InvalidField("background", "background responses are not supported by this gateway", "unsupported_value")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidField("instructions", f"instructions must be a string, got {_kind(instructions)}",
                           "invalid_type")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidField("previous_response_id", "previous_response_id must be a non-empty string", "invalid_type")
    tools = _tools(body.get("tools"))
    names = {t["name"] for t in tools}
    items = body.get("input")
    echoed = [r for r in (_echoed(i) for i in items if isinstance(i, dict)) if r is not None] \
        if isinstance(items, list) else []
    return ResponsesRequest(
        body=body, model=model, input=_input(items), echoed=echoed, instructions=instructions or None, tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), names), parallel_tool_calls=_bool(body, "parallel_tool_calls",
                                                                                            True),
        max_output_tokens=_positive_int(body, "max_output_tokens"), stream=_bool(body, "stream", False),
        store=_bool(body, "store", True), previous_response_id=previous, metadata=_metadata(body.get("metadata")),
        response_format=_text(body.get("text")), sampling=_sampling(body),
    )


def _echoed(item: Mapping[str, Any]) -> str | None:
    """The response an input item came from, when this gateway gave it out."""
    return response_of_item(item.get("id")) or unwrap_call_id(item.get("call_id"))[0]


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidField(name, f"{name} must be a boolean, got {_kind(value)}", "invalid_type")
    return value


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(name, f"{name} must be an integer, got {_kind(value)}", "invalid_type")
    if value < 1:
        raise InvalidField(name, f"{name} must be >= 1, got {value}", "invalid_value")
    return value


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidField(name, f"{name} must be a number, got {_kind(value)}", "invalid_type")
        out[name] = value
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise InvalidField(name, f"{name} must be a string, got {_kind(value)}", "invalid_type")
    if isinstance(body.get("user"), str):
        out["user"] = body["user"]
    include = body.get("include")
    if include:
        raise InvalidField("include", "include is not supported by this gateway (it returns no extra data)",
                           "unsupported_value")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise InvalidField("truncation", f"truncation must be 'auto' or 'disabled', got {truncation!r}",
                           "invalid_value")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise InvalidField("reasoning", f"reasoning must be an object, got {_kind(reasoning)}", "invalid_type")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidField("stream_options", f"stream_options must be an object, got {_kind(options)}",
                           "invalid_type")
    return out


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidField("metadata", "metadata must be an object of string values", "invalid_type")
    return value


def _text(value: Any) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None for plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidField("text", f"text must be an object, got {_kind(value)}", "invalid_type")
    fmt = value.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidField("text.format.type", f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                       "invalid_value")


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidField("tools", f"tools must be an array, got {_kind(value)}", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidField(where, f"{where} must be an object, got {_kind(tool)}", "invalid_type")
        kind = tool.get("type")
        if kind != "function":
            raise InvalidField(f"{where}.type", f"{where}.type {kind!r} is not supported: this gateway serves "
                               "function tools only (built-in tools such as web_search or file_search run at OpenAI)",
                               "unsupported_tool")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidField(f"{where}.name", f"{where}.name must be a non-empty string", "missing_field")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidField(f"{where}.parameters", f"{where}.parameters must be an object", "invalid_type")
        out.append(tool)
    return out


def _tool_choice(value: Any, names: set[str]) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        if value.get("name") not in names:
            raise InvalidField("tool_choice.name", f"tool_choice names {value.get('name')!r}, which is not in tools",
                               "invalid_value")
        return value
    raise InvalidField("tool_choice", "tool_choice must be auto, none, required or {type: function, name}",
                       "invalid_value")


def _input(value: Any) -> list[Message]:
    if value is None:
        raise InvalidField("input", "missing required field: input", "missing_field")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidField("input", f"input must be a string or an array of items, got {_kind(value)}", "invalid_type")
    out: list[Message] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidField(where, f"{where} must be an object, got {_kind(item)}", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": unwrap_call_id(_str(item, "call_id", where))[1], "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, f"{where}.output")
            if not isinstance(output, str):
                raise InvalidField(f"{where}.output", f"{where}.output must be a string, got {_kind(output)}",
                                   "invalid_type")
            out.append({"role": "tool", "tool_call_id": unwrap_call_id(_str(item, "call_id", where))[1],
                        "content": output})
        else:
            raise InvalidField(f"{where}.type", f"{where}.type {kind!r} is not supported (message, function_call, "
                               "function_call_output)", "unsupported_value")
    if not out:
        raise InvalidField("input", "input must hold at least one item", "invalid_value")
    return out


def _str(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidField(f"{where}.{name}", f"{where}.{name} must be a string, got {_kind(value)}",
                           "missing_field" if value is None else "invalid_type")
    return value


def _message(item: Mapping[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidField(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
                           "invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidField(f"{where}.content", f"{where}.content must be a string or an array of parts, got "
                           f"{_kind(content)}", "invalid_type")
    if role == "assistant":
        return {"role": role, "content": _text_of(content, f"{where}.content")}
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        part: dict[str, Any] = raw if isinstance(raw, dict) else {}
        kind = part.get("type")
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise InvalidField(at, f"{at} must be an input_text part with a string text (or an input_image with an "
                               f"image_url), got {kind!r}", "invalid_value")
    return {"role": role, "content": parts}


def _text_of(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise InvalidField(f"{where}[{j}]", f"{where}[{j}] must be a text part with a string text",
                               "invalid_value")
        texts.append(part["text"])
    return "".join(texts)


# --- the response ----------------------------------------------------------------------------


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def output_items(response_id: str, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The output items of an assistant message: its text as a `message`, each tool call as a
    `function_call`."""
    items: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        items.append({"id": item_id(response_id, "msg", 0), "type": "message", "role": "assistant",
                      "status": "completed",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        items.append({"id": item_id(response_id, "fc", len(items)), "type": "function_call",
                      "status": "completed", "call_id": wrap_call_id(response_id, call.get("id") or new_item_id("c")),
                      "name": function.get("name", ""), "arguments": function.get("arguments") or ""})
    return items


def status_of(finish: str) -> tuple[str, dict[str, Any] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def response_object(response_id: str, request: ResponsesRequest, *, created_at: float, status: str,
                    output: list[dict[str, Any]], usage: Usage | None,
                    incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object, in the shape the OpenAI SDKs parse."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": time.time() if status == "completed" else None,
        "error": error, "incomplete_details": incomplete, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "model": request.model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": request.store,
        "temperature": request.body.get("temperature"), "top_p": request.body.get("top_p"),
        "text": {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
        "tools": [{"type": "function", "name": t["name"], "description": t.get("description"),
                   "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in request.tools],
        "truncation": "disabled", "usage": usage_json(usage), "user": request.body.get("user"),
        "metadata": request.metadata or {},
    }


def sse(event: Mapping[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponseEvents:
    """The typed events of one streamed response, from the upstream's chat chunks.

    Text opens a `message` item with one `output_text` part; each tool call opens a
    `function_call` item; items are closed in order when the next opens or the stream ends.
    """

    def __init__(self, response_id: str, request: ResponsesRequest, created_at: float) -> None:
        self.response_id = response_id
        self.request = request
        self.created_at = created_at
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output, as given out so far
        self.open: int | None = None  # index of the item taking deltas
        self.by_call: dict[int, int] = {}  # chat tool call index -> output index

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = sse({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def _snapshot(self, status: str) -> dict[str, Any]:
        return response_object(self.response_id, self.request, created_at=self.created_at, status=status, output=[],
                               usage=None)

    def start(self) -> bytes:
        snapshot = self._snapshot("in_progress")
        return (self._event("response.created", response=snapshot)
                + self._event("response.in_progress", response=snapshot))

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        """The events for one chat chunk (choice 0 only)."""
        out = b""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text(text)
            for part in delta.get("tool_calls") or ():
                if isinstance(part, dict):
                    out += self._call(part)
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        index = self.open
        if index is None or self.items[index]["type"] != "message":
            out += self._close()
            index = len(self.items)
            item: dict[str, Any] = {"id": item_id(self.response_id, "msg", index), "type": "message",
                                    "role": "assistant",
                                    "status": "in_progress", "content": []}
            self.items.append(item)
            self.open = index
            out += self._event("response.output_item.added", output_index=index, item=item)
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out += self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                               part=part)
        item = self.items[index]
        item["content"][0]["text"] += text
        return out + self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=[])

    def _call(self, part: Mapping[str, Any]) -> bytes:
        out = b""
        key = int(part.get("index", 0))
        function = part.get("function") or {}
        index = self.by_call.get(key)
        if index is None:
            out += self._close()
            index = len(self.items)
            item = {"id": item_id(self.response_id, "fc", index), "type": "function_call", "status": "in_progress",
                    "call_id": wrap_call_id(self.response_id, part.get("id") or new_item_id("c")),
                    "name": function.get("name") or "",
                    "arguments": ""}
            self.items.append(item)
            self.by_call[key] = index
            self.open = index
            out += self._event("response.output_item.added", output_index=index, item=dict(item))
        item = self.items[index]
        args = function.get("arguments")
        if isinstance(args, str) and args:
            item["arguments"] += args
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=args)
        return out

    def _close(self) -> bytes:
        index, self.open = self.open, None
        if index is None:
            return b""
        item = self.items[index]
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                               part=part)
        else:
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"])
        item["status"] = "completed"
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, finish: str, usage: Usage | None) -> tuple[bytes, dict[str, Any]]:
        """The closing events and the final `response` (completed or incomplete)."""
        out = b""
        while self.open is not None or any(i["status"] == "in_progress" for i in self.items):
            if self.open is None:
                self.open = next(n for n, i in enumerate(self.items) if i["status"] == "in_progress")
            out += self._close()
        status, incomplete = status_of(finish)
        final = response_object(self.response_id, self.request, created_at=self.created_at, status=status,
                                output=self.items, usage=usage, incomplete=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=final), final

    def failed(self, error: Mapping[str, Any]) -> bytes:
        """`response.failed` with the error (the stream was cut or the upstream failed)."""
        final = response_object(self.response_id, self.request, created_at=self.created_at, status="failed",
                                output=self.items, usage=None,
                                error={"code": str(error.get("code") or "server_error"),
                                       "message": str(error.get("message") or "")})
        return self._event("response.failed", response=final)


# --- an upstream that speaks the Responses API itself ----------------------------------------


def input_items(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items (the conversation for a native upstream)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id"),
                        "output": content if isinstance(content, str) else _plain(content)})
        elif role == "assistant":
            if content:
                out.append({"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": _plain(content)}]})
            for call in m.get("tool_calls") or ():
                function = call.get("function") or {}
                out.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                            "arguments": function.get("arguments") or ""})
        elif isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image_url":
                    image = part.get("image_url") or {}
                    parts.append({"type": "input_image", "image_url": image.get("url"),
                                  **({"detail": image["detail"]} if image.get("detail") else {})})
                else:
                    parts.append({"type": "input_text", "text": part.get("text", "")})
            out.append({"role": role, "content": parts})
        else:
            out.append({"role": role, "content": content if isinstance(content, str) else ""})
    return out


def _plain(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def message_of_output(data: Mapping[str, Any]) -> tuple[Message, str]:
    """A native upstream's response as the assistant message the run books, and its finish."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in data.get("output") or ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            texts += [str(p.get("text") or "") for p in item.get("content") or () if isinstance(p, dict)]
        elif item.get("type") == "function_call":
            calls.append({"id": item.get("call_id") or "", "type": "function",
                          "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}})
    message: Message = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message, finish_of(data, bool(calls))


def finish_of(data: Mapping[str, Any], calls: bool) -> str:
    details = data.get("incomplete_details")
    if data.get("status") == "incomplete" and isinstance(details, dict):
        return "length" if details.get("reason") == "max_output_tokens" else "content_filter"
    return "tool_calls" if calls else "stop"


def usage_of_response(data: Any) -> Usage | None:
    """A native upstream's own usage, if it reported a usable one."""
    if not isinstance(data, dict):
        return None
    given, made = data.get("input_tokens"), data.get("output_tokens")
    if isinstance(given, int) and isinstance(made, int) and given >= 0 and made >= 0:
        return Usage(given, made)
    return None
