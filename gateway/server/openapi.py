"""`GET /openapi.json`: an OpenAPI 3.1 document of the routes this gateway serves.

The document is built from the app's own router (every route the app has, the scripted
mount and the optional modules included) joined with `OPERATIONS`, what each route does;
a route without an entry there is a bug that `tests/server/test_openapi.py` catches, so the
document cannot drift from the routes. Bodies are described as far as clients need (the
chat and Responses bodies are validated more finely at the edge: docs/http-api.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

from gateway import __version__
from gateway.server import context as ctx

Schema = dict[str, Any]

ERROR: Final[Schema] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code", "param"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}},
}
RUN: Final[Schema] = {
    "type": "object", "required": ["id", "status", "turns", "cost_usd"],
    "properties": {"id": {"type": "string"}, "status": {"type": "string"}, "reason": {"type": ["string", "null"]},
                   "turns": {"type": "integer"}, "cost_usd": {"type": "number"}, "usage": {"type": "object"},
                   "interruption": {"type": ["object", "null"]}},
}
OBJECT: Final[Schema] = {"type": "object"}
SSE: Final = "text/event-stream"
JSON_OR_SSE: Final = ("application/json", SSE)
"""What a call that may stream answers: JSON, or (`stream: true`) server-sent events."""
CHAT_BODY: Final[Schema] = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"]}},
        "stream": {"type": "boolean"}, "tools": {"type": "array", "items": {"type": "object"}},
        "n": {"type": "integer", "minimum": 1, "maximum": 128},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
RESPONSES_BODY: Final[Schema] = {
    "type": "object", "required": ["model"],
    "properties": {"model": {"type": "string", "minLength": 1},
                   "input": {"type": ["string", "array"]}, "instructions": {"type": ["string", "null"]},
                   "previous_response_id": {"type": ["string", "null"]}, "stream": {"type": "boolean"},
                   "max_output_tokens": {"type": "integer", "minimum": 1}, "store": {"type": "boolean"}},
}
GRANT: Final[Schema] = {
    "type": "object", "minProperties": 1, "additionalProperties": False,
    "description": "A limit request only: what to raise each limit by (default: the grant proposed).",
    "properties": {"max_turns": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                   "max_budget_usd": {"type": "number", "exclusiveMinimum": 0, "maximum": 1_000_000},
                   "max_tool_calls": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                   "max_duration_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 10_000_000}},
}
APPROVAL_BODY: Final[Schema] = {
    "type": "object", "required": ["call_id", "decision"],
    "properties": {"call_id": {"type": "string", "maxLength": 256},
                   "decision": {"enum": ["approve", "reject"]}, "reason": {"type": "string", "maxLength": 2000},
                   "grant": GRANT},
}
RESUME_BODY: Final[Schema] = {
    "type": "object",
    "properties": {"max_turns": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                   "max_budget_usd": {"type": "number", "exclusiveMinimum": 0, "maximum": 1_000_000},
                   "max_tool_calls": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                   "max_duration_s": {"type": "number", "exclusiveMinimum": 0}, "stream": {"type": "boolean"}},
}
CANCEL_BODY: Final[Schema] = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 2000}}}
_GLOBS: Final[Schema] = {"type": ["array", "null"], "maxItems": 64, "items": {"type": "string", "minLength": 1,
                                                                             "maxLength": 200}}
_KEY_SCOPE: Final[dict[str, Schema]] = {
    "name": {"type": "string", "minLength": 1, "maxLength": 100},
    "user": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9][A-Za-z0-9_.@:+=/\\-]{0,127}$"},
    "models": _GLOBS, "policies": {"type": ["array", "null"], "maxItems": 64, "items": {"type": "string"}},
    "budget_usd": {"type": ["number", "null"], "minimum": 0, "maximum": 1e9},
    "budget_period": {"enum": ["day", "week", "month", "total"]},
    "rate_limits": {"type": ["object", "null"], "additionalProperties": False, "properties": {
        k: {"type": ["integer", "null"], "minimum": 1} for k in (
            "requests_per_minute", "tokens_per_minute", "requests_per_second", "tokens_per_second", "max_in_flight")}},
    "expires_at": {"type": ["number", "null"]}, "expires_in_s": {"type": ["number", "null"], "minimum": 1},
    "metadata": {"type": ["object", "null"], "maxProperties": 16,
                 "additionalProperties": {"type": "string", "maxLength": 256}},
    "manage_keys": {"type": "boolean"},
}
KEY_CREATE_BODY: Final[Schema] = {"type": "object", "required": ["team", "name"], "additionalProperties": False,
                                  "properties": {"team": {"type": "string", "minLength": 1}, **_KEY_SCOPE}}
KEY_PATCH_BODY: Final[Schema] = {"type": "object", "additionalProperties": False, "minProperties": 1,
                                 "properties": _KEY_SCOPE}
ROTATE_BODY: Final[Schema] = {"type": "object", "additionalProperties": False,
                              "properties": {"grace_s": {"type": "number", "minimum": 0, "maximum": 604800}}}
KEY_ID: Final[Schema] = {"name": "id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64},
                         "description": "A key's id: key_... (issued) or cfg_... (config.yaml)"}
RUN_ID_HEADERS: Final[list[Schema]] = [
    {"name": "X-Run-Id", "in": "header", "required": False,
     "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:\\-]{0,127}$"},
     "description": "The run this call belongs to (per team); absent: a new run."},
    {"name": "X-Policy", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "The policy of a new run (one the team may use); absent: the team's default."},
]
ID_PARAM: Final[Schema] = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
TEAM_PARAM: Final[Schema] = {"name": "team", "in": "query", "required": False, "schema": {"type": "string"},
                             "description": "Whose run of that id, when several teams the caller sees have one."}


@dataclass(frozen=True)
class Operation:
    """What one route does, for the document."""

    summary: str
    tag: str
    body: Schema | None = None
    auth: bool = True
    ok: tuple[str, ...] = ("application/json",)
    parameters: list[Schema] = field(default_factory=list)
    errors: tuple[int, ...] = (400, 401, 404)
    status: int = 200
    """The status of a success (201: something was created)."""
    links: dict[str, Any] = field(default_factory=dict)
    """OpenAPI links of the success answer (what a client may call next with its fields)."""


OPERATIONS: Final[dict[tuple[str, str], Operation]] = {
    ("POST", "/v1/chat/completions"): Operation(
        "A governed chat completion: pass-through, or a server-side run when the run's policy has tools",
        "chat", CHAT_BODY, ok=JSON_OR_SSE, parameters=RUN_ID_HEADERS, errors=(400, 401, 403, 404, 409, 413, 429, 502, 503, 504)),
    ("POST", "/v1/responses"): Operation(
        "A governed Responses-API call (translated onto chat-completions upstreams)", "responses", RESPONSES_BODY,
        ok=JSON_OR_SSE, parameters=RUN_ID_HEADERS, errors=(400, 401, 403, 404, 409, 413, 429, 502, 503, 504)),
    ("GET", "/v1/responses/{id}"): Operation("A stored response of the caller's team", "responses",
                                             parameters=[ID_PARAM]),
    ("DELETE", "/v1/responses/{id}"): Operation("Forget a stored response", "responses", parameters=[ID_PARAM]),
    ("POST", "/v1/embeddings"): Operation("Embeddings, forwarded and paid from the run's and team's budgets",
                                          "embeddings", OBJECT, parameters=RUN_ID_HEADERS,
                                          errors=(400, 401, 404, 429, 502, 503)),
    ("GET", "/v1/models"): Operation("The models this gateway routes", "models"),
    ("GET", "/v1/models/{model}"): Operation(
        "One routed model", "models",
        parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
    ("GET", "/v1/runs"): Operation(
        "Runs the caller may see, newest first", "runs",
        parameters=[{"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
                    for n in ("status", "team", "policy", "limit")]),
    ("GET", "/v1/runs/{id}"): Operation("A run with its transcript", "runs", parameters=[ID_PARAM, TEAM_PARAM],
                                        errors=(400, 401, 404, 409)),
    ("GET", "/v1/runs/{id}/events"): Operation(
        "The run's trace (JSONL; `follow=1`: SSE until the run stops)", "runs", ok=("application/x-ndjson", SSE),
        parameters=[ID_PARAM, TEAM_PARAM, {"name": "after", "in": "query", "required": False,
                                           "schema": {"type": "integer", "minimum": 0}},
                    {"name": "follow", "in": "query", "required": False, "schema": {"type": "string"}}],
        errors=(400, 401, 404, 409)),
    ("POST", "/v1/runs/{id}/approvals"): Operation("Approve or reject the call (or limit request) a run waits for "
                                                   "(approvers)",
                                                   "runs", APPROVAL_BODY, parameters=[ID_PARAM, TEAM_PARAM],
                                                   errors=(400, 401, 403, 404, 409)),
    ("POST", "/v1/runs/{id}/resume"): Operation("Continue a run, optionally with raised limits (owner, admins)",
                                                "runs", RESUME_BODY, ok=JSON_OR_SSE, parameters=[ID_PARAM, TEAM_PARAM],
                                                errors=(400, 401, 403, 404, 409, 429, 502, 503)),
    ("POST", "/v1/runs/{id}/cancel"): Operation("Stop a run, its running tool included (owner, admins)", "runs",
                                                CANCEL_BODY, parameters=[ID_PARAM, TEAM_PARAM],
                                                errors=(400, 401, 403, 404, 409)),
    ("POST", "/v1/admin/reload"): Operation("Reload the policy files (admin teams)", "admin",
                                            errors=(401, 403, 409)),
    ("POST", "/v1/admin/keys"): Operation(
        "Issue a key (admins; a key manager for its own team); the secret is in this answer only", "keys",
        KEY_CREATE_BODY, errors=(400, 401, 403, 409, 413), status=201,
        links={name: {"operationId": op, "parameters": {"id": "$response.body#/id"}} for name, op in (
            ("GetKey", "get_v1_admin_keys_id"), ("UpdateKey", "patch_v1_admin_keys_id"),
            ("RotateKey", "post_v1_admin_keys_id_rotate"), ("RevokeKey", "delete_v1_admin_keys_id"))}),
    ("GET", "/v1/admin/keys"): Operation(
        "Keys the caller may manage, by id (no secrets)", "keys",
        parameters=[{"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
                    for n in ("team", "user", "include_revoked", "after", "limit")], errors=(400, 401, 403)),
    ("GET", "/v1/admin/keys/{id}"): Operation("One key's record, with its budget this period", "keys",
                                              parameters=[KEY_ID], errors=(401, 403, 404)),
    ("PATCH", "/v1/admin/keys/{id}"): Operation("Change a key's name, scope, budget, limits, expiry or metadata",
                                                "keys", KEY_PATCH_BODY, parameters=[KEY_ID],
                                                errors=(400, 401, 403, 404, 409, 413)),
    ("DELETE", "/v1/admin/keys/{id}"): Operation("Revoke a key (the record stays)", "keys", parameters=[KEY_ID],
                                                 errors=(401, 403, 404, 409)),
    ("POST", "/v1/admin/keys/{id}/rotate"): Operation(
        "A new secret for the key; the old one works for grace_s more seconds", "keys", ROTATE_BODY,
        parameters=[KEY_ID], errors=(400, 401, 403, 404, 409, 413)),
    ("GET", "/v1/admin/audit"): Operation(
        "The audit log, oldest first (admin teams)", "audit",
        parameters=[{"name": "since", "in": "query", "required": False, "schema": {"type": "number", "minimum": 0}},
                    *({"name": n, "in": "query", "required": False, "schema": {"type": "string", "maxLength": 64}}
                      for n in ("action", "team")),
                    {"name": "after", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0}},
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}],
        errors=(400, 401, 403)),
    ("GET", "/v1/spend"): Operation(
        "Spend grouped by team, key, user, model, policy or day (a team sees its own; admins every team's)",
        "spend", ok=("application/json", "text/csv"),
        parameters=[{"name": "group_by", "in": "query", "required": False, "schema": {"type": "string"},
                     "description": "comma-separated: team, key, user, model, policy, day"},
                    *({"name": n, "in": "query", "required": False,
                       "schema": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}} for n in ("from", "to")),
                    {"name": "team", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 64}},
                    {"name": "format", "in": "query", "required": False, "schema": {"enum": ["json", "csv"]}}],
        errors=(400, 401, 403)),
    ("GET", "/metrics"): Operation("Prometheus metrics (OpenMetrics with run-id exemplars when asked)", "operations",
                                   auth=False, ok=("text/plain", "application/openmetrics-text"), errors=(401,)),
    ("GET", "/livez"): Operation("200 while the process serves (liveness)", "operations", auth=False, errors=()),
    ("GET", "/readyz"): Operation("200 when every readiness check passes (draining, store, spool, policies, mcp), "
                                  "503 naming those that fail", "operations", auth=False, errors=(503,)),
    ("GET", "/healthz"): Operation("The same as /readyz (its older name)", "operations", auth=False, errors=(503,)),
    ("GET", "/openapi.json"): Operation("This document", "operations", auth=False, errors=()),
    ("POST", "/scripted/v1/chat/completions"): Operation(
        "The built-in scripted upstream (tests and demos; a team key or the gateway's own)", "scripted upstream",
        CHAT_BODY, ok=JSON_OR_SSE),
    ("GET", "/scripted/v1/models"): Operation("The scripted upstream's models", "scripted upstream"),
    ("GET", "/scripted/v1/models/{model}"): Operation(
        "One scripted model", "scripted upstream",
        parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
    ("POST", "/scripted/v1/embeddings"): Operation("The scripted upstream's embeddings", "scripted upstream",
                                                   OBJECT),
}
"""Every route the gateway may serve (routes a config leaves out, e.g. the scripted mount,
are simply absent from its document)."""

DESCRIPTIONS: Final[dict[int, str]] = {
    400: "The request is malformed; `param` names the field", 401: "Missing or unknown key",
    403: "The team may not do this", 404: "No such run, model, route or response (for this team)",
    409: "The run cannot take this call now (`x-should-retry` says whether a retry can succeed)",
    413: "Body too large", 429: "A limit refused the call before anything was forwarded",
    502: "The upstream failed or answered malformed",
    503: "The store is unavailable, or this process is not ready or holds too many connections (retryable)",
    504: "The upstream timed out",
}


CONSOLE_PREFIX: Final = "/console"
"""The web console's page and routes: left out of the document on purpose (they serve the
page, authenticated by its session cookie; clients use the /v1 routes they mirror)."""


def routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path template) of every API route `app` serves (HEAD twins of GETs and the
    console's routes left out)."""
    out: list[tuple[str, str]] = []
    for route in app.router.routes():
        resource = route.resource
        if resource is None or route.method == "HEAD":
            continue
        if resource.canonical == CONSOLE_PREFIX or resource.canonical.startswith(CONSOLE_PREFIX + "/"):
            continue
        key = (route.method, resource.canonical)
        if key not in out:
            out.append(key)
    return out


