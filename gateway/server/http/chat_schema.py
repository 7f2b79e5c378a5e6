"""The shape of a chat-completions request, checked once before anything else happens.

Messages, by role (content: a string, an array of content parts, or null where allowed):

| role                | content                                 | other fields                          |
| system, developer   | string or [text]                        | name                                  |
| user                | string or [text, image_url, input_audio, file] | name                           |
| assistant           | string, [text, refusal], null or absent | name, refusal, tool_calls, function_call, audio |
| tool                | string or [text]                        | tool_call_id (required, non-empty)    |
| function (legacy)   | string or null                          | name (required)                       |

A tool call is `{id: non-empty string, type: "function", function: {name, arguments:
string}}`; a tool is `{type: "function", function: {name matching ^[A-Za-z0-9_-]{1,64}$,
description?, parameters?: object, strict?: boolean}}`. Numbers are bounded (`NUMBERS`).
Fields this module does not know are passed on to the upstream as they are (OpenAI adds
fields all the time); like every value of the body they obey the depth bound.
Unknown keys inside a message or a part are passed on too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final, cast

from gateway.harness.state import Message
from gateway.server.http.errors import InvalidField
from gateway.server.http.validation import (
    INT64_MAX,
    INT64_MIN,
    kind,
    optional_bool,
    optional_int,
    optional_number,
    optional_str,
    wrong_type,
)

MAX_OUTPUT_TOKENS: Final = 1_000_000
"""The largest `max_tokens` / `max_completion_tokens` accepted (no model writes more in one
reply; larger values would only inflate a budget reservation)."""
MAX_STOP: Final = 4
TOOL_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES: Final = ("none", "auto", "required")

PART_FIELDS: Final[Mapping[str, str]] = {
    "text": "text", "image_url": "image_url", "input_audio": "input_audio", "file": "file", "refusal": "refusal",
}
"""Content part type -> the field holding its payload."""
TEXT_ONLY: Final = frozenset({"text"})
PARTS_BY_ROLE: Final[Mapping[str, frozenset[str]]] = {
    "system": TEXT_ONLY, "developer": TEXT_ONLY, "tool": TEXT_ONLY,
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "assistant": frozenset({"text", "refusal"}),
}
ROLES: Final = frozenset({*PARTS_BY_ROLE, "function"})
PLAIN_ROLES: Final = frozenset({"system", "developer", "user", "assistant"})

NUMBERS: Final[Mapping[str, tuple[bool, float, float]]] = {
    # field: (integer?, lowest, highest)
    "max_tokens": (True, 1, MAX_OUTPUT_TOKENS),
    "max_completion_tokens": (True, 1, MAX_OUTPUT_TOKENS),
    "n": (True, 1, 128),
    "temperature": (False, 0, 2),
    "top_p": (False, 0, 1),
    "presence_penalty": (False, -2, 2),
    "frequency_penalty": (False, -2, 2),
    "seed": (True, INT64_MIN, INT64_MAX),
    "top_logprobs": (True, 0, 20),
}
BOOLEANS: Final = ("stream", "logprobs", "parallel_tool_calls", "store")
STRINGS: Final = ("user", "service_tier", "reasoning_effort", "verbosity", "prompt_cache_key", "safety_identifier")
OBJECTS: Final = ("metadata", "response_format", "audio", "prediction", "web_search_options")


def check_body(body: Mapping[str, Any]) -> None:
    """Check every field of a chat body this gateway knows, but model and messages
    (`check_messages`), which the parser checks first. Walks the body's own keys (a few)
    rather than the table of known fields (some thirty): this runs on every call."""
    for name in body:
        check = CHECKS.get(name)
        if check is not None:
            check(body, name)


def check_messages(messages: Any) -> list[Message]:
    """The messages array, every message checked for its role."""
    if messages is None:
        raise InvalidField("messages", "missing required field: messages", "missing_field")
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array of message objects", messages)
    if not messages:
        raise InvalidField("messages", "messages must hold at least one message", "invalid_value")
    for i, message in enumerate(messages):
        if not _plain(message):
            _message(message, f"messages[{i}]")
    return cast(list[Message], messages)  # every one checked above


def _plain(m: Any) -> bool:
    """The usual messages, recognised without building paths: {role, content: string}, a tool
    result {role: tool, tool_call_id, content: string}, and an assistant's tool calls
    {role: assistant, content: string or null, tool_calls: [{id, type, function: {name, arguments}}]}."""
    if type(m) is not dict:
        return False
    content, role = m.get("content"), m.get("role")
    if type(role) is not str:  # (an object or array is unhashable: no `in` on a set)
        return False
    if len(m) == 2:
        return type(content) is str and role in PLAIN_ROLES
    if len(m) != 3:
        return False
    if role == "tool":
        call_id = m.get("tool_call_id")
        return type(content) is str and type(call_id) is str and bool(call_id)
    calls = m.get("tool_calls")
    if role != "assistant" or (content is not None and type(content) is not str) or type(calls) is not list:
        return False
    for call in calls:
        if type(call) is not dict or len(call) != 3 or call.get("type") != "function":
            return False
        call_id, function = call.get("id"), call.get("function")
        if type(call_id) is not str or not call_id or type(function) is not dict or len(function) != 2:
            return False
        name = function.get("name")
        if type(name) is not str or not name or type(function.get("arguments")) is not str:
            return False
    return True


def _message(m: Any, path: str) -> None:
    if not isinstance(m, dict):
        raise wrong_type(path, "an object", m)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # (a list is unhashable: no `in` on a set)
        shown = repr(role) if isinstance(role, str) else kind(role)
        raise InvalidField(f"{path}.role", f"{path}.role must be one of {', '.join(sorted(ROLES))}, got {shown}",
                           "invalid_value")
    optional_str(m, "name", f"{path}.name")
    if role == "function":
        if not isinstance(m.get("name"), str):
            raise InvalidField(f"{path}.name", f"{path}.name is required for a function message (a string)",
                               "missing_field")
        optional_str(m, "content", f"{path}.content")
        return
    _content(m, role, path)
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is None:
            raise InvalidField(f"{path}.tool_call_id", f"{path}.tool_call_id is required for a tool message "
                                                       "(the id of the call it answers)", "missing_field")
        optional_str(m, "tool_call_id", f"{path}.tool_call_id", non_empty=True)
    elif role == "assistant":
        optional_str(m, "refusal", f"{path}.refusal")
        calls = m.get("tool_calls")
        if calls is not None:
            _tool_calls(calls, f"{path}.tool_calls")
        legacy = m.get("function_call")
        if legacy is not None:
            _function(legacy, f"{path}.function_call")
        audio = m.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise wrong_type(f"{path}.audio", "an object with an id", audio)
            optional_str(audio, "id", f"{path}.audio.id")


def _content(m: dict[str, Any], role: str, path: str) -> None:
    content = m.get("content")
    where = f"{path}.content"
    if content is None:
        if role == "assistant":
            return
        raise InvalidField(where, f"{where} is required for a {role} message (a string or an array of content "
                                  "parts)", "missing_field")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise wrong_type(where, "a string or an array of content parts", content)
    if not content and role != "assistant":  # (an assistant's empty array, sent by some clients, says nothing)
        raise InvalidField(where, f"{where} must hold at least one content part (or be a string)", "invalid_value")
    allowed = PARTS_BY_ROLE[role]
    for j, part in enumerate(content):
        _part(part, allowed, role, f"{where}[{j}]")


def _part(part: Any, allowed: frozenset[str], role: str, path: str) -> None:
    if not isinstance(part, dict):
        raise wrong_type(path, "a content part object", part)
    kind_ = part.get("type")
    if not isinstance(kind_, str) or kind_ not in allowed:
        shown = repr(kind_) if isinstance(kind_, str) else kind(kind_)
        raise InvalidField(f"{path}.type", f"{path}.type must be one of {', '.join(sorted(allowed))} in a {role} "
                                           f"message, got {shown}",
                           "missing_field" if kind_ is None else "invalid_value")
    field = PART_FIELDS[kind_]
    value = part.get(field)
    where = f"{path}.{field}"
    if kind_ in ("text", "refusal"):
        if not isinstance(value, str):
            raise wrong_type(where, f"a string (the {field} of a {kind_} part)", value)
        return
    if not isinstance(value, dict):
        raise wrong_type(where, f"an object (the payload of a {kind_} part)", value)
    if kind_ == "image_url":
        if not isinstance(value.get("url"), str):
            raise wrong_type(f"{where}.url", "a string (an http(s) or data: URL)", value.get("url"))
        optional_str(value, "detail", f"{where}.detail")
    elif kind_ == "input_audio":
        for key in ("data", "format"):
            if not isinstance(value.get(key), str):
                raise wrong_type(f"{where}.{key}", "a string", value.get(key))
    else:
        for key in ("file_data", "file_id", "filename"):
            optional_str(value, key, f"{where}.{key}")


def _tool_calls(calls: Any, path: str) -> None:
    if not isinstance(calls, list):
        raise wrong_type(path, "an array of tool calls", calls)
    for k, call in enumerate(calls):
        where = f"{path}[{k}]"
        if not isinstance(call, dict):
            raise wrong_type(where, "a tool call object ({id, type: \"function\", function: {name, arguments}})",
                             call)
        call_id = call.get("id")
        if call_id is None:
            raise InvalidField(f"{where}.id", f"{where}.id is required (the id its tool message answers)",
                               "missing_field")
        optional_str(call, "id", f"{where}.id", non_empty=True)
        _function_type(call, where)
        function = call.get("function")
        if function is None:
            raise InvalidField(f"{where}.function", f"{where}.function is required ({{name, arguments}})",
                               "missing_field")
        _function(function, f"{where}.function")


def _function(function: Any, path: str) -> None:
    """A called function: {name: non-empty string, arguments: string (JSON text)}."""
    if not isinstance(function, dict):
        raise wrong_type(path, "an object {name, arguments}", function)
    name = function.get("name")
    if name is None:
        raise InvalidField(f"{path}.name", f"{path}.name is required", "missing_field")
    optional_str(function, "name", f"{path}.name", non_empty=True)
    arguments = function.get("arguments")
    if arguments is None:
        raise InvalidField(f"{path}.arguments", f"{path}.arguments is required (the arguments as a JSON string)",
                           "missing_field")
    if not isinstance(arguments, str):
        raise wrong_type(f"{path}.arguments", "a string (the arguments as JSON text)", arguments)


def _function_definition(function: Any, path: str) -> None:
    if not isinstance(function, dict):
        raise wrong_type(path, "an object {name, description?, parameters?}", function)
    name = function.get("name")
    if name is None:
        raise InvalidField(f"{path}.name", f"{path}.name is required", "missing_field")
    if not isinstance(name, str):
        raise wrong_type(f"{path}.name", "a string", name)
    if not TOOL_NAME.match(name):
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise InvalidField(f"{path}.name", f"{path}.name must be 1-64 letters, digits, '_' or '-', got {shown!r}",
                           "invalid_value")
    optional_str(function, "description", f"{path}.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise wrong_type(f"{path}.parameters", "an object (a JSON Schema)", parameters)
    optional_bool(function, "strict", f"{path}.strict")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools array: function tools only."""
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array of tools", tools)
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, "a tool object ({type: \"function\", function: {...}})", tool)
        _function_type(tool, where)
        function = tool.get("function")
        if function is None:
            raise InvalidField(f"{where}.function", f"{where}.function is required", "missing_field")
        _function_definition(function, f"{where}.function")
    return tools


