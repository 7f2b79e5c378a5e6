"""How a call changes a server-side run before the loop drives it again.

Each function returns a `Prepare` for `RunDriver.drive`: it runs under the run's lease on
the freshly loaded run, refuses bad input with a 4xx before anything is saved, and
returns the fields of the trace line that starts the drive (None: nothing to drive,
answer with the run as it is, e.g. it still waits for a person).

- `start`: a new run's first call (the policy's system prompt if the client sent none);
- `continue_chat`: a later chat call with the same X-Run-Id: tool results for the calls
  handed to the client (hybrid), or a new user message on a stopped run;
- `resume_with`: POST /v1/runs/{id}/resume, optionally with raised limits.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from gateway.harness.approvals import ApprovalError, resume
from gateway.harness.state import Message, RunState, pending
from gateway.harness.trace import RunResumedSetup, RunStartedSetup
from gateway.policy.decl import Policy
from gateway.server.http.errors import Conflict, InvalidField
from gateway.server.runs.driver import Prepare


def start() -> Prepare:
    """A new run: prepend the policy's system prompt unless the client sent its own."""

    def prepare(state: RunState, policy: Policy) -> RunStartedSetup:
        if policy.system_prompt and not any(m.get("role") in ("system", "developer") for m in state.messages):
            state.messages.insert(0, {"role": "system", "content": policy.system_prompt})
        return {"team": state.team, "policy": policy.name, "policyVersion": policy.version, "model": state.model}

    return prepare


def refuse_unanswered_calls(messages: list[Message]) -> None:
    """A new server-side run's history may not end with tool calls nobody answered.

    The gateway runs only calls its own model turns made (`RunState.model_call_ids`); a call
    in the client's history is history, and one left unanswered is refused here with a 400
    naming it, before the run is driven (the loop would answer it in words, never run it).
    """
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "tool":
            continue
        if m.get("role") != "assistant":
            return
        answered = {str(t.get("tool_call_id") or "") for t in messages[i + 1:]}
        calls = m.get("tool_calls")
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            call_id = str(call.get("id") or "") if isinstance(call, dict) else ""
            if call_id and call_id in answered:
                continue
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            what = f"the call {name!r}" if isinstance(name, str) else "the call"
            raise InvalidField(f"messages[{i}].tool_calls[{j}]",
                               f"messages[{i}].tool_calls[{j}] ({what}) has no tool result: the gateway runs only "
                               "tool calls its own model turns made, so a call in your history is never run; "
                               "answer it with a tool message (tool_call_id) or drop it", "unanswered_tool_call")
        return


def _client_calls(state: RunState, policy: Policy) -> list[dict[str, Any]]:
    """Pending calls that no server-side tool answers: the client owes their results."""
    server = {t.name for t in policy.tools}
    return [c for c in pending(state) if (c.get("function") or {}).get("name") not in server]


def _tail(messages: list[Message]) -> list[Message]:
    """What the client added after the last assistant message it sent."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return messages[i + 1:]
    return messages


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _tool_results(state: RunState, tail: list[Message]) -> list[Message]:
    """The client's tool messages answering calls the run waits for (repeats ignored)."""
    waiting = {str(c.get("id")): c for c in pending(state)}
    answered = {m.get("tool_call_id") for m in state.messages if m.get("role") == "tool"}
    out: list[Message] = []
    for m in tail:
        if m.get("role") != "tool":
            continue
        cid = m.get("tool_call_id")
        if cid in answered:
            continue  # a retry of results the run already has
        call = waiting.pop(str(cid), None)
        if call is None:
            raise InvalidField("messages", f"a tool message answers tool_call_id {cid!r}, but run {state.public_id} "
                                           f"waits for no such call (waiting: {', '.join(waiting) or 'none'})")
        name = (call.get("function") or {}).get("name", "")
        out.append({"role": "tool", "tool_call_id": str(cid), "name": name, "content": _text(m.get("content"))})
    return out


