"""Run keying and run updates for calls that arrive over HTTP.

`resolve_call` turns (team, X-Run-Id, X-Policy, body) into a `Call`: the run is loaded,
or created for the caller's team on its first call (an OpenAI client sends a fixed
X-Run-Id default header, so its first call creates the run). Everything that can be
refused is checked before anything is written: a bad request leaves the store unchanged.

`update_run` applies a change with optimistic concurrency: on `StaleRun` it reloads and
applies the same change again, so concurrent calls of one run never lose a turn.
`commit_run` does the same for a change that comes with trace lines and a ledger booking
(`Store.commit_turn`): a refused attempt wrote nothing, so the retry books exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway.config.settings import ModelRoute, TeamConfig
from gateway.harness.state import (
    Interruption,
    Message,
    RunState,
    Status,
    new_run_id,
    scoped_run_id,
)
from gateway.harness.usage import Usage
from gateway.policy.decl import Policy
from gateway.policy.registry import PolicyRegistry
from gateway.server.http.chat_request import ChatRequest
from gateway.server.http.errors import (
    ApiError,
    Conflict,
    Forbidden,
    InvalidField,
    NotFound,
    PolicyMismatch,
)
from gateway.server.http.headers import run_headers
from gateway.server.runs.run_cache import RunCache
from gateway.store.audit import AuditEntry
from gateway.store.base import Booking, Event, Lease, Ledger, Store
from gateway.store.errors import RunExists, StaleRun

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
UPDATE_ATTEMPTS = 32
T = TypeVar("T")


@dataclass
class Call:
    """One authenticated, validated chat-completions call and the run it belongs to."""

    team: TeamConfig
    policy: Policy
    run: RunState
    created: bool
    chat: ChatRequest
    route: ModelRoute
    stored: bool = True
    """False for a new pass-through run whose first admission stores it (`Claim.create`)."""
    cached: bool = False
    """True when `run` came from this process's `RunCache`, not from the store: its admission
    must find the stored revision equal (`passthrough.admit`)."""
    blind: bool = False
    """True when `run` is new because the store was not asked (`Store.lookup_in_admission`):
    its admission stores it, or finds the stored run (`join_created`)."""
    user: str | None = None
    """The call's user (`http.scope.call_user`): its spend and its user budget."""


class ServerSideRun(Exception):
    """A blind call (`Call.blind`) found its run stored under a server-side policy: the
    endpoint hands the call to the run's loop instead."""


def run_id_from(headers: Mapping[str, str]) -> str | None:
    """X-Run-Id if given (checked), else None."""
    value = headers.get("X-Run-Id")
    if value is None or value == "":
        return None
    if not RUN_ID.match(value):
        raise InvalidField("X-Run-Id", "X-Run-Id must be 1-128 characters of letters, digits, '_', '-', '.', ':' "
                           "starting with a letter or digit", "invalid_value")
    return value


async def resolve_call(store: Store, policies: PolicyRegistry, team: TeamConfig, headers: Mapping[str, str],
                       chat: ChatRequest, route: ModelRoute, *, defer_create: bool = False,
                       cache: RunCache | None = None, user: str | None = None) -> Call:
    call = await _resolve(store, policies, team, headers, chat, route, defer_create, cache, user)
    call.user = user
    return call


