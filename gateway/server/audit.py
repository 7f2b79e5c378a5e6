"""The audit log's small API for the rest of the gateway: who acted, what changed, recorded.

Every administrative act is one `AuditEntry` (gateway.store.audit) written in the same store
step as the change it records: a store write that changes something takes the entries with
it (`Store.put_key(..., audit=)`, `Store.commit_turn(..., audit=)`,
`Store.put_session(..., audit=)`). An act that changes nothing in the store itself (a
config reload, a cancel handed to another replica) is recorded on its own with `record`.

    entry(team, ACTION, target, concerns=..., details=changed(old, new))
    await record(store, team, ACTION, target, ...)

`team` is the caller's view (its `caller` names the key): the actor is the team and the
key's id, never a secret. `concerns` is the team the act is about (a run's or a key's team),
for `GET /v1/admin/audit?team=`. `details` holds `{"field": [old, new]}` for changes of limits
and scope (`changed`). The actions are `ACTIONS`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from gateway.config.settings import TeamConfig
from gateway.store.audit import AuditEntry
from gateway.store.base import Store
from gateway.store.errors import StoreError

log = logging.getLogger(__name__)

KEY_CREATED: Final = "key.created"
KEY_UPDATED: Final = "key.updated"
KEY_ROTATED: Final = "key.rotated"
KEY_REVOKED: Final = "key.revoked"
APPROVAL_DECIDED: Final = "approval.decided"
LIMIT_GRANTED: Final = "limit.granted"
LIMIT_REJECTED: Final = "limit.rejected"
RUN_RESUMED: Final = "run.resumed_with_limits"
RUN_CANCELLED: Final = "run.cancelled"
CONFIG_RELOADED: Final = "config.reloaded"
SIGNED_IN: Final = "console.signed_in"
SIGNED_OUT: Final = "console.signed_out"
ACTIONS: Final = (KEY_CREATED, KEY_UPDATED, KEY_ROTATED, KEY_REVOKED, APPROVAL_DECIDED, LIMIT_GRANTED, LIMIT_REJECTED,
                  RUN_RESUMED, RUN_CANCELLED, CONFIG_RELOADED, SIGNED_IN, SIGNED_OUT)
"""Every action the gateway records (other code may record actions of its own: a string with a dot)."""


def actor(team: TeamConfig | None) -> tuple[str, str]:
    """(team, key id) of a caller's view; the gateway itself (a signal, a timer) is ("", "")."""
    if team is None:
        return "", ""
    return team.name, "" if team.caller is None else team.caller.key_id


def entry(team: TeamConfig | None, action: str, target: str, *, concerns: str = "",
          details: Mapping[str, Any] | None = None) -> AuditEntry:
    """One act of `team` (its key) on `target`, about team `concerns`."""
    actor_team, actor_key = actor(team)
    return AuditEntry(action, actor_team, actor_key, target, concerns, dict(details or {}))


def changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, list[Any]]:
    """`{"field": [old, new]}` for every field of `new` whose value differs from `old`'s."""
    return {k: [old.get(k), v] for k, v in new.items() if old.get(k) != v}


async def record(store: Store, team: TeamConfig | None, action: str, target: str, *, concerns: str = "",
                 details: Mapping[str, Any] | None = None) -> bool:
    """Record an act that is not itself a store write; False (and a log line) when the store
    cannot take it: the act happened, the log says so."""
    try:
        await store.append_audit([entry(team, action, target, concerns=concerns, details=details)])
    except StoreError as exc:
        log.error("cannot record %s of %s by %s in the audit log: %s", action, target, actor(team), exc)
        return False
    return True