def _reopen(state: RunState) -> None:
    if state.status == "completed":
        state.status, state.reason, state.interruption, state.error = "running", None, None, None
        return
    try:
        resume(state)
    except ApprovalError as exc:
        raise Conflict(str(exc), code="run_not_resumable") from None


def continue_chat(messages: list[Message], model: str) -> Prepare:
    """A chat call on an existing run: record what the client added, then go on."""

    def prepare(state: RunState, policy: Policy) -> RunResumedSetup | None:
        tail = _tail(messages)
        results = _tool_results(state, tail)
        if state.status == "failed":
            raise Conflict(f"run {state.public_id} failed ({state.error or state.reason}) and cannot be continued; "
                           "start a new run (another X-Run-Id)", code="run_failed")
        state.messages.extend(results)
        state.model = model
        fields: RunResumedSetup = {"by": "client", "toolResults": len(results)}
        if state.waits_for_decision:
            return None
        if state.decided:  # this call is the resume the decided run waits for
            _reopen(state)
        if state.status == "running":
            owed = [str(c.get("id")) for c in _client_calls(state, policy)]
            if owed and not results:
                raise InvalidField("messages", f"run {state.public_id} waits for the results of tool calls "
                                               f"{', '.join(owed)}: end messages with tool messages answering them")
            return fields
        if not results:
            added = [m for m in tail if m.get("role") != "tool"]
            if not added:
                raise InvalidField("messages", f"nothing new to continue run {state.public_id} with: end messages with "
                                               "a user message (or tool results for the calls it handed you)")
            state.messages.extend(added)
            fields["messages"] = len(added)
        _reopen(state)
        return fields

    return prepare


def resume_with(max_turns: int | None, max_budget_usd: float | None, by: str, *, max_tool_calls: int | None = None,
                max_duration_s: float | None = None) -> Prepare:
    """POST /v1/runs/{id}/resume: continue a resumable run, with raised limits if given.

    A raised limit must be above what the run already used (turns, dollars, tool calls,
    seconds since its first drive)."""

    def prepare(state: RunState, policy: Policy) -> RunResumedSetup:
        if max_tool_calls is not None and max_tool_calls <= state.tool_calls:
            raise InvalidField("max_tool_calls", f"max_tool_calls must be more than the {state.tool_calls} tool calls "
                                                 f"run {state.public_id} already made, got {max_tool_calls}")
        elapsed = 0.0 if state.started_at is None else time.time() - state.started_at
        if max_duration_s is not None and max_duration_s <= elapsed:
            raise InvalidField("max_duration_s", f"max_duration_s must be more than the {elapsed:.1f} s run "
                                                 f"{state.public_id} has run since its first drive, got {max_duration_s:g}")
        if max_turns is not None and max_turns <= state.turns:
            raise InvalidField("max_turns", f"max_turns must be more than the {state.turns} turns run "
                                            f"{state.public_id} already made, got {max_turns}")
        if max_budget_usd is not None and max_budget_usd <= state.cost_usd:
            raise InvalidField("max_budget_usd", f"max_budget_usd must be more than the ${state.cost_usd:.6f} run "
                                                 f"{state.public_id} already spent, got {max_budget_usd}")
        owed = _client_calls(state, policy)
        if state.status == "running" and owed:
            ids = ", ".join(str(c.get("id")) for c in owed)
            raise Conflict(f"run {state.public_id} waits for the client's results of tool calls {ids}; send them "
                           "with a chat completion call carrying X-Run-Id", code="run_waits_for_client")
        limits = replace(state.limits, max_turns=max_turns or state.limits.max_turns,
                         max_budget_usd=max_budget_usd or state.limits.max_budget_usd,
                         max_tool_calls=max_tool_calls or state.limits.max_tool_calls,
                         max_duration_s=max_duration_s or state.limits.max_duration_s)
        try:
            resume(state, limits)
        except ApprovalError as exc:
            raise Conflict(str(exc), code="run_not_resumable") from None
        return {"by": by, "maxTurns": limits.max_turns, "maxBudgetUsd": limits.max_budget_usd,
                "maxToolCalls": limits.max_tool_calls, "maxDurationS": limits.max_duration_s}

    return prepare