def _functions(functions: Any) -> None:
    if not isinstance(functions, list):
        raise wrong_type("functions", "an array of function definitions", functions)
    for i, function in enumerate(functions):
        _function_definition(function, f"functions[{i}]")


def _tool_choice(choice: Any) -> None:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidField("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or an object, "
                                              f"got {choice!r}", "invalid_value")
        return
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "a string (none, auto, required) or an object", choice)
    kind_ = choice.get("type")
    if kind_ == "function":
        function = choice.get("function")
        if not isinstance(function, dict):
            raise wrong_type("tool_choice.function", "an object {name}", function)
        name = optional_str(function, "name", "tool_choice.function.name", non_empty=True)
        if name is None:
            raise InvalidField("tool_choice.function.name", "tool_choice.function.name is required", "missing_field")
    elif kind_ == "allowed_tools":
        allowed = choice.get("allowed_tools")
        if not isinstance(allowed, dict):
            raise wrong_type("tool_choice.allowed_tools", "an object {mode, tools}", allowed)
        if allowed.get("mode") not in ("auto", "required"):
            raise InvalidField("tool_choice.allowed_tools.mode", "tool_choice.allowed_tools.mode must be auto or "
                                                                 "required", "invalid_value")
        listed = allowed.get("tools")
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise wrong_type("tool_choice.allowed_tools.tools", "an array of objects", listed)
    else:
        shown = repr(kind_) if isinstance(kind_, str) else kind(kind_)
        raise InvalidField("tool_choice.type", f"tool_choice.type must be function or allowed_tools, got {shown}",
                           "missing_field" if kind_ is None else "invalid_value")


