"""The loop: a pure async function over a `RunState`, with five exits.

A limit that asks a person (`RunOptions.limit_ask`, policy `on_exceed: ask`) is one of
them too: reaching it stops the run as a request for more (`limit_requests`), and the
decision is applied like a call's, as data, before the next drive.

Each iteration checks the stop conditions first (turn cap, budget, tool-call cap,
wall-clock cap, the policy's own), then drains `pending(state)` (calls of the last
assistant message without a result) and only asks the model when nothing is pending. So
resume and approval are the normal path. Every state change is handed to
`options.checkpoint` before the next side effect.

Only calls the run's own model turns made (`state.model_call_ids`) are ever run: a model
reply gets its call ids made unique before it is saved (`own_calls`), and a pending call
from anywhere else (a client's history) is answered in words, never executed. The
tool-call cap and the clock are checked again right before each execution, and with
`max_duration_s` a deadline also stops the model call or tool in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from gateway.harness import limit_requests
from gateway.harness.approvals import denial_text
from gateway.harness.execute import CancelScope, execute, race
from gateway.harness.model import LimitReached, Model, ModelRequest
from gateway.harness.options import RunOptions, Stop
from gateway.harness.state import Interruption, Message, RunState, own_calls, pending
from gateway.harness.stops import execution_stop, first_stop, signature
from gateway.harness.tools import ToolContext
from gateway.harness.trace import RunStoppedFields, Tracer, usage_clamped
from gateway.harness.usage import Usage

OutcomeKind = Literal["stopped", "client_tools"]
REUSED_PREFIX = "[same call as before; its earlier result is reused] "
NOT_OWN = "it was not made by one of the gateway's own model turns"
OUT_OF_TIME = "reached its wall-clock cap (limits.max_duration_s) during a step"


@dataclass(frozen=True)
class Outcome:
    """How `run` returned: the run stopped (see `state.status`), or it hands calls to the client."""

    state: RunState
    kind: OutcomeKind
    answer: str | None = None


async def run(state: RunState, model: Model, options: RunOptions, cancel: CancelScope | None = None) -> Outcome:
    """Drive `state` until it stops or waits for the client's own tools."""
    if state.started_at is None:
        state.started_at = options.clock()
    scope, disarm = _with_deadline(state, options, cancel or CancelScope())
    try:
        return await _loop(state, model, options, scope)
    finally:
        disarm()


def _with_deadline(state: RunState, options: RunOptions, scope: CancelScope) -> tuple[CancelScope, Callable[[], None]]:
    """A scope that the run's Stop presses and, with `max_duration_s`, its deadline too.

    The deadline reaches into the model call or tool in flight (a tool without a timeout
    cannot outlive the cap); it gets a scope of its own so that it never presses the
    caller's (a parent run's, for a sub-run).
    """
    cap = state.limits.max_duration_s
    if cap is None or state.started_at is None:
        return scope, lambda: None
    inner = CancelScope()
    if scope.cancelled:
        inner.cancel(scope.reason)

    async def forward() -> None:
        await scope.event.wait()
        inner.cancel(scope.reason)

    forwarder = asyncio.ensure_future(forward())
    left = state.started_at + cap - options.clock()
    timer = asyncio.get_running_loop().call_later(max(0.0, left), inner.cancel, OUT_OF_TIME)

    def disarm() -> None:
        timer.cancel()
        forwarder.cancel()

    return inner, disarm


async def _loop(state: RunState, model: Model, options: RunOptions, scope: CancelScope) -> Outcome:
    trace = Tracer(state.run_id, options.on_event)
    specs = options.tool_specs()
    client_names = {t.get("function", {}).get("name") for t in options.client_tools}
    while True:
        stop = first_stop(state, options.stop_when, options.clock())
        if stop is None and scope.cancelled:
            stop = _cancelled(scope)
        if stop is not None:
            return await _stop(state, stop, options, trace)
        calls = pending(state)
        if calls:
            outcome = await _drain(state, calls, client_names, options, scope, trace)
            if outcome is not None:
                return outcome
            continue
        offers = _offers_tools(state, options)
        request = ModelRequest(
            model=state.model, messages=state.messages if offers else _asking_the_answer(state.messages),
            tools=specs if offers else [], max_tokens=options.max_tokens,
            run_id=state.run_id, budget_remaining_usd=_remaining(state), fit_budget=_fits_budget(state, options),
            extra=dict(options.sampling),
        )
        try:
            finished, reply = await race(model.complete(request), scope)
        except LimitReached as exc:  # nothing was spent: the budget stops (or asks) before the call
            return await _stop(state, Stop("budget_exceeded", "max_budget", exc.detail, Interruption("max_budget")),
                               options, trace)
        if not finished:
            return await _stop(state, _cancelled(scope), options, trace)
        message: Message = own_calls(state, reply.message)
        state.messages.append(message)
        cost = reply.cost_usd if reply.cost_usd is not None else options.price.cost(reply.usage)
        state.count_turn(reply.usage, cost)
        if options.on_spend is not None:
            options.on_spend(reply.usage, cost)
        for attempt in reply.attempts:
            trace("upstream_attempt", **attempt)
        for repair in reply.repairs:
            trace("tool_call_repaired", upstream=reply.upstream, turn=state.turns, **repair)
        if reply.reported is not None:
            trace("usage_clamped", **usage_clamped(reply.upstream, reply.reported, reply.usage))
        trace("turn", turn=state.turns, prompt_tokens=reply.usage.prompt_tokens,
              completion_tokens=reply.usage.completion_tokens, total_tokens=reply.usage.total_tokens,
              costUsd=round(state.cost_usd, 9), finish=reply.finish_reason)
        if not message.get("tool_calls"):
            answer = message.get("content") or ""
            return await _stop(state, Stop("completed", "completed"), options, trace, answer)
        await _save(state, options)


