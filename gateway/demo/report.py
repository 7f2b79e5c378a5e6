"""One experiment's result, printed in the chapter's format or as a JSON line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from gateway.harness.state import RunState
from gateway.harness.trace import Event


@dataclass
class Result:
    """What one run of one experiment measured."""

    experiment: str
    variant: str
    status: str
    reason: str | None
    turns: int
    tool_runs: list[str]
    prompt_tokens: int
    completion_tokens: int
    per_turn_prompt_tokens: list[int]
    cost_usd: float
    answer: str
    ms: int
    deleted: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, experiment: str, variant: str, state: RunState, events: Sequence[Event], answer: str | None,
           ms: int, **extra: Any) -> Result:
        reason = state.interruption.reason if state.interruption and state.interruption.reason else state.reason
        if state.status == "failed" and state.error:
            reason = state.error
        return cls(
            experiment=experiment, variant=variant, status=state.status, reason=reason, turns=state.turns,
            tool_runs=tool_runs(events, state.run_id), prompt_tokens=state.usage.prompt_tokens,
            completion_tokens=state.usage.completion_tokens,
            per_turn_prompt_tokens=[u.prompt_tokens for u in state.per_turn], cost_usd=round(state.cost_usd, 6),
            answer=answer or "", ms=ms, extra=extra,
        )

    def line(self) -> str:
        head = f"{self.experiment}, {self.variant}"
        parts = [f"{head:<34}", f"turns={self.turns:<3}", f"tools={len(self.tool_runs):<3}",
                 f"in={self.prompt_tokens:<7,}", f"out={self.completion_tokens:<5}", f"cost=${self.cost_usd:.6f}",
                 f"ms={self.ms:<5}", f"status={self.status}"]
        if self.status != "completed" and self.reason:
            parts.append(f'reason="{self.reason}"')
        if self.deleted is not None:
            parts.append("deleted=" + orjson.dumps(self.deleted).decode())
        parts.extend(f"{k}={v}" for k, v in self.extra.items())
        text = "  ".join(parts)
        if self.answer:
            text += f'\n{"":<4}answer: "{self.answer}"'
        return text

    def json(self) -> str:
        data = asdict(self)
        data.update(data.pop("extra"))
        return orjson.dumps(data).decode()


def tool_runs(events: Sequence[Event], run_id: str) -> list[str]:
    """Tools that actually ran in this run (not deduped, not denied), as `name` or `name:path`."""
    runs = []
    for e in events:
        if e["type"] != "tool_start" or e["runId"] != run_id:
            continue
        try:
            path = orjson.loads(e.get("args") or "{}").get("path")
        except (orjson.JSONDecodeError, AttributeError):
            path = None
        runs.append(f"{e['toolName']}:{path}" if path else str(e["toolName"]))
    return runs
