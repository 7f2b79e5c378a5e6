"""The run: one plain, versioned, serializable object.

Nothing about a run lives in a closure, so a run saved by one process can be loaded by
another and continued. `SCHEMA_VERSION` is bumped on every change of the serialized shape;
`from_json` upgrades older versions (fixtures of each live in tests/fixtures/).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast, get_args

import orjson

from gateway.harness.usage import Usage

SCHEMA_VERSION = 1

Status = Literal["running", "completed", "failed", "max_turns_exceeded", "budget_exceeded", "interrupted"]
STATUSES: tuple[Status, ...] = get_args(Status)
RESUMABLE: frozenset[Status] = frozenset({"running", "max_turns_exceeded", "budget_exceeded", "interrupted"})
InterruptionType = Literal["approval", "max_turns", "max_budget", "cancelled", "crashed"]

Message = dict[str, Any]


class StateError(ValueError):
    """A serialized run that cannot be read (wrong version, wrong shape)."""


@dataclass(frozen=True)
class Interruption:
    """Why a resumable run stopped, with what a person needs to continue it."""

    type: InterruptionType
    call_id: str | None = None
    tool_name: str | None = None
    args: Any = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "approval":
            out.update(call_id=self.call_id, tool_name=self.tool_name, args=self.args)
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    @classmethod
    def from_json(cls, data: Any) -> Interruption | None:
        if data is None:
            return None
        return cls(data["type"], data.get("call_id"), data.get("tool_name"), data.get("args"), data.get("reason"))


@dataclass(frozen=True)
class Limits:
    """Per-run caps; None means no cap. `strict` clamps output so spend never passes the budget."""

    max_turns: int | None = None
    max_budget_usd: float | None = None
    budget_mode: Literal["turn", "strict"] = "turn"

    def to_json(self) -> dict[str, Any]:
        return {"max_turns": self.max_turns, "max_budget_usd": self.max_budget_usd, "budget_mode": self.budget_mode}

    @classmethod
    def from_json(cls, data: Any) -> Limits:
        data = data or {}
        return cls(data.get("max_turns"), data.get("max_budget_usd"), data.get("budget_mode", "turn"))


@dataclass(frozen=True)
class Decision:
    """A person's verdict on a call that needed approval."""

    decision: Literal["approve", "reject"]
    reason: str = ""
    by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"decision": self.decision, "reason": self.reason, "by": self.by}


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
    error: str | None = None
    parent_run_id: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    revision: int = 0
    version: int = SCHEMA_VERSION

    @classmethod
    def new(cls, model: str, messages: list[Message], *, run_id: str | None = None, **kw: Any) -> RunState:
        return cls(run_id=run_id or new_run_id(), model=model, messages=list(messages), **kw)

    @property
    def resumable(self) -> bool:
        return self.status in RESUMABLE

    @property
    def approved(self) -> list[str]:
        return [cid for cid, d in self.decisions.items() if d.decision == "approve"]

    @property
    def rejected(self) -> dict[str, str]:
        return {cid: d.reason for cid, d in self.decisions.items() if d.decision == "reject"}

    def summary(self) -> dict[str, Any]:
        """The `run` object of the HTTP contract."""
        return {
            "id": self.run_id,
            "status": self.status,
            "reason": self.reason,
            "turns": self.turns,
            "cost_usd": round(self.cost_usd, 9),
            "usage": self.usage.to_json(),
            "interruption": self.interruption.to_json() if self.interruption else None,
        }

    def to_json(self) -> dict[str, Any]:
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
            "per_turn": [{"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
                         for p, c in ((u.prompt_tokens, u.completion_tokens) for u in self.per_turn)],
            "decisions": {cid: d.to_json() for cid, d in self.decisions.items()},
            "failed_calls": self.failed_calls,
            "error": self.error,
            "messages": self.messages,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "revision": self.revision,
        }

    def dumps(self) -> bytes:
        return orjson.dumps(self.to_json())

    @classmethod
    def from_json(cls, data: Any) -> RunState:
        if not isinstance(data, dict):
            raise StateError("a run must be a JSON object")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise StateError(f"run schema version {version!r} is not supported (this gateway reads {SCHEMA_VERSION})")
        status = data.get("status")
        if status not in STATUSES:
            raise StateError(f"unknown run status {status!r}")
        try:
            return cls(
                run_id=str(data["run_id"]),
                model=str(data["model"]),
                messages=list(data["messages"]),
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
                error=data.get("error"),
                created_at=float(data.get("created_at", 0.0)),
                updated_at=float(data.get("updated_at", 0.0)),
                revision=int(data.get("revision", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise StateError(f"malformed run: {exc}") from exc

    @classmethod
    def loads(cls, raw: bytes | str) -> RunState:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise StateError(f"run is not valid JSON: {exc}") from exc
        return cls.from_json(data)

    def copy(self) -> RunState:
        return replace(self, messages=list(self.messages), decisions=dict(self.decisions), per_turn=list(self.per_turn),
                       failed_calls=list(self.failed_calls))


def _usages(items: Any) -> list[Usage]:
    """`per_turn` back into Usages, as `Usage.from_json` reads each; the usual entry (two
    ints) skips its checks, since a run is loaded on every call and holds every turn."""
    out: list[Usage] = []
    for item in items:
        if type(item) is dict:
            p, c = item.get("prompt_tokens"), item.get("completion_tokens")
            if type(p) is int and type(c) is int:
                out.append(Usage(p, c))
                continue
        out.append(Usage.from_json(item))
    return out


def new_run_id() -> str:
    return "run_" + uuid.uuid4().hex[:20]


def assistant_message(message: dict[str, Any]) -> Message:
    """A reply's message as the transcript keeps it (no null fields but content)."""
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    out["role"] = "assistant"
    return out


def pending(state: RunState) -> list[dict[str, Any]]:
    """Tool calls of the last assistant message that have no tool result yet.

    Every iteration drains these before asking the model, so resume and approval are
    the normal code path: an approved call is just a pending call now allowed to run.
    """
    answered: set[str] = set()
    for m in reversed(state.messages):
        if m.get("role") == "tool":
            answered.add(m.get("tool_call_id", ""))
            continue
        if m.get("role") == "assistant":
            return [c for c in (m.get("tool_calls") or []) if c.get("id") not in answered]
        return []
    return []
