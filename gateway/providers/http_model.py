"""A harness `Model` over HTTP: one chat-completions POST per turn to any compatible server.

The demo and sub-runs use it directly against an upstream; the gateway's server-side runs
wrap the upstream with budgets instead (gateway.server.runs.governed_model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.state import assistant_message
from gateway.harness.usage import Usage


class ModelCallError(RuntimeError):
    """The server answered with an error or a body that is not a chat completion."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"model call failed with HTTP {status}: {message}")
        self.status = status


class HTTPChatModel:
    """`Model` that POSTs `{base_url}/chat/completions` with an aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, api_key: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": request.model, "messages": request.messages, **request.extra}
        if request.tools:
            body["tools"] = request.tools
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        return body

    async def complete(self, request: ModelRequest) -> ModelReply:
        async with self.session.post(self.url, data=orjson.dumps(self.body(request)), headers=self.headers) as resp:
            raw = await resp.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ModelCallError(resp.status, f"body is not JSON: {raw[:200]!r}") from None
        if resp.status != 200:
            error = data.get("error", {}) if isinstance(data, dict) else {}
            raise ModelCallError(resp.status, str(error.get("message", raw[:200])))
        return parse_completion(data)


def parse_completion(data: Any) -> ModelReply:
    """A chat.completion body -> the assistant message, its usage and finish reason."""
    try:
        choice = data["choices"][0]
        message = dict(choice["message"])
    except (KeyError, IndexError, TypeError):
        raise ModelCallError(200, "response has no choices[0].message") from None
    return ModelReply(assistant_message(message), Usage.from_json(data.get("usage")), str(choice.get("finish_reason") or "stop"))