def document(app: web.Application) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`'s routes (KeyError: a route nobody described)."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes(app):
        op = OPERATIONS[(method, path)]
        entry: dict[str, Any] = {
            "summary": op.summary, "tags": [op.tag], "operationId": _operation_id(method, path),
            "responses": {str(op.status): {"description": "Created" if op.status == 201 else "OK",
                                           "content": {kind: {"schema": OBJECT} for kind in op.ok},
                                           **({"links": op.links} if op.links else {})},
                          **{str(code): {"description": DESCRIPTIONS[code],
                                         "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
                             for code in op.errors}},
        }
        if op.parameters:
            entry["parameters"] = op.parameters
        body = op.body
        if body is KEY_CREATE_BODY:  # the teams a key may be issued for are this config's
            teams = [t.name for t in app[ctx.LIVE].config.teams]
            body = {**body, "properties": {**body["properties"], "team": {"enum": teams}}}
        if body is not None:
            entry["requestBody"] = {"required": method in ("POST", "PATCH") and op.body is not CANCEL_BODY
                                    and op.body is not RESUME_BODY and op.body is not ROTATE_BODY,
                                    "content": {"application/json": {"schema": body}}}
        if not op.auth:
            entry["security"] = []
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "gateway", "version": __version__,
                 "description": "An OpenAI-compatible gateway that governs agent runs (docs/http-api.md)."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                       "schemas": {"Error": ERROR, "Run": RUN}},
    }


def _operation_id(method: str, path: str) -> str:
    words = [w.strip("{}") for w in path.strip("/").replace("-", "_").split("/") if w]
    return method.lower() + "_" + "_".join(words).replace(".", "_")


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json (no key needed: it names routes, not data)."""
    return web.Response(body=orjson.dumps(document(request.app)), content_type="application/json")
