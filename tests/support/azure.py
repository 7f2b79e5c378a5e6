"""A fake Azure OpenAI resource: an aiohttp app that checks what Azure checks and answers
as Azure answers.

Every call must carry the resource's `api-key` header (else 401) and an `api-version`
query parameter it serves (else 404), for a deployment it knows (else 404
DeploymentNotFound): in the path for chat and embeddings
(`/openai/deployments/{deployment}/chat/completions`, `.../embeddings`), as the body's
`model` for the Responses API (`/openai/responses`, which answers 400 to an api-version
before RESPONSES_API_VERSION, as Azure does). Chat answers carry Azure's
`prompt_filter_results` and each choice's `content_filter_results`; a stream starts with
Azure's choice-less chunk of prompt filter results. Responses are the Responses API's
objects and typed events (`tests.support.upstreams.answer_response`). What it answers is
chosen by the last user message (the last input item for Responses), alike for both APIs:

- `FILTER_PROMPT`: 400 `content_filter` with its `innererror` (the prompt was refused);
- `FILTER_ANSWER`: 200 with `finish_reason: content_filter` (the answer was cut; a
  response `incomplete` for the reason `content_filter`);
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

from tests.support.upstreams import answer_response, response_of

KEY = "azure-test-key-7f3c"
API_VERSION = "2024-10-21"
RESPONSES_API_VERSION = "2025-03-01-preview"
"""The first api-version that serves the Responses API (chat and embeddings too)."""
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


@dataclass(frozen=True)
class Answer:
    """What the fake answers a call it does not refuse: a call of tool `call`, or `text`
    (`cut`: cut by the content filter)."""

    text: str | None = None
    call: str | None = None
    cut: bool = False


@dataclass
class FakeAzure:
    """The resource's state: its deployments, key and api-version, and the calls it got."""

    deployments: frozenset[str] = frozenset({"gpt4o-prod", "embed-prod"})
    key: str = KEY
    api_versions: frozenset[str] = frozenset({API_VERSION, RESPONSES_API_VERSION})
    calls: list[dict[str, Any]] = field(default_factory=list)
    throttled: set[str] = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)
        app.router.add_post("/openai/deployments/{deployment}/embeddings", self.embeddings)
        app.router.add_post("/openai/responses", self.responses)
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
        version = request.query.get("api-version") or ""
        if version not in self.api_versions:
            raise _error(404, "404", "Resource not found")
        if request.path == "/openai/responses" and version < RESPONSES_API_VERSION:
            raise _error(400, "BadRequest", "Azure OpenAI Responses API is enabled only for api-version "
                         "2025-03-01-preview and later")
        if request.match_info.get("deployment", body.get("model")) not in self.deployments:
            raise _error(404, "DeploymentNotFound", "The API deployment for this resource does not exist. If you "
                         "created the deployment within the last 5 minutes, please wait a moment and try again.")
        return body  # type: ignore[no-any-return]

    def _answer(self, last: str, tool: str | None, tool_output: Any, deployment: str,
                operation: str) -> web.Response | Answer:
        """What a call is answered, alike for chat and Responses (see the module docstring):
        a refusal, or the answer to give. `tool`: the first tool offered; `tool_output`:
        the latest tool result's content (None before any)."""
        if "FILTER_PROMPT" in last:
            return web.json_response(REFUSAL, status=400)
        if "THROTTLE" in last and last not in self.throttled:
            self.throttled.add(last)
            return web.json_response({"error": {"code": "429", "message": f"Requests to the {operation} "
                                                "Operation have exceeded the token rate limit."}}, status=429,
                                     headers={"retry-after-ms": str(RETRY_AFTER_MS), "retry-after": "1"})
        if tool is not None and tool_output is None:
            return Answer(call=tool)
        if tool_output is not None:
            return Answer(text=f"The tool said: {tool_output}")
        if "FILTER_ANSWER" in last:
            return Answer(text="Here is how", cut=True)
        return Answer(text=f"Hello from {deployment}.")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._checked(request)
        messages = body.get("messages") or []
        last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "") or ""
        tool_result = next((m for m in reversed(messages) if m.get("role") == "tool"), None)
        answer = self._answer(last if isinstance(last, str) else str(last),
                              body["tools"][0]["function"]["name"] if body.get("tools") else None,
                              None if tool_result is None else tool_result.get("content"),
                              request.match_info["deployment"], "ChatCompletions_Create")
        if isinstance(answer, web.Response):
            return answer
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        finish, filters = "stop", FILTERS_SAFE
        if answer.call is not None:
            message["tool_calls"] = [{"id": "call_az1", "type": "function",
                                      "function": {"name": answer.call, "arguments": "{}"}}]
            finish = "tool_calls"
        elif answer.cut:
            finish, filters = "content_filter", ANSWER_FILTERED
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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """`POST /openai/responses`: the deployment is the body's `model`; Azure's Responses
        objects are OpenAI's (its usage input_tokens and output_tokens)."""
        body = await self._checked(request)
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
        last = next((i.get("content") for i in reversed(items) if i.get("role") == "user"), "") or ""
        if not isinstance(last, str):  # input_text parts
            last = "".join(str(p.get("text") or "") for p in last if isinstance(p, dict))
        tool_result = next((i for i in reversed(items) if i.get("type") == "function_call_output"), None)
        answer = self._answer(last, body["tools"][0]["name"] if body.get("tools") else None,
                              None if tool_result is None else tool_result.get("output"), body["model"],
                              "Responses_Create")
        if isinstance(answer, web.Response):
            return answer
        fields: dict[str, Any] = {"id": "resp_az1"}
        if answer.call is not None:
            output = [{"id": "fc_az1", "type": "function_call", "status": "completed", "call_id": "call_az1",
                       "name": answer.call, "arguments": "{}"}]
        else:
            output = [{"id": "msg_az1", "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": answer.text, "annotations": []}]}]
        if answer.cut:
            fields.update(status="incomplete", incomplete_details={"reason": "content_filter"})
        return await answer_response(request, body, response_of(output, (12, 5), MODEL, **fields))

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
    kind = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status]
    return kind(text=orjson.dumps({"error": {"code": code, "message": message}}).decode(),
                content_type="application/json")
