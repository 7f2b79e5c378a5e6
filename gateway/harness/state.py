"""The run: one plain, versioned, serializable object.

Nothing about a run lives in a closure, so a run saved by one process can be loaded by
another and continued. `SCHEMA_VERSION` is bumped on every change of the serialized shape;
`from_json` upgrades older versions (fixtures of each live in tests/fixtures/).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Required, TypedDict, cast, get_args

import orjson

from gateway.harness.usage import Usage

SCHEMA_VERSION = 6
"""v2: `model_call_ids` (the calls the gateway's own model turns made: the only ones it
runs), `tool_calls` (tool executions so far), `started_at` (the first drive), and the
limits `max_tool_calls` and `max_duration_s`. v3: `key_id` and `user`, the key and the user
that started the run (a server-side run's turns are held to their budgets and spent in their
name). v4: limit requests (`on_exceed: ask`): an interruption of type `limit` (`limit`,
`used`, `cap`, `grant`) and `grants`, the limits a person raised. v5: a run is stored as a
head and its transcript beside it, so that a save writes what changed and no more
(`head_json`, `transcript_change`): the head holds neither `messages` nor `per_turn` but
`transcript: {"messages": N, "per_turn": M}`, how many of each the store keeps beside it,
one item each; `per_turn` entries are `[prompt, completion]` pairs. The whole run
(`to_json`) is the head's fields with `per_turn` and `messages` in place. v6: the ids of the
model's calls are kept with the turns that made them, so the head no longer grows with the
run: a stored `per_turn` entry is `[prompt, completion, [ids]]` when ids came with it (the ids
recorded since the entry before it was stored), and the head's `model_call_ids` holds only
the ids no entry holds yet (none in a run the loop drives, whose ids come with their turn; a
v5 head's all, until its next turn). `model_call_ids` is the entries' ids in order, then the
head's (`_with_transcript`). The whole run is v5's shape: `model_call_ids` whole, `per_turn`
pairs."""

READ_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5, SCHEMA_VERSION)
"""The schema versions `RunState.from_json` reads (older ones upgraded in place)."""

DEFAULT_MAX_TOOL_CALLS = 100
"""Tool executions a run may make when its policy names no `max_tool_calls`: there is
always a cap, since one model reply can ask for any number of calls."""

Status = Literal["running", "completed", "failed", "max_turns_exceeded", "budget_exceeded",
                 "max_tool_calls_exceeded", "max_duration_exceeded", "interrupted"]
STATUSES: tuple[Status, ...] = get_args(Status)
RESUMABLE: frozenset[Status] = frozenset({"running", "max_turns_exceeded", "budget_exceeded",
                                          "max_tool_calls_exceeded", "max_duration_exceeded", "interrupted"})
InterruptionType = Literal["approval", "limit", "max_turns", "max_budget", "max_tool_calls", "max_duration",
                           "cancelled", "crashed", "rate_limited"]
ASKING: frozenset[InterruptionType] = frozenset({"approval", "limit"})
"""Interruptions that ask a person to decide: a call (`approval`) or a limit request (`limit`).
Both follow one rule (`RunState.waits_for_decision`, `decided`, `waiting_for`)."""
WaitingFor = Literal["decision", "resume"]
"""What a stopped, resumable run waits for: a person's `decision` on the call (or limit
request) it stopped at, or a `resume` (its owner's `POST /v1/runs/{id}/resume`, the client's
next call, or, under `approval: {on_decision: resume}`, the gateway itself)."""
LimitName = Literal["max_turns", "max_budget_usd", "max_tool_calls", "max_duration_s"]
"""The limits of a run a person may raise (`Limits` fields; a policy's `limits.ask.grant`)."""
LIMIT_NAMES: tuple[LimitName, ...] = get_args(LimitName)
WHOLE_LIMITS: frozenset[LimitName] = frozenset({"max_turns", "max_tool_calls"})
"""Limits counted in whole numbers: their figures stay ints."""
Amounts = dict[LimitName, float]
"""Figures by limit: a grant (what is added to each), caps, a policy's `max_total`. Turns and
tool calls are whole numbers (kept as ints)."""

class Message(TypedDict, total=False):
    """One chat message as the wire carries it (system, user, assistant or tool); checked at
    the edge (`server/http/chat_schema.py`) before it becomes one of these."""

    role: Required[str]
    content: Any  # a string, content parts, or None
    name: str
    tool_calls: list[dict[str, Any]]  # {id, type, function: {name, arguments}}, read defensively
    tool_call_id: str
    refusal: str | None


class StateError(ValueError):
    """A serialized run that cannot be read (wrong version, wrong shape)."""


@dataclass(frozen=True)
class Interruption:
    """Why a resumable run stopped, with what a person needs to continue it."""

    type: InterruptionType
    call_id: str | None = None
    """The call a person decides (`approval`), or the id of a limit request (`limit`)."""
    tool_name: str | None = None
    args: Any = None
    reason: str | None = None
    limit: LimitName | None = None
    """`limit`: the limit that was reached."""
    used: float | None = None
    """`limit`: what the run used of it (turns, USD, tool calls, seconds)."""
    cap: float | None = None
    """`limit`: the limit as it was."""
    grant: Amounts | None = None
    """`limit`: the grant proposed to the person (what each limit would be raised by)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "approval":
            out.update(call_id=self.call_id, tool_name=self.tool_name, args=self.args)
        elif self.type == "limit":
            out.update(call_id=self.call_id, limit=self.limit, used=self.used, cap=self.cap,
                       grant=dict(self.grant or {}))
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    @classmethod
    def from_json(cls, data: Any) -> Interruption | None:
        if data is None:
            return None
        if data["type"] == "limit":
            return cls("limit", data.get("call_id"), reason=data.get("reason"), limit=data.get("limit"),
                       used=data.get("used"), cap=data.get("cap"), grant=amounts(data.get("grant")))
        return cls(data["type"], data.get("call_id"), data.get("tool_name"), data.get("args"), data.get("reason"))


@dataclass(frozen=True)
class Limits:
    """Per-run caps; None means no cap. `strict` clamps output so spend never passes the budget.

    `max_tool_calls` counts tool executions (always capped); `max_duration_s` is wall-clock
    seconds from the run's first drive, waits for a person or a client included.
    """

    max_turns: int | None = None
    max_budget_usd: float | None = None
    budget_mode: Literal["turn", "strict"] = "turn"
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    max_duration_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"max_turns": self.max_turns, "max_budget_usd": self.max_budget_usd, "budget_mode": self.budget_mode,
                "max_tool_calls": self.max_tool_calls, "max_duration_s": self.max_duration_s}

    def value(self, name: LimitName) -> float | None:
        """The cap of limit `name` (None: no cap)."""
        value: float | None = getattr(self, name)
        return value

    def raised(self, grant: Amounts) -> Limits:
        """These limits, each one `grant` names raised by its amount (a limit with no cap stays so)."""
        changes: dict[str, float] = {}
        for name, add in grant.items():
            cap = self.value(name)
            if cap is not None:
                changes[name] = cap + add
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: Any) -> Limits:
        data = data or {}
        return cls(data.get("max_turns"), data.get("max_budget_usd"), data.get("budget_mode", "turn"),
                   data.get("max_tool_calls") or DEFAULT_MAX_TOOL_CALLS, data.get("max_duration_s"))


@dataclass(frozen=True)
class Decision:
    """A person's verdict on a call that needed approval."""

    decision: Literal["approve", "reject"]
    reason: str = ""
    by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"decision": self.decision, "reason": self.reason, "by": self.by}


