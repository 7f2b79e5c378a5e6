"""A harness `Model` over HTTP: one chat-completions POST per turn to any compatible server.

The demo and sub-runs use it directly against an upstream; the gateway's server-side runs
wrap the upstream with budgets instead (gateway.server.runs.governed_model).

With `tool_repair` (for a small local model) its replies get the gateway's tool-call
repair (`gateway.providers.repair`): the same function, the same retry without tool
parsing after llama.cpp's "could not parse" 500, and each repair in `ModelReply.repairs`,
which the loop traces as `tool_call_repaired`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.state import assistant_message
from gateway.harness.usage import Usage
from gateway.providers.repair import (
    Repair,
    is_tool_parse_failure,
    repair_message,
    retried_without_parsing,
    tool_schemas,
    without_tool_parsing,
)


class ModelCallError(RuntimeError):
    """The server answered with an error or a body that is not a chat completion."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"model call failed with HTTP {status}: {message}")
        self.status = status
        self.detail = message


class HTTPChatModel:
    """`Model` that POSTs `{base_url}/chat/completions` with an aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, api_key: str | None = None,
                 headers: Mapping[str, str] | None = None, tool_repair: bool = False) -> None:
        self.session = session
        self.tool_repair = tool_repair
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
        body = self.body(request)
        tools = tool_schemas(request.tools) if self.tool_repair else {}
        retried: tuple[Repair, ...] = ()
        try:
            data = await self._post(body)
        except ModelCallError as exc:
            if not tools or not is_tool_parse_failure(exc.status, exc.detail):
                raise
            retried = (retried_without_parsing(exc.detail),)
            data = await self._post(without_tool_parsing(body))
        reply = parse_completion(data)
        fixed = repair_message(reply.message, reply.finish_reason, tools)
        repairs = retried + fixed.repairs
        if not repairs:
            return reply
        return ModelReply(assistant_message(fixed.message), reply.usage, fixed.finish or "stop",
                          repairs=tuple(r.to_json() for r in repairs))

    async def _post(self, body: dict[str, Any]) -> Any:
        async with self.session.post(self.url, data=orjson.dumps(body), headers=self.headers) as resp:
            raw = await resp.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ModelCallError(resp.status, f"body is not JSON: {raw[:200]!r}") from None
        if resp.status != 200:
            error = data.get("error", {}) if isinstance(data, dict) else {}
            raise ModelCallError(resp.status, str(error.get("message", raw[:200])))
        return data


def parse_completion(data: Any) -> ModelReply:
    """A chat.completion body -> the assistant message, its usage and finish reason."""
    try:
        choice = data["choices"][0]
        message = dict(choice["message"])
    except (KeyError, IndexError, TypeError):
        raise ModelCallError(200, "response has no choices[0].message") from None
    return ModelReply(assistant_message(message), Usage.from_json(data.get("usage")), str(choice.get("finish_reason") or "stop"))
