"""What a server-side run answers: one chat.completion, honest about how the run ended.

A completed run answers with the model's final message. Every other exit answers with an
assistant message stating the exit in one sentence (never a made-up answer); a run that
hands calls to the client's own tools answers with those `tool_calls`. The body carries
the `run` object; headers carry the run's figures.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.harness.state import Message, RunState, pending
from gateway.harness.usage import Usage


def exit_sentence(state: RunState) -> str:
    """The run's exit in one sentence (two when a person said why), for the person reading the chat."""
    sentence = _exit(state)
    i = state.interruption
    if state.status != "interrupted" and i is not None and i.reason and i.type in (
            "max_turns", "max_budget", "max_tool_calls", "max_duration"):  # a person declined to raise it
        return f"{sentence} {i.reason}"
    return sentence


def _exit(state: RunState) -> str:
    limits, i = state.limits, state.interruption
    if state.status == "max_turns_exceeded":
        return f"The run stopped: it reached its cap of {limits.max_turns} turns."
    if state.status == "max_tool_calls_exceeded":
        return (f"The run stopped: it made {state.tool_calls} tool calls and reached its cap of "
                f"{limits.max_tool_calls}.")
    if state.status == "max_duration_exceeded":
        return (f"The run stopped: it reached its cap of {limits.max_duration_s or 0.0:g} seconds "
                "of wall-clock time.")
    if state.status == "budget_exceeded":
        if state.reason == "team_budget":
            return "The run stopped: its team's budget cannot pay for another turn."
        if state.reason in ("key_budget", "user_budget"):
            whose = "key's" if state.reason == "key_budget" else "user's"
            return f"The run stopped: its {whose} budget cannot pay for another turn."
        budget = limits.max_budget_usd or 0.0
        return f"The run stopped: it spent ${state.cost_usd:.6f} and reached its budget of ${budget:.2f}."
    if state.status == "interrupted" and i is not None:
        if i.type == "approval" and i.call_id in state.decisions:
            verdict = "approved" if state.decisions[i.call_id].decision == "approve" else "rejected"
            return (f"A person {verdict} {i.tool_name}({json.dumps(i.args)}); the run waits to be resumed "
                    f"(POST /v1/runs/{state.public_id}/resume, or its next chat call) to go on.")
        if i.type == "approval":
            return f"The run is waiting for a person to approve {i.tool_name}({json.dumps(i.args)})."
        if i.type == "limit":
            if i.call_id in state.decisions:
                return (f"A person granted the run more (its {i.limit}); the run waits to be resumed "
                        f"(POST /v1/runs/{state.public_id}/resume, or its next chat call) to go on.")
            return (f"The run is waiting for a person to grant more: it reached its {i.limit} "
                    f"({i.used or 0:g} of {i.cap or 0:g} used).")
        if i.type == "cancelled":
            return f"The run was interrupted: {i.reason or 'cancelled'}."
        if i.type == "max_turns":
            return f"The run stopped: it reached its cap of {limits.max_turns} turns."
        return f"The run stopped: it reached its budget of ${limits.max_budget_usd or 0.0:.2f}."
    if state.status == "failed":
        return f"The run failed: {state.error or state.reason or 'no reason was recorded'}."
    if state.status == "running":
        return "The run is still running."
    return "The run completed without an answer."


@dataclass(frozen=True)
class Answer:
    """The assistant message a call answers with, and why it ends there."""

    message: Message
    finish_reason: str

    @classmethod
    def of(cls, state: RunState, answer: str | None, client_calls: bool) -> Answer:
        """`client_calls`: the loop stopped to hand the pending calls to the client."""
        if client_calls:
            last = next((m for m in reversed(state.messages) if m.get("role") == "assistant"), None)
            return cls({"role": "assistant", "content": last.get("content") if last is not None else None, "tool_calls": pending(state)},
                       "tool_calls")
        if state.status == "completed":
            return cls({"role": "assistant", "content": answer or ""}, "stop")
        return cls({"role": "assistant", "content": exit_sentence(state)}, "stop")


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def completion_body(state: RunState, answer: Answer, usage: Usage, *, cid: str | None = None) -> dict[str, Any]:
    """A `chat.completion` with the run object; `usage` is what this call spent."""
    return {
        "id": cid or completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model,
        "choices": [{"index": 0, "message": answer.message, "finish_reason": answer.finish_reason,
                     "logprobs": None}],
        "usage": usage.to_json(),
        "run": state.summary(),
    }


def completion_chunks(state: RunState, answer: Answer, usage: Usage | None, *, cid: str) -> Iterator[dict[str, Any]]:
    """The same answer as `chat.completion.chunk`s: role, content, tool calls, finish (+ usage)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    yield chunk({"role": "assistant", "content": ""})
    content = answer.message.get("content")
    for piece in _pieces(content or ""):
        yield chunk({"content": piece})
    for index, call in enumerate(answer.message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, answer.finish_reason, run=state.summary())
    if usage is not None:
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model,
               "choices": [], "usage": usage.to_json()}


def _pieces(text: str, size: int = 48) -> Iterator[str]:
    """Cut a known answer into a few word-aligned pieces, as a model would stream it."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            space = text.rfind(" ", start + 1, end)
            end = space + 1 if space > start else end
        yield text[start:end]
        start = end