async def _resolve(store: Store, policies: PolicyRegistry, team: TeamConfig, headers: Mapping[str, str],
                   chat: ChatRequest, route: ModelRoute, defer_create: bool, cache: RunCache | None,
                   user: str | None) -> Call:
    """Load or create the call's run; 404 for another team's run, 403/400 for policy problems.
    With `defer_create`, a new run of a pass-through policy is not stored here but by its
    first admission, in the same store step (`Call.stored` False; see `join_created`).
    With `cache`, a pass-through run this process booked last is taken from it instead of
    the store (`Call.cached`; its admission checks it against the stored revision). With
    `defer_create` and a store whose `lookup_in_admission`, a run that is not cached is not
    loaded either when the call would start a pass-through run (`Call.blind`): its
    admission stores it or finds the stored one."""
    given = run_id_from(headers)
    run_id = scoped_run_id(team.name, given) if given is not None else None  # ids are per team
    wanted = headers.get("X-Policy") or None
    run = cache.get(run_id) if cache is not None and run_id is not None else None
    if run is not None:
        try:
            policy = _existing_run_policy(policies, team, run, wanted)
        except ApiError:
            policy = None  # refused: the stored run decides it, and its figures go with the error
        if policy is not None and not policy.server_side:
            return Call(team, policy, run, False, chat, route, cached=True)
    if run_id is not None and defer_create and store.lookup_in_admission:
        try:
            policy = _new_run_policy(policies, team, wanted)
        except ApiError:
            policy = None  # not a new run's policy: only a stored run can take the call
        if policy is not None and not policy.server_side:
            return Call(team, policy, _new_run(team, policy, chat, run_id, user), True, chat, route, stored=False,
                        blind=True)
    run = await store.load_run(run_id) if run_id is not None else None
    if run is None:
        policy = _new_run_policy(policies, team, wanted)
        run = _new_run(team, policy, chat, run_id or scoped_run_id(team.name, new_run_id()), user)
        if defer_create and not policy.server_side:
            return Call(team, policy, run, True, chat, route, stored=False)
        try:
            await store.create_run(run)
            return Call(team, policy, run, True, chat, route)
        except RunExists:  # a concurrent first call created it: join that run
            loaded = await store.load_run(run.run_id)
            if loaded is None:
                raise
            run = loaded
    return Call(team, _stored_run_policy(policies, team, run, wanted), run, False, chat, route)


def _new_run(team: TeamConfig, policy: Policy, chat: ChatRequest, run_id: str, user: str | None) -> RunState:
    return RunState.new(chat.model, list(chat.messages), run_id=run_id, team=team.name, policy=policy.name,
                        policy_version=policy.version, limits=policy.limits,
                        key_id="" if team.caller is None else team.caller.key_id, user=user)


def _stored_run_policy(policies: PolicyRegistry, team: TeamConfig, run: RunState, wanted: str | None) -> Policy:
    """`_existing_run_policy`; a refusal of the caller's own run carries its figures."""
    try:
        return _existing_run_policy(policies, team, run, wanted)
    except ApiError as exc:
        if run.team == team.name:
            exc.headers.update(run_headers(run))
        raise


async def join_created(store: Store, policies: PolicyRegistry, call: Call, stored: RunState | None = None,
                       wanted: str | None = None) -> None:
    """A concurrent first call stored `call`'s new run first (RunExists), `call`'s cached run
    was out of date, or a blind call's run was stored (RunExists, `stored`: the run as the
    admission read it): go on with the stored run, as a call to an existing run (its policy
    checked as `resolve_call` does, against X-Policy `wanted` for a blind call).
    ServerSideRun when a blind call's run is a server-side one."""
    loaded = stored if stored is not None else await store.load_run(call.run.run_id)
    if loaded is None:
        if call.cached:
            raise NotFound(f"run {call.run.public_id} not found", code="run_not_found", param="X-Run-Id")
        raise RunExists(call.run.run_id)
    blind = call.blind
    call.policy = _stored_run_policy(policies, call.team, loaded, wanted) if blind else _existing_run_policy(
        policies, call.team, loaded, None)
    call.run, call.created, call.stored, call.cached, call.blind = loaded, False, True, False, False
    if blind and call.policy.server_side:
        raise ServerSideRun(loaded.run_id)


def _new_run_policy(policies: PolicyRegistry, team: TeamConfig, wanted: str | None) -> Policy:
    name = wanted or team.default_policy
    if name not in team.policies:
        raise Forbidden(f"policy '{name}' is not allowed for team '{team.name}' (allowed: {', '.join(team.policies)})",
                        code="policy_not_allowed", param="X-Policy")
    policy = policies.get(name)
    if policy is None:
        raise NotFound(f"policy '{name}' is not loaded by this gateway (loaded: {', '.join(policies.names())})",
                       code="policy_not_found", param="X-Policy")
    return policy


