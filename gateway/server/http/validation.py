"""Checks shared by every request body and query the gateway reads: kinds, bounds, depth.

Each check raises `InvalidField` (400 `invalid_request_error`) whose `param` is the exact
path of the value (`messages[1].tool_calls[0].function`) and whose message says what is
wrong in words a client can act on. Booleans are never numbers here, although Python
says `True == 1`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.server.http.errors import (
    BadRequest,
    InvalidField,
    InvalidJSON,
    PayloadTooLarge,
    RequestTimeout,
)
from gateway.server.http.listener import BodyTimedOut

MAX_DEPTH: Final = 64
"""Containers (objects, arrays) nested in a body, counting the body itself: deeper bodies
are refused before anything walks them recursively (saving a run, counting tokens)."""
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def kind(value: Any) -> str:
    """What a JSON value is, for messages ("a string", "an array", ...)."""
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


def wrong_type(path: str, expected: str, value: Any) -> InvalidField:
    """The error for a value of the wrong kind."""
    return InvalidField(path, f"{path} must be {expected}, got {kind(value)}", "invalid_type")


def check_depth(value: Any, limit: int = MAX_DEPTH, root: str = "", raw: bytes | None = None) -> None:
    """Refuse `value` if containers nest more than `limit` deep (checked level by level,
    without recursion, so any depth is safe to check). `raw`, the JSON text of `value`,
    skips the walk when it opens too few brackets to nest that deep."""
    if raw is not None and raw.count(b"[") + raw.count(b"{") <= limit:
        return
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            path = _deep_path(value, limit, root)
            raise InvalidField(path or "body", f"{path or 'the body'} nests objects and arrays more than {limit} "
                                               f"deep (the limit is {limit})", "invalid_value")
        # one comprehension per level (exact types: orjson builds only dict and list)
        level = [child for item in level for child in (item.values() if type(item) is dict else item)
                 if type(child) is dict or type(child) is list]


def _deep_path(value: Any, limit: int, root: str) -> str:
    """The path of the first container at depth `limit` + 1 (only walked on refusal)."""
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > limit:
            return path
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in pairs:
            if isinstance(child, (dict, list)):
                sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
                stack.append((child, sub, depth + 1))
    return root


def optional_int(body: Mapping[str, Any], name: str, low: int, high: int, path: str | None = None) -> int | None:
    """`body[name]` as an integer in [low, high], or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    where = path or name
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(where, f"an integer >= {low} and <= {high}", value)
    if not low <= value <= high:
        raise InvalidField(where, f"{where} must be an integer >= {low} and <= {high}, got {value}", "invalid_value")
    return value


def optional_number(body: Mapping[str, Any], name: str, low: float, high: float,
                    path: str | None = None) -> float | None:
    """`body[name]` as a finite number in [low, high], or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    where = path or name
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(where, f"a number >= {low:g} and <= {high:g}", value)
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidField(where, f"{where} must be a number >= {low:g} and <= {high:g}, got {value}", "invalid_value")
    return float(value)


def optional_str(body: Mapping[str, Any], name: str, path: str | None = None, *, max_len: int | None = None,
                 non_empty: bool = False) -> str | None:
    """`body[name]` as a string (at most `max_len` characters), or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    where = path or name
    if not isinstance(value, str):
        raise wrong_type(where, "a string", value)
    if non_empty and not value:
        raise InvalidField(where, f"{where} must be a non-empty string", "invalid_value")
    if max_len is not None and len(value) > max_len:
        raise InvalidField(where, f"{where} must be at most {max_len} characters, got {len(value)}", "invalid_value")
    return value


def optional_bool(body: Mapping[str, Any], name: str, path: str | None = None) -> bool | None:
    """`body[name]` as a boolean, or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise wrong_type(path or name, "a boolean (true or false)", value)
    return value


def query_int(raw: str, name: str, low: int, high: int) -> int:
    """A query parameter or header holding a decimal integer in [low, high].

    Only ASCII digits count: `str.isdigit` also accepts '²', which `int` then refuses.
    """
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    digits = raw[1:] if raw[:1] == "-" else raw
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
        raise InvalidField(name, f"{name} must be an integer from {low} to {high}, got {shown!r}", "invalid_value")
    value = int(raw)
    if not low <= value <= high:
        raise InvalidField(name, f"{name} must be an integer from {low} to {high}, got {shown}", "invalid_value")
    return value


def json_object(raw: bytes, expected: str) -> dict[str, Any]:
    """A request body as a JSON object, else InvalidJSON saying what was `expected`
    (e.g. "a JSON object with model and messages")."""
    if not raw.strip():
        raise InvalidJSON(f"the body is empty (expected {expected})")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidJSON(f"expected a JSON object, got {kind(body)}")
    return body


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` (declared or actual size), and with 408
    `body_timeout` when it did not arrive within `server.body_timeout_s`."""
    size = request.content_length
    if size is not None and size > limit:
        raise PayloadTooLarge(limit, size)
    try:
        return await request.read()
    except BodyTimedOut as exc:  # the listener's body_timeout_s: the rest of the body cannot be awaited
        raise RequestTimeout(str(exc), "body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(limit) from None
    except web.RequestPayloadError:  # aiohttp's decoder refused the bytes (bad gzip, broken chunks)
        raise BadRequest("the request body could not be read: it does not match its Content-Encoding or "
                         "Transfer-Encoding, or it ended early", code="invalid_body",
                         headers={"Connection": "close"}) from None  # the rest of its bytes cannot be skipped
