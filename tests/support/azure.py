"""A fake Azure OpenAI resource: an aiohttp app that checks what Azure checks and answers
as Azure answers.

Every call must carry the resource's `api-key` header (else 401) and the `api-version`
query parameter it was made with (else 404), at a deployment path it knows
(`/openai/deployments/{deployment}/chat/completions` or `/embeddings`; else 404
DeploymentNotFound). Chat answers carry Azure's `prompt_filter_results` and each choice's
`content_filter_results`; a stream starts with Azure's choice-less chunk of prompt filter
results. What it answers is chosen by the last user message:

- `FILTER_PROMPT`: 400 `content_filter` with its `innererror` (the prompt was refused);
- `FILTER_ANSWER`: 200 with `finish_reason: content_filter` (the answer was cut);
- `THROTTLE`: the first call with that message is a 429 with `retry-after-ms` (and
  `retry-after`), the next ones answer;
- with `tools` and no tool result yet: a call of the first tool (arguments `{}`);
  after a tool result: "The tool said: <its content>";
- else: "Hello from <deployment>."

`calls` records each request (path, query, headers, JSON body, monotonic time).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

KEY = "azure-test-key-7f3c"
API_VERSION = "2024-10-21"
RETRY_AFTER_MS = 700
MODEL = "gpt-4o-2024-08-06"
FILTERS_SAFE = {name: {"filtered": False, "severity": "safe"} for name in ("hate", "self_harm", "sexual", "violence")}
PROMPT_FILTER_RESULTS = [{"prompt_index": 0, "content_filter_results": FILTERS_SAFE}]
REFUSAL = {"error": {
    "message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy. "
               "Please modify your prompt and retry.",
    "type": None, "param": "prompt", "code": "content_filter", "status": 400,
    "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": {
        **FILTERS_SAFE, "violence": {"filtered": True, "severity": "medium"}}}}}
ANSWER_FILTERED = {**FILTERS_SAFE, "violence": {"filtered": True, "severity": "high"}}


@dataclass
class FakeAzure:
    """The resource's state: its deployments, key and api-version, and the calls it got."""

    deployments: frozenset[str] = frozenset({"gpt4o-prod", "embed-prod"})
    key: str = KEY
    api_version: str = API_VERSION
    calls: list[dict[str, Any]] = field(default_factory=list)
    throttled: set[str] = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)
        app.router.add_post("/openai/deployments/{deployment}/embeddings", self.embeddings)
        return app

    def chat_calls(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"].endswith("/chat/completions")]

    async def _checked(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON body once Azure's checks pass; raises its error answers."""
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        self.calls.append({"path": request.path, "query": dict(request.query), "body": body, "t": time.monotonic(),
                           "headers": {k.lower(): v for k, v in request.headers.items()}})
        if request.headers.get("api-key") != self.key:
            raise _error(401, "401", "Access denied due to invalid subscription key or wrong API endpoint. Make sure "
                         "to provide a valid key for an active subscription and use a correct regional API endpoint "
                         "for your resource.")
        if request.query.get("api-version") != self.api_version:
            raise _error(404, "404", "Resource not found")
        if request.match_info["deployment"] not in self.deployments:
            raise _error(404, "DeploymentNotFound", "The API deployment for this resource does not exist. If you "
                         "created the deployment within the last 5 minutes, please wait a moment and try again.")
        return body  # type: ignore[no-any-return]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._checked(request)
        messages = body.get("messages") or []
        last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "") or ""
        last = last if isinstance(last, str) else str(last)
        if "FILTER_PROMPT" in last:
            return web.json_response(REFUSAL, status=400)
        if "THROTTLE" in last and last not in self.throttled:
            self.throttled.add(last)
            return web.json_response({"error": {"code": "429", "message": "Requests to the ChatCompletions_Create "
                                                "Operation have exceeded the token rate limit."}}, status=429,
                                     headers={"retry-after-ms": str(RETRY_AFTER_MS), "retry-after": "1"})
        tool_result = next((m for m in reversed(messages) if m.get("role") == "tool"), None)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        finish, filters = "stop", FILTERS_SAFE
        if body.get("tools") and tool_result is None:
            name = body["tools"][0]["function"]["name"]
            message["tool_calls"] = [{"id": "call_az1", "type": "function",
                                      "function": {"name": name, "arguments": "{}"}}]
            finish = "tool_calls"
        elif tool_result is not None:
            message["content"] = f"The tool said: {tool_result.get('content')}"
        elif "FILTER_ANSWER" in last:
            message["content"] = "Here is how"
            finish, filters = "content_filter", ANSWER_FILTERED
        else:
            message["content"] = f"Hello from {request.match_info['deployment']}."
        usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
        if not body.get("stream"):
            return web.json_response({
                "id": "chatcmpl-az1", "object": "chat.completion", "created": 1764550400, "model": MODEL,
                "prompt_filter_results": PROMPT_FILTER_RESULTS, "system_fingerprint": "fp_az",
                "choices": [{"index": 0, "finish_reason": finish, "message": message, "logprobs": None,
                             "content_filter_results": filters}],
                "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in _chunks(message, finish, filters, usage if (body.get("stream_options") or {}).get(
                "include_usage") else None):
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._checked(request)
        inputs = body.get("input")
        items = inputs if isinstance(inputs, list) else [inputs]
        return web.json_response({"object": "list", "model": "text-embedding-3-small", "data": [
            {"object": "embedding", "index": i, "embedding": [0.25, -0.5, float(i)]} for i in range(len(items))],
            "usage": {"prompt_tokens": 4 * len(items), "total_tokens": 4 * len(items)}})


def _chunks(message: dict[str, Any], finish: str, filters: dict[str, Any],
            usage: dict[str, int] | None) -> Iterator[dict[str, Any]]:
    head = {"id": "chatcmpl-az1", "object": "chat.completion.chunk", "created": 1764550400, "model": MODEL,
            "system_fingerprint": "fp_az"}
    # Azure's first chunk: no choices, empty id and model, the prompt's filter results
    yield {"choices": [], "created": 0, "id": "", "model": "", "object": "", "prompt_filter_results":
           PROMPT_FILTER_RESULTS}
    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                "content_filter_results": {}}]}
    for call in message.get("tool_calls") or []:
        yield {**head, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": call["id"], "type": "function", "function": call["function"]}]}}]}
    for word in re.findall(r"\S+\s*", message.get("content") or ""):  # word by word, spaces kept
        yield {**head, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None,
                                    "content_filter_results": FILTERS_SAFE}]}
    yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "content_filter_results": filters}]}
    if usage is not None:
        yield {**head, "choices": [], "usage": usage}


def _error(status: int, code: str, message: str) -> web.HTTPException:
    kind = {401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status]
    return kind(text=orjson.dumps({"error": {"code": code, "message": message}}).decode(),
                content_type="application/json")
