"""What a key may reach, checked at the edge before anything is counted: its models, and the
user a call is attributed to.

- Model access: the team's `models:` and the key's `models:` (globs) must both let the
  model through; otherwise 403 `model_not_allowed`, naming the model, before the call is
  admitted (nothing is held, counted or forwarded).
- The call's user: the key's `user`, else the body's `user` field (chat, Responses,
  embeddings), else the `X-Gateway-User` header; 1-128 letters, digits and `_ . @ : + = / -`
  (400 `invalid_value` otherwise). A key with a `user` cannot be overridden: a body or
  header naming another user is 403 `user_not_allowed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.config.keys import check_user, models_allow
from gateway.config.settings import TeamConfig
from gateway.server.http.errors import Forbidden, InvalidField

USER_HEADER: Final = "X-Gateway-User"


def may_use_model(team: TeamConfig, model: str) -> bool:
    """Whether the team (a view: its key too) may call `model`."""
    caller = team.caller
    return models_allow(team.models, model) and (caller is None or models_allow(caller.models, model))


def require_model(team: TeamConfig, model: str) -> None:
    """403 `model_not_allowed` unless the team and its key may call `model`."""
    if team.models is None and (team.caller is None or team.caller.models is None):
        return  # the usual team: no allow-list, nothing to match
    if may_use_model(team, model):
        return
    caller = team.caller
    allowed = team.models if caller is None or caller.models is None else caller.models
    whose = "this key" if caller is not None and caller.models is not None and not models_allow(caller.models, model) \
        else f"team '{team.name}'"
    raise Forbidden(f"model '{model}' is not allowed for {whose} (allowed: {', '.join(allowed or ())}); nothing was "
                    "counted or forwarded", code="model_not_allowed", param="model")


def call_user(team: TeamConfig, body: Mapping[str, Any] | None, headers: Mapping[str, str]) -> str | None:
    """The call's user (see the module's docstring), or None when nothing names one."""
    given_body = None if body is None else body.get("user")
    from_body = _checked(given_body, "user") if given_body not in (None, "") else None
    given_header = headers.get(USER_HEADER)
    from_header = _checked(given_header, USER_HEADER) if given_header else None
    fixed = team.caller.user if team.caller is not None else None
    if fixed is not None:
        for other, where in ((from_body, "user"), (from_header, USER_HEADER)):
            if other is not None and other != fixed:
                raise Forbidden(f"this key's calls belong to user '{fixed}'; {where} '{other}' cannot change that",
                                code="user_not_allowed", param=where)
        return fixed
    return from_body or from_header


def _checked(value: object, where: str) -> str:
    user = check_user(value)
    if user is None:
        raise InvalidField(where, f"{where} must be 1-128 letters, digits, '_', '.', '@', ':', '+', '=', '/' or '-', starting "
                                  "with a letter or digit")
    return user