async def _drain(state: RunState, calls: list[dict[str, Any]], client_names: set[Any], options: RunOptions,
                 scope: CancelScope, trace: Tracer) -> Outcome | None:
    """Run or answer every pending server-side call; hand the rest to the client."""
    for_client = []
    own = set(state.model_call_ids)
    for call in calls:
        if scope.cancelled:
            return await _stop(state, _cancelled(scope), options, trace)
        raw_fn = call.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else {}
        name, raw_args = str(fn.get("name", "")), str(fn.get("arguments") or "{}")
        call_id = str(call.get("id") or "")
        if call_id not in own:  # the HTTP layer refuses these first; never run, whatever their name
            trace("tool_denied", toolName=name, args=raw_args, callId=call_id, reason=NOT_OWN)
            _answer(state, call_id, name, f"The gateway did not run the call {name}: {NOT_OWN}.")
            await _save(state, options)
            continue
        tool = options.tools.get(name)
        if tool is None and name in client_names:
            for_client.append(call)
            continue
        if tool is None:
            known = ", ".join(options.tools) or "none"
            _answer(state, call_id, name, f"Error: there is no tool named {name!r}. Available tools: {known}.")
            state.failed_calls.append(call_id)
            await _save(state, options)
            continue
        try:
            args = orjson.loads(raw_args)
            if not isinstance(args, dict):
                raise TypeError("arguments must be a JSON object")
        except (orjson.JSONDecodeError, TypeError) as exc:
            _answer(state, call_id, name, f"Error: the arguments of {name} are not a valid JSON object ({exc}).")
            state.failed_calls.append(call_id)
            await _save(state, options)
            continue
        decision = state.decisions.get(call_id)
        if decision is not None and decision.decision == "reject":
            _answer(state, call_id, name, options.rejection_text(name, args, decision.reason, decision.by))
            await _save(state, options)
            continue
        if decision is None:
            verdict = options.approval(tool.spec, args)
            if verdict.action == "deny":
                trace("tool_denied", toolName=name, args=raw_args, callId=call_id, reason=verdict.reason)
                _answer(state, call_id, name, denial_text(name, args, verdict.reason))
                await _save(state, options)
                continue
            if verdict.action == "ask":
                trace("approval_required", toolName=name, args=raw_args, callId=call_id)
                stop = Stop("interrupted", "approval", f"{name} needs a person's approval",
                            Interruption("approval", call_id, name, args))
                return await _stop(state, stop, options, trace)
        reused = _earlier_result(state, call) if _dedupes(options, tool.spec.read_only) else None
        if reused is not None:
            trace("tool_deduped", toolName=name, args=raw_args, callId=call_id)
            _answer(state, call_id, name, REUSED_PREFIX + reused.removeprefix(REUSED_PREFIX))
            await _save(state, options)
            continue
        limit = execution_stop(state, options.clock())
        if limit is not None:  # the call stays pending: a resume with raised limits runs it
            return await _stop(state, limit, options, trace)
        failed = await _run_tool(state, tool_name=name, call_id=call_id, raw_args=raw_args, args=args,
                                 options=options, scope=scope, trace=trace)
        if failed is not None:
            return await _stop(state, failed, options, trace)
    if for_client:
        await _save(state, options)
        return Outcome(state, "client_tools")
    return None


async def _run_tool(state: RunState, *, tool_name: str, call_id: str, raw_args: str, args: Mapping[str, Any],
                    options: RunOptions, scope: CancelScope, trace: Tracer) -> Stop | None:
    tool = options.tools[tool_name]

    def progress(label: str) -> None:
        trace("tool_progress", toolName=tool_name, label=label)

    ctx = ToolContext(
        run_id=state.run_id, call_id=call_id, tool_name=tool_name, cancelled=scope.event,
        progress=progress,
        budget_remaining_usd=_remaining(state),
        spend=lambda usage, cost_usd: _charge(state, options, usage, cost_usd),
    )
    state.tool_calls += 1
    trace("tool_start", toolName=tool_name, args=raw_args, callId=call_id)
    done = await execute(tool, args, ctx, scope)
    trace("tool_result", toolName=tool_name, ms=done.ms, ok=done.outcome == "ok", callId=call_id,
          outcome=done.outcome)
    if done.outcome == "cancelled":
        return _cancelled(scope)
    if done.result is not None:
        if done.result.cost_usd or done.result.usage.total_tokens:
            _charge(state, options, done.result.usage, done.result.cost_usd)
        _answer(state, call_id, tool_name, done.result.content)
        await _save(state, options)
        return None
    exc = done.error or RuntimeError("tool failed")
    text = options.tool_errors.render(tool_name, exc)
    _answer(state, call_id, tool_name, text)
    state.failed_calls.append(call_id)
    if isinstance(exc, options.tool_errors.permanent):
        state.error = f"{tool_name} failed permanently: {exc}"
        return Stop("failed", "permanent_error", state.error)
    if options.tool_errors.fatal:
        state.error = f"{tool_name} failed: {exc}"
        return Stop("failed", "tool_error", state.error)
    await _save(state, options)
    return None


