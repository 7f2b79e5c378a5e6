"""An MCP tool result as the text a model reads: text parts joined, other parts described,
cut at a size cap. Tool output is untrusted: nothing here interprets it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson


def _part_text(part: Any) -> str:
    kind = getattr(part, "type", None)
    if kind == "text":
        return str(getattr(part, "text", ""))
    if kind in ("image", "audio"):
        data = getattr(part, "data", "") or ""
        return f"[{kind} {getattr(part, 'mime_type', '') or 'unknown type'}, about {len(data) * 3 // 4} bytes]"
    if kind == "resource_link":
        return f"[resource link {getattr(part, 'uri', '')}]"
    if kind == "resource":
        resource = getattr(part, "resource", None)
        text = getattr(resource, "text", None)
        if isinstance(text, str):
            return text
        return f"[resource {getattr(resource, 'uri', '')}, {getattr(resource, 'mime_type', None) or 'binary'}]"
    return f"[{kind or 'unknown'} content]"


def flatten(content: Sequence[Any], structured: Any = None, cap: int = 100_000) -> str:
    """The parts as one text (structured content as JSON when there are no parts), at most `cap`
    characters plus a note saying how many were cut."""
    text = "\n".join(_part_text(p) for p in content)
    if not text and structured is not None:
        text = orjson.dumps(structured, default=str).decode()
    if len(text) > cap:
        return text[:cap] + f"\n[... {len(text) - cap} more characters cut by the gateway]"
    return text
