"""The scripted model's behaviours: a reply as a function of the turn and the tool results.

The provider is stateless: the turn index is the number of assistant messages in the
request, and a scenario sees the tool results so far (all of them joined, and the last
one), so a run can be killed, resumed, approved or rejected against it and the script
still knows where it is. Model `scripted-<name>` plays `SCENARIOS[<name>]`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Call:
    """One tool call the script asks for."""

    id: str
    name: str
    args: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": orjson.dumps(dict(self.args)).decode()},
        }


@dataclass(frozen=True)
class Reply:
    """What the script says this turn: prose, or tool calls (never both); or, to test the
    gateway against a bad upstream, a `raw` message sent exactly as given."""

    text: str | None = None
    calls: tuple[Call, ...] = ()
    raw: Mapping[str, Any] | None = None

    def message(self) -> dict[str, Any]:
        """The assistant message as chat completions returns it."""
        if self.raw is not None:
            return dict(self.raw)
        if self.calls:
            return {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in self.calls]}
        return {"role": "assistant", "content": self.text or ""}


@dataclass(frozen=True)
class View:
    """What a script may read of the conversation."""

    turn: int
    tool_text: str
    last_tool: str | None


Scenario = Callable[[View], Reply]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def view_of(messages: Sequence[Mapping[str, Any]]) -> View:
    """The turn index and tool results of a request's transcript."""
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    results = [_content_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    return View(turn, "\n".join(results), results[-1] if results else None)


def ask(call_id: str, name: str, **args: Any) -> Reply:
    return Reply(calls=(Call(call_id, name, args),))


def say(text: str) -> Reply:
    return Reply(text=text)


PLAN_ANSWER = "errors.log mentions a timeout: worker 7 timed out after 30000 ms."
REFUSED = re.compile(r"declin|reject|denied|not approved|nothing was done|not deleted", re.IGNORECASE)


def plan(v: View) -> Reply:
    """A well-behaved task: list, read, answer."""
    if v.turn == 0:
        return ask("c1", "list_files")
    if v.turn == 1:
        return ask("c2", "read_file", path="errors.log")
    return say(PLAN_ANSWER)


def runaway(v: View) -> Reply:
    """Never declares itself done."""
    return ask(f"c{v.turn + 1}", "list_files")


def recover(v: View) -> Reply:
    """Guesses a file name, then corrects itself only if the error said how."""
    if v.turn == 0:
        return ask("c1", "read_file", path="timeout.log")
    if "Call list_files" not in v.tool_text:
        return say("I could not read the file, so I do not know.")
    if v.turn == 1:
        return ask("c2", "list_files")
    if v.turn == 2:
        return ask("c3", "read_file", path="errors.log")
    return say("errors.log mentions a timeout.")


def destructive(v: View) -> Reply:
    """Lists, then deletes a file nobody asked about, then reports what its tool result says."""
    if v.turn == 0:
        return ask("c1", "list_files")
    if v.turn == 1:
        return ask("c2", "delete_file", path="access.log")
    result = (v.last_tool or "").strip()
    if REFUSED.search(result):
        return say("I did not delete anything: you declined the deletion.")
    if not result or "deleted" in result.lower():
        # An empty result reads as success: a rejection without words is taken for a done job.
        return say("Deleted access.log to free space.")
    return say(f"I could not delete access.log: {result}")


NOTES_ANSWER = "notes.txt says to rotate the logs."


def repeat(v: View) -> Reply:
    """Asks for the same read twice in a row."""
    if v.turn < 2:
        return ask(f"c{v.turn + 1}", "read_file", path="notes.txt")
    return say(NOTES_ANSWER)


def once(v: View) -> Reply:
    """The `repeat` task without the repetition (its baseline)."""
    if v.turn == 0:
        return ask("c1", "read_file", path="notes.txt")
    return say(NOTES_ANSWER)


def repeat_write(v: View) -> Reply:
    """Asks for the same delete twice in a row (two calls, two ids)."""
    if v.turn < 2:
        return ask(f"c{v.turn + 1}", "delete_file", path="access.log")
    return say("Deleted access.log.")


def forbidden(v: View) -> Reply:
    """Retries a read the process may not do, forever."""
    return ask(f"c{v.turn + 1}", "read_file", path="/etc/shadow")


def sidestep(v: View) -> Reply:
    """Deletes the runbook under another spelling of its path (`./notes.txt`)."""
    if v.turn == 0:
        return ask("c1", "delete_file", path="./notes.txt")
    result = (v.last_tool or "").strip()
    if REFUSED.search(result):
        return say("I did not delete notes.txt: the policy denied it.")
    return say(f"Deleted notes.txt: {result}")


def slow(v: View) -> Reply:
    """Runs the slow, cancellable tool, then reports what it said."""
    if v.turn == 0:
        return ask("c1", "scan_archive")
    return say(f"The archive scan reported: {v.last_tool or 'nothing'}")


RESEARCH_QUESTION = "Which file mentions a timeout?"


def research(v: View) -> Reply:
    """Hands the question to a sub-agent, then passes its summary on."""
    if v.turn == 0:
        return ask("c1", "research", question=RESEARCH_QUESTION)
    return say("Research found: " + (v.last_tool or ""))


def _untagged(name: str, **args: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}


def noids(v: View) -> Reply:
    """The `plan` task from a model that gives its calls no ids, then one id twice."""
    if v.turn == 0:
        return Reply(raw={"role": "assistant", "content": None, "tool_calls": [_untagged("list_files")]})
    if v.turn == 1:
        calls = [{"id": "dup", **_untagged("read_file", path="errors.log")},
                 {"id": "dup", **_untagged("read_file", path="notes.txt")}]
        return Reply(raw={"role": "assistant", "content": None, "tool_calls": calls})
    return say(PLAN_ANSWER)


def malformed(v: View) -> Reply:
    """A reply whose tool_calls is a string, as a broken upstream sends it."""
    return Reply(raw={"role": "assistant", "content": None, "tool_calls": "abc"})


SCENARIOS: Mapping[str, Scenario] = {
    "plan": plan,
    "runaway": runaway,
    "recover": recover,
    "destructive": destructive,
    "repeat": repeat,
    "once": once,
    "repeat-write": repeat_write,
    "forbidden": forbidden,
    "sidestep": sidestep,
    "slow": slow,
    "research": research,
    "noids": noids,
    "malformed": malformed,
}
MODEL_PREFIX = "scripted-"


def scenario_for(model: str) -> Scenario | None:
    """The script a model name plays, or None if the name is not `scripted-<known>`."""
    if not model.startswith(MODEL_PREFIX):
        return None
    return SCENARIOS.get(model[len(MODEL_PREFIX):])


def model_names() -> list[str]:
    return [MODEL_PREFIX + name for name in SCENARIOS]