@dataclass(frozen=True)
class LimitGrant:
    """Limits a person raised on a run (`on_exceed: ask`): who, when, by how much, and each
    raised limit before and after (the run's audit of its own limits)."""

    call_id: str
    by: str
    at: float
    grant: Amounts
    before: Amounts
    after: Amounts
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "by": self.by, "at": self.at, "grant": dict(self.grant),
                "before": dict(self.before), "after": dict(self.after), "reason": self.reason}

    @classmethod
    def from_json(cls, data: Any) -> LimitGrant:
        return cls(str(data["call_id"]), str(data.get("by") or ""), float(data.get("at") or 0.0),
                   amounts(data.get("grant")), amounts(data.get("before")), amounts(data.get("after")),
                   str(data.get("reason") or ""))


def amounts(data: Any) -> Amounts:
    """Figures by limit read back (unknown names dropped; ints kept ints)."""
    if not isinstance(data, dict):
        return {}
    return {name: data[name] for name in LIMIT_NAMES if isinstance(data.get(name), (int, float))}


@dataclass
class RunState:
    """Everything there is to know about a run. The loop mutates it; stores save it."""

    run_id: str
    model: str
    messages: list[Message]
    limits: Limits = field(default_factory=Limits)
    team: str = ""
    policy: str = ""
    policy_version: str = ""
    status: Status = "running"
    reason: str | None = None
    interruption: Interruption | None = None
    turns: int = 0
    usage: Usage = field(default_factory=Usage)
    cost_usd: float = 0.0
    per_turn: list[Usage] = field(default_factory=list)
    decisions: dict[str, Decision] = field(default_factory=dict)
    failed_calls: list[str] = field(default_factory=list)  # their results are errors: never reused
    model_call_ids: list[str] = field(default_factory=list)  # calls its own model turns made: the only ones run
    tool_calls: int = 0  # tool executions so far (counted against limits.max_tool_calls)
    started_at: float | None = None  # its first drive (limits.max_duration_s counts from here)
    grants: list[LimitGrant] = field(default_factory=list)  # limits people raised (on_exceed: ask)
    error: str | None = None
    parent_run_id: str | None = None
    key_id: str = ""  # the key that started the run ('' for runs stored before v3)
    user: str | None = None  # the user its first call named
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    revision: int = 0
    version: int = SCHEMA_VERSION
    stored_messages: tuple[Message, ...] = field(default=(), repr=False, compare=False)
    """The messages as the store keeps them beside the run's head at `revision` (the same
    objects): a save stores only the messages after the first one that differs. Messages
    are replaced, never edited in place. Not serialized; set by the store."""
    stored_per_turn: int = field(default=0, repr=False, compare=False)
    """How many `per_turn` entries the store keeps beside the head (the list only grows)."""
    stored_call_ids: int = field(default=0, repr=False, compare=False)
    """How many of `model_call_ids` (the first ones) those entries hold; the head holds the rest."""

    @classmethod
    def new(cls, model: str, messages: list[Message], *, run_id: str | None = None, **kw: Any) -> RunState:
        return cls(run_id=run_id or new_run_id(), model=model, messages=list(messages), **kw)

    @property
    def public_id(self) -> str:
        """The id its client knows: a stored id is scoped to its team (`team/id`, see
        `scoped_run_id`), so two teams may each have a run called `r1`."""
        return public_run_id(self.run_id)

    @property
    def resumable(self) -> bool:
        return self.status in RESUMABLE

    @property
    def waits_for_decision(self) -> bool:
        """Stopped on a call (or a limit request) nobody has decided yet."""
        return self.waiting_request is not None

    @property
    def waiting_request(self) -> Interruption | None:
        """The call (`approval`) or limit request (`limit`) the run is stopped on, nobody
        having decided it yet; None when it waits for no decision."""
        i = self.interruption
        if self.status == "interrupted" and i is not None and i.type in ASKING and i.call_id not in self.decisions:
            return i
        return None

    @property
    def decided(self) -> bool:
        """Stopped on a call (or a limit request) that a person (or the expiry) has decided
        since: it waits for a resume. A decision never makes a run `running`; only a drive
        does, under the run's lease (a pass-through run's: its client's next call), so a
        `running` server-side run is always one that a process drives (or that waits for its
        client's tool results) and recovery may treat it so. (A rejected limit request ends
        the run as the limit does: a decided limit request is a granted one.)"""
        i = self.interruption
        return (self.status == "interrupted" and i is not None and i.type in ASKING
                and i.call_id in self.decisions)

    @property
    def waiting_for(self) -> WaitingFor | None:
        """What the run waits for before it goes on (None: it is running, or ended for good)."""
        if self.status == "running" or not self.resumable:
            return None
        return "decision" if self.waits_for_decision else "resume"

    def interruption_json(self) -> dict[str, Any] | None:
        """`interruption` as the API shows it: what it waits for, and the verdict once decided."""
        i = self.interruption
        if i is None:
            return None
        out = i.to_json()
        if i.type in ASKING and i.call_id in self.decisions:
            out["decision"] = self.decisions[i.call_id].decision
        waiting = self.waiting_for
        if waiting is not None:
            out["waiting_for"] = waiting
        return out

    @property
    def approved(self) -> list[str]:
        return [cid for cid, d in self.decisions.items() if d.decision == "approve"]

    @property
    def rejected(self) -> dict[str, str]:
        return {cid: d.reason for cid, d in self.decisions.items() if d.decision == "reject"}

    def used(self, name: LimitName, now: float) -> float:
        """What the run used of limit `name`: turns, USD, tool executions, seconds since its
        first drive (`now`: the clock)."""
        if name == "max_turns":
            return self.turns
        if name == "max_budget_usd":
            return self.cost_usd
        if name == "max_tool_calls":
            return self.tool_calls
        started = self.started_at if self.started_at is not None else self.created_at
        return max(0.0, now - started)

    def count_turn(self, usage: Usage, cost_usd: float) -> None:
        """Book one model turn on the run: its usage and its cost (the one place, for both modes)."""
        self.turns += 1
        self.per_turn.append(usage)
        self.usage = self.usage + usage
        self.cost_usd += cost_usd

    def summary(self) -> dict[str, Any]:
        """The `run` object of the HTTP contract."""
        return {
            "id": self.public_id,
            "status": self.status,
            "reason": self.reason,
            "turns": self.turns,
            "cost_usd": round(self.cost_usd, 9),
            "usage": self.usage.to_json(),
            "interruption": self.interruption_json(),
        }

    def head_json(self) -> dict[str, Any]:
        """The run as its store keeps it in one place: everything but its transcript
        (`messages`, `per_turn`), which is kept beside it item by item, and their counts."""
        return {
            "version": self.version,
            "run_id": self.run_id,
            "model": self.model,
            "team": self.team,
            "policy": self.policy,
            "policy_version": self.policy_version,
            "parent_run_id": self.parent_run_id,
            "limits": self.limits.to_json(),
            "status": self.status,
            "reason": self.reason,
            "interruption": self.interruption.to_json() if self.interruption else None,
            "turns": self.turns,
            "usage": self.usage.to_json(),
            "cost_usd": self.cost_usd,
            "decisions": {cid: d.to_json() for cid, d in self.decisions.items()},
            "failed_calls": self.failed_calls,
            "model_call_ids": self.model_call_ids[_held_call_ids(self):],
            "tool_calls": self.tool_calls,
            "started_at": self.started_at,
            "grants": [g.to_json() for g in self.grants],
            "error": self.error,
            "key_id": self.key_id,
            "user": self.user,
            "transcript": {"messages": len(self.messages), "per_turn": len(self.per_turn)},
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "revision": self.revision,
        }

    def to_json(self) -> dict[str, Any]:
        """The whole run, its transcript in place (the head's fields, then `per_turn` and `messages`)."""
        out = self.head_json()
        del out["transcript"]
        out["model_call_ids"] = self.model_call_ids
        out["per_turn"] = [[u.prompt_tokens, u.completion_tokens] for u in self.per_turn]
        out["messages"] = self.messages
        return out

    def dumps(self) -> bytes:
        return orjson.dumps(self.to_json())

    @classmethod
    def from_json(cls, data: Any, transcript: tuple[list[Any], list[Any]] | None = None) -> RunState:
        """A run from its whole JSON (`to_json`, any version), or from its head (`head_json`)
        and, in `transcript`, the messages and `per_turn` entries kept beside it."""
        if not isinstance(data, dict):
            raise StateError("a run must be a JSON object")
        version = data.get("version")
        if version == 1:
            data = upgrade_v1(data)
        elif version not in READ_VERSIONS:  # v3 added key_id and user, v4 limit requests (defaults), v5 the head
            raise StateError(f"run schema version {version!r} is not supported (this gateway reads "
                             f"{', '.join(map(str, READ_VERSIONS))})")
        stored, held = "transcript" in data, 0
        if stored:
            data, held = _with_transcript(data, transcript)
        status = data.get("status")
        if status not in STATUSES:
            raise StateError(f"unknown run status {status!r}")
        try:
            state = cls(
                run_id=str(data["run_id"]),
                model=str(data["model"]),
                messages=_messages(data["messages"]),
                limits=Limits.from_json(data.get("limits")),
                team=data.get("team", ""),
                policy=data.get("policy", ""),
                policy_version=data.get("policy_version", ""),
                parent_run_id=data.get("parent_run_id"),
                status=cast(Status, status),
                reason=data.get("reason"),
                interruption=Interruption.from_json(data.get("interruption")),
                turns=int(data.get("turns", 0)),
                usage=Usage.from_json(data.get("usage")),
                cost_usd=float(data.get("cost_usd", 0.0)),
                per_turn=_usages(data.get("per_turn", [])),
                decisions={cid: Decision(**d) for cid, d in (data.get("decisions") or {}).items()},
                failed_calls=list(data.get("failed_calls") or []),
                model_call_ids=[str(c) for c in data.get("model_call_ids") or []],
                tool_calls=int(data.get("tool_calls") or 0),
                started_at=_optional_float(data.get("started_at")),
                grants=[LimitGrant.from_json(g) for g in data.get("grants") or ()],
                error=data.get("error"),
                key_id=str(data.get("key_id") or ""),
                user=data.get("user"),
                created_at=float(data.get("created_at", 0.0)),
                updated_at=float(data.get("updated_at", 0.0)),
                revision=int(data.get("revision", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed run: {exc}") from exc
        if stored:  # what the store holds beside the head: the entries, and the ids they hold
            state.stored_per_turn, state.stored_call_ids = len(state.per_turn), held
        return state

    @classmethod
    def loads(cls, raw: bytes | str) -> RunState:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise StateError(f"run is not valid JSON: {exc}") from exc
        return cls.from_json(data)

    def mark_stored(self) -> None:
        """The store now keeps this run's messages and `per_turn` as they are (after a load or
        a save, `from_json` having counted what a load found): the next save writes only what
        comes after them."""
        self.stored_call_ids = _held_call_ids(self)
        self.stored_messages = tuple(self.messages)
        self.stored_per_turn = len(self.per_turn)

    def unstored(self) -> RunState:
        """A view of this run as a store that holds none of it sees it (what creating it
        writes): its lists are this run's own, not copies."""
        new = object.__new__(RunState)
        new.__dict__.update(self.__dict__)
        new.stored_messages, new.stored_per_turn, new.stored_call_ids = (), 0, 0
        return new

    def copy(self) -> RunState:
        """A copy whose lists and dicts are its own (their items are shared: messages are
        replaced, never edited). Field by field, not `dataclasses.replace`, which runs
        `__init__` and a getattr per field: a pass-through call makes three copies."""
        new = object.__new__(RunState)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["messages"] = list(self.messages)
        fields["decisions"] = dict(self.decisions)
        fields["per_turn"] = list(self.per_turn)
        fields["failed_calls"] = list(self.failed_calls)
        fields["model_call_ids"] = list(self.model_call_ids)
        fields["grants"] = list(self.grants)
        return new


@dataclass(frozen=True)
class TranscriptChange:
    """What a save must write of a run's transcript beside its head: keep the first
    `messages_from` stored messages and store `messages` after them (anything stored after
    that goes), and the same for `per_turn`."""

    messages_from: int
    messages: list[Message]
    per_turn_from: int
    per_turn: list[Usage]
    truncates: bool
    """Whether stored items past `messages_from` or `per_turn_from` must go (a transcript
    that was rewritten, not only added to)."""
    call_ids: list[str] = field(default_factory=list)
    """The ids of the model's calls the last of `per_turn` holds (the ids recorded since the
    store last kept the run): each turn's ids go with it, not in the head (schema 6)."""


def transcript_change(state: RunState) -> TranscriptChange:
    """What changed in `state`'s transcript since the store last kept it (`stored_messages`):
    the messages from the first one that is not the stored one (by identity, else by value,
    so a client that sends the same history again adds nothing but what is new), and the
    `per_turn` entries past `stored_per_turn`."""
    stored, messages = state.stored_messages, state.messages
    k, n = 0, min(len(stored), len(messages))
    if n and n == len(stored) and messages[n - 1] is stored[-1] and messages[0] is stored[0]:
        k = n  # the usual turn: the same list, added to (a list's items are replaced, never edited)
    while k < n and (messages[k] is stored[k] or messages[k] == stored[k]):
        k += 1
    t, c = _kept_turns(state)
    return TranscriptChange(k, messages[k:], t, state.per_turn[t:],
                            k < len(stored) or t < state.stored_per_turn,
                            state.model_call_ids[c:] if t < len(state.per_turn) else [])


def _kept_turns(state: RunState) -> tuple[int, int]:
    """How many stored `per_turn` entries a save keeps, and how many ids of the model's calls
    they hold: all the store has, unless either list is shorter than what is stored (a
    rewritten history): then none, and every entry is written again."""
    if len(state.per_turn) >= state.stored_per_turn and len(state.model_call_ids) >= state.stored_call_ids:
        return state.stored_per_turn, state.stored_call_ids
    return 0, 0


def _held_call_ids(state: RunState) -> int:
    """How many ids of the model's calls the stored `per_turn` entries hold once `state` is
    saved: all of them when the save writes an entry (the last it writes takes the new ones),
    else what they held (the head keeps the rest)."""
    t, c = _kept_turns(state)
    return len(state.model_call_ids) if t < len(state.per_turn) else c


def _with_transcript(head: dict[str, Any],
                     transcript: tuple[list[Any], list[Any]] | None) -> tuple[dict[str, Any], int]:
    """A head (`head_json`) with the messages and `per_turn` kept beside it, in place, and
    how many ids of the model's calls the entries held: theirs come first in
    `model_call_ids`, then the head's (v6; a v5 entry holds none)."""
    counts = head.get("transcript")
    if transcript is None or not isinstance(counts, dict):
        raise StateError("malformed run: a stored head without its transcript")
    messages, per_turn = transcript
    if len(messages) != counts.get("messages") or len(per_turn) != counts.get("per_turn"):
        raise StateError(f"malformed run: its head counts {counts.get('messages')} messages and "
                         f"{counts.get('per_turn')} turns, the store holds {len(messages)} and {len(per_turn)}")
    out = dict(head)
    del out["transcript"]
    ids: list[Any] = []
    for entry in per_turn:
        if type(entry) is list and len(entry) == 3:
            if not isinstance(entry[2], list):
                raise StateError("malformed run: a turn's call ids must be a list")
            ids.extend(entry[2])
    if ids:
        out["model_call_ids"] = ids + list(head.get("model_call_ids") or [])
    out["messages"], out["per_turn"] = messages, per_turn
    return out, len(ids)


def _messages(items: Any) -> list[Message]:
    if not isinstance(items, list):
        raise StateError("malformed run: messages must be a list")
    return list(items)


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A v1 run in the current shape (v2's fields made up as below; later ones have defaults).

    v1 recorded no origin of tool calls. A v1 run's assistant tool calls after its first
    turn were made by its model (a server-side run appends only model replies; a
    pass-through run is never driven here); the calls of the history its client sent
    first came from the client. Of those, only the ones already answered are kept as
    history: a call left pending from the client's own first messages is not marked,
    so it is never run. Tool executions so far are not recorded either: the tool results
    in the transcript are their upper bound (denials and reused results included), and
    the first drive is taken to be the run's creation.
    """
    out = dict(data)
    messages = [cast(Message, m) for m in data.get("messages") or [] if isinstance(m, dict)]
    first_model = _first_model_turn(messages, int(data.get("turns") or 0))
    ids: list[str] = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and i >= first_model:
            ids.extend(str(c["id"]) for c in m.get("tool_calls") or [] if isinstance(c, dict) and c.get("id"))
    out["model_call_ids"] = ids
    out["tool_calls"] = sum(1 for m in messages if m.get("role") == "tool")
    out["started_at"] = data.get("created_at")
    out["version"] = 2
    return out


def _first_model_turn(messages: list[Message], turns: int) -> int:
    """The index of the first assistant message a v1 run's model made: the last `turns`
    assistant messages are its turns (a run holds its client's history, then its turns)."""
    if turns <= 0:
        return len(messages)
    seen = 0
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            seen += 1
            if seen == turns:
                return i
    return 0


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _usages(items: Any) -> list[Usage]:
    """`per_turn` back into Usages: `[prompt, completion]` pairs (v5; v6 stored entries may
    hold their turn's call ids third, read by `_with_transcript`), or objects as
    `Usage.from_json` reads them (v2); the usual entry (two ints) skips the checks."""
    out: list[Usage] = []
    for item in items:
        if (type(item) is list or type(item) is tuple) and 2 <= len(item) <= 3 and type(item[0]) is int \
                and type(item[1]) is int:
            out.append(Usage(item[0], item[1]))
            continue
        if type(item) is dict:
            p, c = item.get("prompt_tokens"), item.get("completion_tokens")
            if type(p) is int and type(c) is int:
                out.append(Usage(p, c))
                continue
        out.append(Usage.from_json(item))
    return out


def scoped_run_id(team: str, run_id: str) -> str:
    """The stored id of a team's run `run_id` (team names and run ids never hold a '/')."""
    return f"{team}/{run_id}"


def public_run_id(stored: str) -> str:
    """The id a client knows of a stored run id (itself when it is not scoped)."""
    return stored.split("/", 1)[1] if "/" in stored else stored


def new_run_id() -> str:
    return "run_" + uuid.uuid4().hex[:20]


def assistant_message(message: dict[str, Any]) -> Message:
    """A reply's message as the transcript keeps it (no null fields but content)."""
    out = cast(Message, {k: v for k, v in message.items() if v is not None or k == "content"})
    out["role"] = "assistant"
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def own_calls(state: RunState, message: Message) -> Message:
    """The model's reply with every tool call given an id unique within the run.

    A call without an id (or with one that is not a string, empty, used twice in the reply
    or already used in the run) gets `call_<random>`; the ids are recorded in
    `state.model_call_ids`, which makes them calls the gateway may run. Done before the
    reply is saved, so a result can always be matched to its call.
    """
    calls = message.get("tool_calls")
    if not calls:
        return message
    used = set(state.model_call_ids)
    for m in state.messages:
        if m.get("role") == "assistant":
            used.update(str(c.get("id")) for c in m.get("tool_calls") or [] if isinstance(c, dict))
    fixed: list[dict[str, Any]] = []
    for call in calls:
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id or call_id in used:
            call = {**call, "id": new_call_id()}
        used.add(call["id"])
        state.model_call_ids.append(call["id"])
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def pending(state: RunState) -> list[dict[str, Any]]:
    """Tool calls of the last assistant message that have no tool result yet.

    Every iteration drains these before asking the model, so resume and approval are
    the normal code path: an approved call is just a pending call now allowed to run.
    """
    answered: set[str] = set()
    for m in reversed(state.messages):
        if m.get("role") == "tool":
            answered.add(str(m.get("tool_call_id") or ""))
            continue
        if m.get("role") == "assistant":
            # ids compared as the loop writes them (a missing id is ""): an answered call is never pending again
            calls = m.get("tool_calls")
            return [c for c in calls if isinstance(c, dict) and str(c.get("id") or "") not in answered] \
                if isinstance(calls, list) else []
        return []
    return []
