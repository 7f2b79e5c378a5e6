"""Stop conditions: the loop's exits other than a prose answer, as a list of predicates.

Stopping is plural (as `stopWhen` is in Vercel's `ai`): the turn cap and the run budget
are two predicates among others, all checked before the model is asked, so an overshoot
is at most one turn. The tool-call cap and the wall-clock cap are checked there too and
again before every tool execution (`execution_stop`), so a run stops at exactly either.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from gateway.harness.options import Stop, StopCondition
from gateway.harness.state import Interruption, RunState


def turn_cap(state: RunState) -> Stop | None:
    cap = state.limits.max_turns
    if cap is not None and state.turns >= cap:
        return Stop("max_turns_exceeded", "max_turns", f"reached the cap of {cap} turns",
                    Interruption("max_turns"))
    return None


def run_budget(state: RunState) -> Stop | None:
    budget = state.limits.max_budget_usd
    if budget is not None and state.cost_usd >= budget:
        return Stop("budget_exceeded", "max_budget",
                    f"spent ${state.cost_usd:.6f} of a ${budget:.6f} budget", Interruption("max_budget"))
    return None


def tool_cap(state: RunState) -> Stop | None:
    cap = state.limits.max_tool_calls
    if state.tool_calls >= cap:
        return Stop("max_tool_calls_exceeded", "max_tool_calls", f"reached the cap of {cap} tool calls",
                    Interruption("max_tool_calls"))
    return None


def duration_cap(state: RunState, now: float) -> Stop | None:
    """Wall-clock from the run's first drive (`state.started_at`) against `max_duration_s`."""
    cap = state.limits.max_duration_s
    if cap is None or state.started_at is None:
        return None
    elapsed = now - state.started_at
    if elapsed >= cap:
        return Stop("max_duration_exceeded", "max_duration",
                    f"ran for {elapsed:.1f} s, past its cap of {cap:g} s", Interruption("max_duration"))
    return None


def execution_stop(state: RunState, now: float) -> Stop | None:
    """The limits checked right before a tool runs: the tool-call cap, then the clock."""
    return tool_cap(state) or duration_cap(state, now)


class RepeatedCall:
    """Stop when the last `times` turns each asked for the same single call (name + args)."""

    def __init__(self, times: int) -> None:
        if times < 2:
            raise ValueError("repeated_call needs at least 2")
        self.times = times

    def __call__(self, state: RunState) -> Stop | None:
        signatures: list[tuple[str, bytes]] = []
        for m in reversed(state.messages):
            if m.get("role") != "assistant":
                continue
            calls = m.get("tool_calls") or []
            if len(calls) != 1:
                break
            signatures.append(signature(calls[0]))
            if len(signatures) == self.times:
                break
        if len(signatures) == self.times and len(set(signatures)) == 1:
            name, args = signatures[0]
            return Stop("failed", "repeated_call",
                        f"the model asked for {name}({args.decode()}) {self.times} times in a row")
        return None


def signature(call: dict[str, object]) -> tuple[str, bytes]:
    """A call's identity for dedupe: tool name + canonical JSON of its arguments."""
    fn = call.get("function")
    name = str(fn.get("name", "")) if isinstance(fn, dict) else ""
    raw = fn.get("arguments", "") if isinstance(fn, dict) else ""
    try:
        canonical = orjson.dumps(orjson.loads(raw or "{}"), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = str(raw).encode()
    return name, canonical


def first_stop(state: RunState, extra: Sequence[StopCondition], now: float | None = None) -> Stop | None:
    """The built-in limits, then the policy's own conditions, in order (`now`: the clock,
    for the wall-clock cap; None skips it)."""
    builtin = turn_cap(state) or run_budget(state) or tool_cap(state)
    if builtin is None and now is not None:
        builtin = duration_cap(state, now)
    if builtin is not None:
        return builtin
    for condition in extra:
        stop = condition(state)
        if stop is not None:
            return stop
    return None