def _function_choice(choice: Any) -> None:
    if isinstance(choice, str):
        if choice not in ("none", "auto"):
            raise InvalidField("function_call", f"function_call must be none, auto or an object {{name}}, "
                                                f"got {choice!r}", "invalid_value")
        return
    if not isinstance(choice, dict):
        raise wrong_type("function_call", "none, auto or an object {name}", choice)
    if optional_str(choice, "name", "function_call.name", non_empty=True) is None:
        raise InvalidField("function_call.name", "function_call.name is required", "missing_field")


def _stop(stop: Any) -> None:
    if isinstance(stop, str):
        return
    if not isinstance(stop, list):
        raise wrong_type("stop", f"a string or an array of up to {MAX_STOP} strings", stop)
    if len(stop) > MAX_STOP:
        raise InvalidField("stop", f"stop holds at most {MAX_STOP} strings, got {len(stop)}", "invalid_value")
    for i, item in enumerate(stop):
        if not isinstance(item, str):
            raise wrong_type(f"stop[{i}]", "a string", item)


def _logit_bias(bias: Any) -> None:
    if not isinstance(bias, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to numbers from -100 to 100", bias)
    for token in bias:
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            shown = token if len(token) <= 40 else token[:40] + "..."
            raise InvalidField(f"logit_bias.{shown}", f"logit_bias keys must be token ids (decimal integers), "
                                                      f"got {shown!r}", "invalid_value")
        optional_number(bias, token, -100, 100, f"logit_bias.{token}")


def _modalities(modalities: Any) -> None:
    if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
        raise wrong_type("modalities", "an array of strings", modalities)


def _stream_options(options: Any) -> None:
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    optional_bool(options, "include_usage", "stream_options.include_usage")
    optional_bool(options, "include_obfuscation", "stream_options.include_obfuscation")


FIELD_CHECKS: Final[Mapping[str, Callable[[Any], object]]] = {
    "tools": check_tools,
    "tool_choice": _tool_choice,
    "functions": _functions,
    "function_call": _function_choice,
    "stop": _stop,
    "logit_bias": _logit_bias,
    "modalities": _modalities,
    "stream_options": _stream_options,
}
"""Fields with a structure of their own: field -> its check (called when present and not null)."""


def _object(body: Mapping[str, Any], name: str) -> None:
    value = body[name]
    if value is not None and not isinstance(value, dict):
        raise wrong_type(name, "an object", value)


def _structured(check: Callable[[Any], object]) -> Callable[[Mapping[str, Any], str], None]:
    def run(body: Mapping[str, Any], name: str) -> None:
        value = body[name]
        if value is not None:
            check(value)

    return run


def _checks() -> dict[str, Callable[[Mapping[str, Any], str], object]]:
    out: dict[str, Callable[[Mapping[str, Any], str], object]] = {}
    for name, (integer, low, high) in NUMBERS.items():
        out[name] = (partial(optional_int, low=int(low), high=int(high)) if integer
                     else partial(optional_number, low=low, high=high))
    out.update({name: optional_bool for name in BOOLEANS})
    out.update({name: optional_str for name in STRINGS})
    out.update({name: _object for name in OBJECTS})
    out.update({name: _structured(check) for name, check in FIELD_CHECKS.items()})
    return out


CHECKS: Final = _checks()
"""Every known field but model and messages -> its check, called as check(body, field)."""


def _function_type(item: Mapping[str, Any], where: str) -> None:
    """A tool or tool call's `type`: only "function" is served."""
    got = item.get("type")
    if got != "function":
        raise InvalidField(f"{where}.type", f"{where}.type must be \"function\", got "
                                            f"{repr(got) if isinstance(got, str) else kind(got)}",
                           "missing_field" if got is None else "invalid_value")