def _charge(state: RunState, options: RunOptions, usage: Usage, cost_usd: float) -> None:
    state.usage = state.usage + usage
    state.cost_usd += cost_usd
    if options.on_spend is not None:
        options.on_spend(usage, cost_usd)


def _answer(state: RunState, call_id: str, name: str, content: str) -> None:
    state.messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": content})


ANSWER_NOW: Final = "Answer my question now, in one sentence, from the tool results above. Do not call a tool."


def _asking_the_answer(messages: list[Message]) -> list[Message]:
    """The request's messages once tools are withheld (`tool_rounds`): the transcript plus a
    user line asking for the answer, which is not kept in the run. A small model shown tool
    results and no tools otherwise often writes one more tool call as its answer."""
    return [*messages, {"role": "user", "content": ANSWER_NOW}]


def _offers_tools(state: RunState, options: RunOptions) -> bool:
    """Tools go with the next call until `tool_rounds` turns have made a call that did not fail.

    A turn whose calls all failed (a tool error such as a path that does not exist, an unknown
    tool, arguments that are not JSON) does not count: the model has nothing to answer from but
    the error, which says what to call next, so it is offered the tools again. The turn cap, the
    budget and `repeated_call` still bound the run."""
    if options.tool_rounds is None:
        return True
    failed = set(state.failed_calls)
    rounds = sum(1 for m in state.messages if m.get("role") == "assistant" and m.get("tool_calls")
                 and any(str(c.get("id")) not in failed for c in m["tool_calls"]))
    return rounds < options.tool_rounds


def _dedupes(options: RunOptions, read_only: bool) -> bool:
    return options.dedupe == "all" or (options.dedupe == "read_only" and read_only)


def _earlier_result(state: RunState, call: dict[str, Any]) -> str | None:
    """The result of an earlier identical call (same tool, same arguments) that succeeded, if any.

    A failure is never reused: the error may be transient, and a permanent one stops the run.
    """
    wanted = signature(call)
    ids = {str(c.get("id")) for m in state.messages if m.get("role") == "assistant"
           for c in (m.get("tool_calls") or []) if c is not call and signature(c) == wanted}
    ids.difference_update(state.failed_calls)
    for m in state.messages:
        if m.get("role") == "tool" and m.get("tool_call_id") in ids:
            return str(m.get("content", ""))
    return None


def _fits_budget(state: RunState, options: RunOptions) -> bool:
    """Whether the run's budget asks a person before it is passed: then a model call must fit
    in what is left as a whole (`ModelRequest.fit_budget`), so no dollar is spent past it."""
    ask = options.limit_ask
    return ask is not None and ask.asks("max_budget_usd") and state.limits.max_budget_usd is not None


def _remaining(state: RunState) -> float | None:
    budget = state.limits.max_budget_usd
    return None if budget is None else max(0.0, budget - state.cost_usd)


def _cancelled(scope: CancelScope) -> Stop:
    if scope.reason == OUT_OF_TIME:  # the deadline pressed it, not a person
        return Stop("max_duration_exceeded", "max_duration", OUT_OF_TIME, Interruption("max_duration"))
    return Stop("interrupted", "cancelled", scope.reason, Interruption("cancelled", reason=scope.reason))


async def _save(state: RunState, options: RunOptions) -> None:
    state.updated_at = time.time()
    await options.checkpoint(state)


async def _stop(state: RunState, stop: Stop, options: RunOptions, trace: Tracer, answer: str | None = None) -> Outcome:
    if options.limit_ask is not None:  # a limit that asks a person becomes a request
        reached = limit_requests.reached(state, stop, options.limit_ask, options.clock())
        if reached is not None:
            stop = reached.stop
            limit_requests.reached_line(trace, reached, len(state.grants))
    state.status, state.reason, state.interruption = stop.status, stop.reason, stop.interruption
    if stop.status == "failed" and state.error is None:
        state.error = stop.detail
    fields: RunStoppedFields = {"status": stop.status, "reason": stop.reason, "turns": state.turns,
                              "toolCalls": state.tool_calls, "costUsd": round(state.cost_usd, 9)}
    if stop.detail:
        fields["detail"] = stop.detail
    trace("run_stopped", **fields)
    await _save(state, options)
    return Outcome(state, "stopped", answer)
