"""The admin keys API: issue, list, change, rotate and revoke keys without a restart.

    POST   /v1/admin/keys                 {team, name, user?, models?, policies?, budget_usd?, budget_period?,
                                           rate_limits?, expires_at? | expires_in_s?, metadata?, manage_keys?}
                                          -> 201 the record + "key" (the secret: shown here only) + "warnings"
    GET    /v1/admin/keys?team=&user=&include_revoked=&after=&limit=   -> a page of records, by id
    GET    /v1/admin/keys/{id}            -> the record (+ what its budget has spent this period)
    PATCH  /v1/admin/keys/{id}            {name?, user?, models?, policies?, budget_usd?, budget_period?,
                                           rate_limits?, expires_at? | expires_in_s?, metadata?, manage_keys?}
    DELETE /v1/admin/keys/{id}            -> revoked (the record stays, with revoked_at)
    POST   /v1/admin/keys/{id}/rotate     {grace_s?} -> the record + "key": a new secret; the old one works
                                          for grace_s more seconds (0 to 7 days, default 0)

Who may (docs/keys.md#who-may-do-what): keys of admin teams, for every team; a key with
`manage_keys: true` for its own team only, never granting more than it has itself (its
models, policies and budget, within its team's); no key widens its own scope. Anyone else:
403 `not_a_key_manager`; a key manager asking for another team's key id: 404. Config keys
are listed and shown as read-only records (`source: config`): changing them is 409
`key_read_only` (edit config.yaml). Every change is written with its audit record in one
store step, and this process's keyring knows it at once (the others within `auth.SYNC_S`).
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.config.fields import ConfigError, Field
from gateway.config.keys import MAX_GLOB_CHARS, MAX_GLOBS, check_user, glob_within, key_scope_of
from gateway.config.rates import RateLimits, parse_rate_limits
from gateway.config.settings import BUDGET_PERIODS, TeamConfig
from gateway.server import audit
from gateway.server import context as ctx
from gateway.server.http.errors import BadRequest, Conflict, Forbidden, InvalidField, NotFound
from gateway.server.http.validation import check_depth, json_object, kind, query_int, read_body, wrong_type
from gateway.store.base import Hold
from gateway.store.errors import KeyExists, StaleKey
from gateway.store.keys import KeyRecord, new_key_id, new_secret, secret_hash, visible_prefix

MAX_BODY: Final = 64 * 1024
MAX_NAME: Final = 100
MAX_METADATA: Final = 16
MAX_METADATA_KEY: Final = 64
MAX_METADATA_VALUE: Final = 256
MAX_POLICIES: Final = 64
MAX_BUDGET_USD: Final = 1_000_000_000.0
MAX_GRACE_S: Final = 7 * 86_400
MAX_LIFETIME_S: Final = 10 * 366 * 86_400
MAX_ID: Final = 64
LIST_LIMIT: Final = 200
WRITE_ATTEMPTS: Final = 8
"""A change retried on a fresh copy when another one was written in between (StaleKey)."""

SCOPE: Final = ("user", "models", "policies", "budget_usd", "budget_period", "rate_limits", "expires_at",
                "manage_keys")
FIELDS: Final = frozenset({"name", "metadata", "expires_in_s", *SCOPE})
CREATE_FIELDS: Final = FIELDS | {"team"}


def _answer(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def _body(request: web.Request, allowed: frozenset[str], *, optional: bool = False) -> dict[str, Any]:
    raw = await read_body(request, min(MAX_BODY, request.app[ctx.LIVE].config.server.max_body_bytes))
    if optional and not raw.strip():
        return {}
    body = json_object(raw, "a JSON object")
    check_depth(body, 8)
    for name in body:
        if name not in allowed:
            raise InvalidField(name[:64], f"unknown field {name[:64]!r}; this route takes "
                                          f"{', '.join(sorted(allowed))}", "unsupported_field")
    return body


# --- reading the fields ---------------------------------------------------------------------


def _globs(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise wrong_type(where, "an array of model globs, or null", value)
    if len(value) > MAX_GLOBS:
        raise InvalidField(where, f"{where} lists {len(value)} globs; at most {MAX_GLOBS}")
    for i, g in enumerate(value):
        if not isinstance(g, str) or not g or len(g) > MAX_GLOB_CHARS:
            raise InvalidField(f"{where}[{i}]", f"{where}[{i}] must be a glob of 1 to {MAX_GLOB_CHARS} characters, "
                                                f"got {kind(g)}", "invalid_type" if not isinstance(g, str)
                               else "invalid_value")
    return tuple(value)


def _expiry(body: Mapping[str, Any], now: float) -> tuple[bool, float | None]:
    """(given, expires_at) from `expires_at` (epoch s) or `expires_in_s`; null clears it."""
    if "expires_at" in body and "expires_in_s" in body:
        raise InvalidField("expires_in_s", "give expires_at or expires_in_s, not both")
    if "expires_in_s" in body:
        value = body["expires_in_s"]
        if value is None:
            return True, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise wrong_type("expires_in_s", f"a number of seconds from 1 to {MAX_LIFETIME_S}", value)
        if not 1 <= value <= MAX_LIFETIME_S:
            raise InvalidField("expires_in_s", f"expires_in_s must be from 1 to {MAX_LIFETIME_S} seconds, got {value}")
        return True, now + float(value)
    if "expires_at" in body:
        value = body["expires_at"]
        if value is None:
            return True, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise wrong_type("expires_at", "a time in epoch seconds", value)
        if value <= now:
            raise InvalidField("expires_at", f"expires_at ({value}) is in the past; a key must expire after now "
                                             f"({now:.0f})")
        if value > now + MAX_LIFETIME_S:
            raise InvalidField("expires_at", f"expires_at must be within {MAX_LIFETIME_S} seconds of now")
        return True, float(value)
    return False, None


def _fields(body: Mapping[str, Any], team: TeamConfig, now: float) -> dict[str, Any]:
    """The given fields of a create or a change, checked and normalised (absent: not given)."""
    out: dict[str, Any] = {}
    if "name" in body:
        name = body["name"]
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
            raise InvalidField("name", f"name must be a string of 1 to {MAX_NAME} characters, got {kind(name)}",
                               "invalid_type" if not isinstance(name, str) else "invalid_value")
        out["name"] = name.strip()
    if "user" in body:
        user = body["user"]
        if user is not None and check_user(user) is None:
            raise InvalidField("user", "user must be null or 1-128 letters, digits, '_', '.', '@', ':', '+', '=', '/' "
                                       "or '-', starting with a letter or digit")
        out["user"] = user
    if "models" in body:
        out["models"] = _globs(body["models"], "models")
    if "policies" in body:
        value = body["policies"]
        if value is not None:
            if not isinstance(value, list) or len(value) > MAX_POLICIES or not value:
                raise InvalidField("policies", f"policies must be null or a non-empty array of at most {MAX_POLICIES}"
                                               " policy names of the key's team", "invalid_type")
            for i, p in enumerate(value):
                if not isinstance(p, str) or p not in team.policies:
                    raise InvalidField(f"policies[{i}]", f"policies[{i}] must be one of team '{team.name}''s policies "
                                                         f"({', '.join(team.policies)}), got {kind(p)}")
            value = tuple(dict.fromkeys(value))
        out["policies"] = value
    if "budget_usd" in body:
        value = body["budget_usd"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not 0 <= value <= MAX_BUDGET_USD):
            raise InvalidField("budget_usd", f"budget_usd must be null or a number from 0 to {MAX_BUDGET_USD:g}, "
                                             f"got {kind(value)}")
        out["budget_usd"] = None if value is None else float(value)
    if "budget_period" in body:
        value = body["budget_period"]
        if value not in BUDGET_PERIODS:
            raise InvalidField("budget_period", f"budget_period must be one of {', '.join(BUDGET_PERIODS)}, "
                                                f"got {kind(value)}")
        out["budget_period"] = value
    if "rate_limits" in body:
        value = body["rate_limits"]
        if value is not None:
            if not isinstance(value, dict):
                raise wrong_type("rate_limits", "an object like {\"requests_per_minute\": 60}, or null", value)
            try:
                parse_rate_limits(Field("body", "rate_limits", value))
            except ConfigError as exc:
                raise InvalidField(exc.path, f"{exc.path}: {exc.problem}") from None
            value = {k: v for k, v in value.items() if v is not None}
        out["rate_limits"] = value or None
    if "metadata" in body:
        out["metadata"] = _metadata(body["metadata"])
    if "manage_keys" in body:
        value = body["manage_keys"]
        if not isinstance(value, bool):
            raise wrong_type("manage_keys", "a boolean", value)
        out["manage_keys"] = value
    given, expires = _expiry(body, now)
    if given:
        out["expires_at"] = expires
    return out


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type("metadata", f"an object of at most {MAX_METADATA} string values", value)
    if len(value) > MAX_METADATA:
        raise InvalidField("metadata", f"metadata has {len(value)} entries; at most {MAX_METADATA}")
    for k, v in value.items():
        if not k or len(k) > MAX_METADATA_KEY:
            raise InvalidField("metadata", f"a metadata key must be 1 to {MAX_METADATA_KEY} characters")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise InvalidField(f"metadata.{k}", f"metadata.{k} must be a string of at most {MAX_METADATA_VALUE} "
                                                f"characters, got {kind(v)}", "invalid_type" if not isinstance(v, str)
                               else "invalid_value")
    return dict(value)


# --- who may -------------------------------------------------------------------------------


def _require_manager(caller: TeamConfig, team: str | None = None) -> None:
    """403 unless `caller` may manage keys (of `team`)."""
    if caller.admin:
        return
    if caller.caller is None or not caller.caller.manage_keys:
        raise Forbidden(f"this key of team '{caller.name}' may not manage keys: keys of admin teams may, and keys "
                        "with manage_keys: true for their own team", code="not_a_key_manager")
    if team is not None and team != caller.name:
        raise Forbidden(f"this key may manage keys of its own team '{caller.name}' only, not of '{team}'",
                        code="not_a_key_manager", param="team")


def _team(request: web.Request, name: Any) -> TeamConfig:
    if not isinstance(name, str) or not name:
        raise InvalidField("team", f"team must be the name of a team of the config, got {kind(name)}",
                           "invalid_type" if not isinstance(name, str) else "invalid_value")
    team = request.app[ctx.KEYRING].team_of(name)
    if team is None:
        raise InvalidField("team", f"no team named {name[:64]!r} in the gateway's config", "team_not_found")
    return team


def _grant_within(caller: TeamConfig, team: TeamConfig, fields: Mapping[str, Any]) -> None:
    """A key manager (not an admin) grants nothing its own key lacks (its models, policies and
    budget, within its team's): 403 `scope_not_allowed` naming what."""
    if caller.admin:
        return
    own = caller.caller
    assert own is not None
    models = own.models if own.models is not None else team.models
    if "models" in fields:
        wanted = fields["models"]
        if wanted is None and models is not None:
            raise Forbidden(f"this key may only grant models within {list(models)}: models may not be null (every "
                            "model of the team)", code="scope_not_allowed", param="models")
        for g in wanted or ():
            if not glob_within(g, models):
                raise Forbidden(f"this key may not grant model '{g}': not within {list(models or ())}",
                                code="scope_not_allowed", param="models")
    if "policies" in fields:
        wanted = fields["policies"]
        if wanted is None and tuple(caller.policies) != tuple(team.policies):
            raise Forbidden(f"this key may only grant policies within {list(caller.policies)}",
                            code="scope_not_allowed", param="policies")
        for p in wanted or ():
            if p not in caller.policies:
                raise Forbidden(f"this key may not grant policy '{p}' (its own: {', '.join(caller.policies)})",
                                code="scope_not_allowed", param="policies")
    if "budget_usd" in fields:
        cap = own.budget_usd if own.budget_usd is not None else team.budget_usd
        wanted = fields["budget_usd"]
        if cap is not None and (wanted is None or wanted > cap):
            raise Forbidden(f"this key may grant a budget of at most ${cap:.6f} (its own, or its team's)",
                            code="scope_not_allowed", param="budget_usd")


def _not_wider(caller: TeamConfig, old: KeyRecord, fields: Mapping[str, Any]) -> None:
    """No key widens its own scope: 403 `cannot_widen_own_key`."""
    if caller.caller is None or caller.caller.key_id != old.id:
        return

    def refuse(what: str) -> None:
        raise Forbidden(f"a key may not widen its own scope ({what}); ask a key manager or an admin",
                        code="cannot_widen_own_key", param=what)

    if "models" in fields and (fields["models"] is None and old.models is not None
                               or any(not glob_within(g, old.models) for g in fields["models"] or ())):
        refuse("models")
    if "policies" in fields and (fields["policies"] is None and old.policies is not None
                                 or any(old.policies is not None and p not in old.policies
                                        for p in fields["policies"] or ())):
        refuse("policies")
    if "budget_usd" in fields and old.budget_usd is not None and (
            fields["budget_usd"] is None or fields["budget_usd"] > old.budget_usd):
        refuse("budget_usd")
    if "budget_period" in fields and fields["budget_period"] != old.budget_period and old.budget_usd is not None:
        refuse("budget_period")
    if fields.get("manage_keys") and not old.manage_keys:
        refuse("manage_keys")
    if "expires_at" in fields and old.expires_at is not None and (
            fields["expires_at"] is None or fields["expires_at"] > old.expires_at):
        refuse("expires_at")
    if "user" in fields and fields["user"] != old.user:
        refuse("user")
    if "rate_limits" in fields and fields["rate_limits"] != (None if old.rate_limits is None else
                                                             dict(old.rate_limits)):
        refuse("rate_limits")


# --- records -------------------------------------------------------------------------------


def _limits_block(limits: RateLimits | None) -> dict[str, int] | None:
    """A config key's limits in the form the API shows (`requests_per_minute`, ...)."""
    if limits is None:
        return None
    unit = "second" if limits.window_s == 1.0 else "minute"
    out = {f"requests_per_{unit}": limits.requests, f"tokens_per_{unit}": limits.tokens,
           "max_in_flight": limits.max_in_flight}
    return {k: v for k, v in out.items() if v is not None}


def config_records(request: web.Request) -> list[KeyRecord]:
    """The keys of config.yaml as read-only records (no secret, no hash)."""
    out = []
    for team in request.app[ctx.KEYRING].teams():
        for ck in team.config_keys:
            out.append(KeyRecord(ck.id, team.name, ck.name, "", "", 0.0, "config.yaml", ck.user,
                                 models=ck.models, budget_usd=ck.budget_usd, budget_period=ck.budget_period,
                                 rate_limits=_limits_block(ck.limits), manage_keys=ck.manage_keys, source="config"))
    return sorted(out, key=lambda r: r.id)


async def _record(request: web.Request, caller: TeamConfig) -> KeyRecord:
    """The key of the path (store or config), or 404 (for a key manager: another team's too)."""
    key_id = request.match_info["id"]
    if len(key_id) > MAX_ID:
        raise NotFound(f"no key with id {key_id[:MAX_ID]!r}...", code="key_not_found")
    record: KeyRecord | None
    if key_id.startswith("cfg_"):
        record = next((r for r in config_records(request) if r.id == key_id), None)
    else:
        record = await request.app[ctx.STORE].get_key(key_id)
    if record is None or (not caller.admin and record.team != caller.name):
        raise NotFound(f"no key with id {key_id!r}", code="key_not_found")
    return record


def _writable(record: KeyRecord) -> None:
    if record.source == "config":
        raise Conflict(f"key {record.id} is declared in config.yaml: change it there (and reload)",
                       code="key_read_only")


def _warnings(request: web.Request, team: TeamConfig, record: KeyRecord) -> list[str]:
    config = request.app[ctx.LIVE].config
    out = []
    for g in record.models or ():
        if not any(fnmatch.fnmatchcase(r.match, g) or fnmatch.fnmatchcase(g, r.match) for r in config.models):
            out.append(f"model glob '{g}' matches no model this gateway routes")
        elif not glob_within(g, team.models):
            out.append(f"model glob '{g}' is not within team '{team.name}''s models {list(team.models or ())}: the "
                       "team's allow-list still applies")
    return out


async def _budget_view(request: web.Request, record: KeyRecord) -> dict[str, Any]:
    """What the key's budget has spent and holds in its current period."""
    if record.budget_usd is None:
        return {}
    governor = request.app[ctx.GOVERNOR]
    period = governor.period_of(record.budget_period)
    team = request.app[ctx.KEYRING].team_of(record.team)
    hold = Hold("key", key_scope_of(record.id), period, record.budget_usd)
    figures = await request.app[ctx.STORE].figures(record.team, governor.period(team) if team else period, None,
                                                   (hold,))
    spent, reserved = figures.holds[0]
    return {"budget": {"period": period, "spent_usd": round(spent, 6), "reserved_usd": round(reserved, 6),
                       "remaining_usd": round(record.budget_usd - spent - reserved, 6)}}


def _public_changes(old: KeyRecord, new: KeyRecord) -> dict[str, list[Any]]:
    before, after = old.public(), new.public()
    return audit.changed(before, {k: after[k] for k in ("name", *SCOPE, "metadata")})


# --- routes --------------------------------------------------------------------------------


async def create_key(request: web.Request) -> web.Response:
    """POST /v1/admin/keys: issue a key; its secret is in this answer only."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    body = await _body(request, CREATE_FIELDS)
    team = _team(request, body.get("team"))
    _require_manager(caller, team.name)
    if "name" not in body:
        raise InvalidField("name", "name is required (what the key is for, e.g. \"ci\" or \"ana's laptop\")",
                           "missing_field")
    now = time.time()
    fields = _fields(body, team, now)
    _grant_within(caller, team, fields)
    secret = new_secret()
    actor_team, actor_key = audit.actor(caller)
    record = KeyRecord(new_key_id(now), team.name, fields.pop("name"), visible_prefix(secret), secret_hash(secret),
                       now, f"{actor_team}/{actor_key}", **fields)
    entry = audit.entry(caller, audit.KEY_CREATED, record.id, concerns=team.name,
                        details={k: v for k, v in record.public().items()
                                 if k in ("name", "prefix", *SCOPE, "metadata") and v not in (None, {}, False)})
    try:
        stored = await app[ctx.STORE].put_key(record, None, [entry])
    except KeyExists:  # 64 random bits and a millisecond apart: never in practice
        raise Conflict("a key id collided; try again", code="key_conflict",
                       headers={"x-should-retry": "true"}) from None
    app[ctx.KEYRING].learn(stored)
    return _answer({**stored.public(), "key": secret, "warnings": _warnings(request, team, stored)}, 201)


async def list_keys(request: web.Request) -> web.Response:
    """GET /v1/admin/keys?team=&user=&include_revoked=&after=&limit=: records by id (no secrets)."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    q = request.query
    team = q.get("team") or (None if caller.admin else caller.name)
    if team is not None:
        _require_manager(caller, team)
        _team(request, team)
    user = q.get("user") or None
    include_revoked = _flag(q.get("include_revoked"), "include_revoked")
    after = q.get("after", "")
    if len(after) > MAX_ID:
        raise InvalidField("after", f"after must be a key id (at most {MAX_ID} characters)")
    limit = query_int(q["limit"], "limit", 1, LIST_LIMIT) if "limit" in q else 100
    now = time.time()

    def wanted(r: KeyRecord) -> bool:
        return ((team is None or r.team == team) and (user is None or r.user == user)
                and (include_revoked or r.usable(now)))

    found = [r for r in config_records(request) if r.id > after and wanted(r)]
    cursor = after
    for _ in range(50):  # pages of the store until this one is full (filters may skip many)
        page = await app[ctx.STORE].list_keys(team, after=cursor, limit=LIST_LIMIT)
        found += [r for r in page if wanted(r)]
        if len(page) < LIST_LIMIT or len(found) > limit:
            break
        cursor = page[-1].id
    found.sort(key=lambda r: r.id)
    more = len(found) > limit
    data = found[:limit]
    return _answer({"object": "list", "data": [r.public() for r in data], "has_more": more,
                    "next_after": data[-1].id if more and data else None})


def _flag(raw: str | None, name: str) -> bool:
    if raw is None or raw == "":
        return False
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise InvalidField(name, f"{name} must be true or false, got {raw[:20]!r}")


async def get_key(request: web.Request) -> web.Response:
    """GET /v1/admin/keys/{id}."""
    caller = await request.app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    record = await _record(request, caller)
    return _answer({**record.public(), **await _budget_view(request, record)})


async def update_key(request: web.Request) -> web.Response:
    """PATCH /v1/admin/keys/{id}: change its name, scope, budget, limits, expiry or metadata."""
    app = request.app
    caller = await app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    record = await _record(request, caller)
    body = await _body(request, FIELDS)
    _writable(record)
    team = _team(request, record.team)
    fields = _fields(body, team, time.time())
    if not fields:
        raise BadRequest(f"nothing to change: give one of {', '.join(sorted(FIELDS))}", code="missing_field")
    _grant_within(caller, team, fields)
    _not_wider(caller, record, fields)

    def change(old: KeyRecord) -> tuple[KeyRecord, Sequence[Any]]:
        new = old.with_changes(**fields)
        return new, [audit.entry(caller, audit.KEY_UPDATED, old.id, concerns=old.team,
                                 details=_public_changes(old, new))]

    stored = await _write(request, record, change)
    warnings = _warnings(request, team, stored)
    view = await _budget_view(request, stored)
    budget = view.get("budget")
    if budget is not None and budget["remaining_usd"] < 0:
        warnings.append(f"the key has spent ${budget['spent_usd']:.6f} this period ({budget['period']}), more than "
                        "its budget: its calls are refused until the period turns")
    return _answer({**stored.public(), **view, "warnings": warnings})


async def revoke_key(request: web.Request) -> web.Response:
    """DELETE /v1/admin/keys/{id}: revoke it (the record stays, with revoked_at)."""
    caller = await request.app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    record = await _record(request, caller)
    _writable(record)
    if record.revoked_at is not None:
        return _answer(record.public())  # revoked already: nothing changes, nothing to record

    def change(old: KeyRecord) -> tuple[KeyRecord, Sequence[Any]]:
        new = old.with_changes(revoked_at=old.revoked_at or time.time())
        return new, [audit.entry(caller, audit.KEY_REVOKED, old.id, concerns=old.team,
                                 details={"name": old.name, "revoked_at": [None, new.revoked_at]})]

    return _answer((await _write(request, record, change)).public())


async def rotate_key(request: web.Request) -> web.Response:
    """POST /v1/admin/keys/{id}/rotate {grace_s?}: a new secret for the same record."""
    caller = await request.app[ctx.KEYRING].authenticate(request)
    _require_manager(caller)
    record = await _record(request, caller)
    body = await _body(request, frozenset({"grace_s"}), optional=True)
    _writable(record)
    grace = body.get("grace_s", 0)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace):
        raise wrong_type("grace_s", f"a number of seconds from 0 to {MAX_GRACE_S}", grace)
    if not 0 <= grace <= MAX_GRACE_S:
        raise InvalidField("grace_s", f"grace_s must be from 0 to {MAX_GRACE_S} seconds (7 days), got {grace}")
    secret = new_secret()

    def change(old: KeyRecord) -> tuple[KeyRecord, Sequence[Any]]:
        if old.revoked_at is not None:
            raise Conflict(f"key {old.id} is revoked: issue a new key instead", code="key_revoked")
        now = time.time()
        new = old.with_changes(secret_hash=secret_hash(secret), prefix=visible_prefix(secret),
                               previous_hash=old.secret_hash if grace > 0 else None,
                               previous_until=now + grace if grace > 0 else None, generation=old.generation + 1)
        return new, [audit.entry(caller, audit.KEY_ROTATED, old.id, concerns=old.team,
                                 details={"name": old.name, "prefix": [old.prefix, new.prefix], "grace_s": grace})]

    stored = await _write(request, record, change)
    return _answer({**stored.public(), "key": secret})


async def _write(request: web.Request, record: KeyRecord, change: Any) -> KeyRecord:
    """`change(record)` -> (new record, audit entries), written in one store step; on a
    concurrent change, read the key again and apply the change to it."""
    store = request.app[ctx.STORE]
    current = record
    for _ in range(WRITE_ATTEMPTS):
        new, entries = change(current)
        try:
            stored = await store.put_key(new, current.revision, entries)
        except StaleKey:
            fresh = await store.get_key(record.id)
            if fresh is None:
                break
            current = fresh
            continue
        request.app[ctx.KEYRING].learn(stored)
        return stored
    raise Conflict(f"key {record.id} is being changed by others at the same time; retry", code="key_conflict",
                   headers={"x-should-retry": "true"})