def _existing_run_policy(policies: PolicyRegistry, team: TeamConfig, run: RunState, wanted: str | None) -> Policy:
    if run.team != team.name:
        raise NotFound(f"run {run.public_id} not found", code="run_not_found", param="X-Run-Id")
    if wanted is not None and wanted != run.policy:
        raise PolicyMismatch(f"run {run.public_id} is governed by policy '{run.policy}'; X-Policy '{wanted}' cannot "
                             "change it (omit X-Policy, or start a new run)")
    policy = policies.for_run(run.policy, run.policy_version)
    if policy is None:
        raise Conflict(f"run {run.public_id} is governed by policy '{run.policy}', which is no longer loaded",
                       code="policy_not_found")
    return policy


async def update_run(store: Store, run: RunState, change: Callable[[RunState], None]) -> RunState:
    """Apply `change` and save; on a concurrent save, reload and apply it again."""

    async def save(r: RunState) -> RunState:
        change(r)
        await store.save_run(r)
        return r

    return await _retrying(store, run, save, UPDATE_ATTEMPTS)


async def commit_run(store: Store, run: RunState, change: Callable[[RunState], None],
                     trace: Callable[[RunState], list[Event]], booking: Booking | None,
                     attempts: int = UPDATE_ATTEMPTS,
                     audit: Callable[[RunState], Sequence[AuditEntry]] | None = None, *,
                     lease: Lease | None = None,
                     ) -> tuple[RunState, list[Event], Ledger | None]:
    """Apply `change`, then save it with `trace(run)`'s lines, `booking` and `audit(run)`'s
    records (the act the change is) in one store step (under `lease`, when given: all of it
    or none); on a concurrent save, reload and do it again. Returns the run, the lines and
    the ledger."""

    async def commit(r: RunState) -> tuple[RunState, list[Event], Ledger | None]:
        change(r)
        events = trace(r)
        return r, events, await store.commit_turn(r, events, booking, audit=() if audit is None else audit(r),
                                                  lease=lease)

    return await _retrying(store, run, commit, attempts)


async def _retrying(store: Store, run: RunState, attempt: Callable[[RunState], Awaitable[T]], attempts: int) -> T:
    """`attempt(run)` until no concurrent save got in first (StaleRun: reload, try again), or 409."""
    for _ in range(attempts):
        try:
            return await attempt(run)
        except StaleRun:
            fresh = await store.load_run(run.run_id)
            if fresh is None:
                raise
            run = fresh
    raise Conflict(f"run {run.public_id} is being changed by too many calls at once; retry", code="run_contended",
                   headers={"x-should-retry": "true", "retry-after": "1"})


def add_turn(*, model: str, usage: Usage, cost_usd: float, transcript: list[Message] | None,
             completed: bool) -> Callable[[RunState], None]:
    """The change one pass-through turn makes to its run."""

    def change(run: RunState) -> None:
        run.model = model
        run.count_turn(usage, cost_usd)
        if transcript is not None:
            run.messages = transcript
        if run.waits_for_decision:  # a call admitted before a limit request was made: it stays asked
            return
        # A final answer completes the run; a further call (the client's loop went on) reopens it.
        if completed:
            run.status, run.reason, run.interruption = "completed", "completed", None
        else:
            run.status, run.reason, run.interruption = "running", None, None
        run.error = None

    return change


def stop_run(status: Status, reason: str, interruption: Interruption | None,
             error: str | None = None) -> Callable[[RunState], None]:
    """The change a refused call makes: the run takes the refusal's status (unless it waits
    for a person: a limit request stays asked until someone decides it)."""

    def change(run: RunState) -> None:
        if run.waits_for_decision and reason != "cancelled":
            return
        run.status, run.reason, run.interruption, run.error = status, reason, interruption, error

    return change
