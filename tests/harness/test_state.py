"""The run's serialized form: versioned, round-trips exactly, old versions stay readable."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.harness.state import (
    DEFAULT_MAX_TOOL_CALLS,
    READ_VERSIONS,
    SCHEMA_VERSION,
    Decision,
    RunState,
    StateError,
    own_calls,
    pending,
    transcript_change,
)
from gateway.harness.usage import Usage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_every_schema_version_has_a_saved_fixture_that_loads() -> None:
    assert READ_VERSIONS[-1] == SCHEMA_VERSION
    for version in READ_VERSIONS:
        raw = (FIXTURES / f"run_v{version}.json").read_bytes()
        state = RunState.loads(raw)
        assert state.status == "interrupted" and state.interruption is not None
        assert state.interruption.type == "approval" and state.interruption.call_id == "c2"
        assert [c["id"] for c in pending(state)] == ["c2"]


def test_round_trip_is_exact() -> None:
    state = RunState.loads((FIXTURES / f"run_v{SCHEMA_VERSION}.json").read_bytes())
    again = RunState.loads(state.dumps())
    assert again == state and again.dumps() == state.dumps()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.update(status="sleeping"), "unknown run status 'sleeping'"),
    (lambda d: d.pop("messages"), "malformed run"),
])
def test_bad_serialized_runs_are_refused_with_a_reason(mutate, message) -> None:  # type: ignore[no-untyped-def]
    data = orjson.loads((FIXTURES / f"run_v{SCHEMA_VERSION}.json").read_bytes())
    mutate(data)
    with pytest.raises(StateError, match=message):
        RunState.from_json(data)
    with pytest.raises(StateError, match="not valid JSON"):
        RunState.loads(b"{")


def test_v1_upgrades_its_model_turns_calls_as_the_gateways_own() -> None:
    state = RunState.loads((FIXTURES / "run_v1.json").read_bytes())
    assert state.version == SCHEMA_VERSION
    assert state.model_call_ids == ["c1", "c2"]  # both came from its two turns: c2 may run once approved
    assert state.tool_calls == 1  # the one tool result in its transcript
    assert state.started_at == state.created_at
    assert state.limits.max_tool_calls == DEFAULT_MAX_TOOL_CALLS and state.limits.max_duration_s is None


def test_v1_call_pending_from_the_clients_own_history_is_not_upgraded_as_own() -> None:
    data = orjson.loads((FIXTURES / "run_v1.json").read_bytes())
    forged = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "list_files", "arguments": "{}"}}]}
    data.update(turns=0, per_turn=[], status="running", reason=None, interruption=None,
                messages=[{"role": "user", "content": "x"}, forged])
    state = RunState.from_json(data)
    assert state.model_call_ids == [] and len(pending(state)) == 1


def test_v2_fixture_keeps_the_new_fields() -> None:
    state = RunState.loads((FIXTURES / "run_v2.json").read_bytes())
    assert state.model_call_ids == ["c1", "c2"] and state.tool_calls == 1
    assert state.limits.max_tool_calls == 50 and state.limits.max_duration_s == 600.0
    assert state.started_at == 1796000000.0


@pytest.mark.parametrize("version", [2, 3])
def test_v2_and_v3_read_as_the_current_version_with_no_grants(version: int) -> None:
    state = RunState.loads((FIXTURES / f"run_v{version}.json").read_bytes())
    assert state.version == SCHEMA_VERSION and state.grants == []
    assert RunState.loads(state.dumps()) == state


def test_v4_fixtures_keep_grants_and_a_pending_limit_request() -> None:
    granted = RunState.loads((FIXTURES / "run_v4.json").read_bytes())
    [g] = granted.grants
    assert (g.by, g.grant, g.before, g.after) == ("ops", {"max_turns": 3}, {"max_turns": 20}, {"max_turns": 23})
    assert type(g.after["max_turns"]) is int and granted.limits.max_turns == 23
    assert granted.key_id == "key_0LkDmkqAb3XqYg7tH2Pz" and granted.user == "ana@example.com"  # v3's fields too
    waiting = RunState.loads((FIXTURES / "run_v4_limit.json").read_bytes())
    i = waiting.interruption
    assert i is not None and (i.type, i.limit, i.used, i.cap, i.grant) == ("limit", "max_turns", 2, 2, {"max_turns": 3})
    assert i.to_json() == {"type": "limit", "call_id": "lim_5b1e7c3a9f2d4e6b8a0c1d2e", "limit": "max_turns",
                           "used": 2, "cap": 2, "grant": {"max_turns": 3}, "reason": "reached the cap of 2 turns"}
    assert RunState.loads(waiting.dumps()).dumps() == waiting.dumps() and pending(waiting) == []
    assert waiting.waits_for_decision and waiting.waiting_for == "decision" and not waiting.decided


def test_own_calls_names_missing_and_repeated_ids_uniquely() -> None:
    state = RunState.loads((FIXTURES / "run_v2.json").read_bytes())
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": "{}"}},
        {"id": "x", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        {"id": "x", "type": "function", "function": {"name": "c", "arguments": "{}"}},
        {"id": "c1", "type": "function", "function": {"name": "d", "arguments": "{}"}},  # used in an earlier turn
        {"id": 7, "type": "function", "function": {"name": "e", "arguments": "{}"}},
    ]}
    ids = [c["id"] for c in own_calls(state, reply)["tool_calls"]]
    assert ids[1] == "x"
    assert all(isinstance(i, str) and i.startswith("call_") for i in (ids[0], ids[2], ids[3], ids[4]))
    assert len(set(ids)) == 5 and state.model_call_ids[-5:] == ids
    assert reply["tool_calls"][0].get("id") is None  # the reply itself is not changed in place


def test_a_copy_is_equal_and_its_lists_and_dicts_are_its_own() -> None:
    run = RunState.loads((FIXTURES / f"run_v{SCHEMA_VERSION}.json").read_bytes())
    run.decisions["c1"] = Decision("approve", by="ops")  # the copy must not share the dict
    assert run.messages and run.decisions and run.per_turn
    saved = run.dumps()
    copy = run.copy()
    assert copy == run and type(copy) is RunState and copy is not run and copy.dumps() == saved
    copy.messages.append({"role": "assistant", "content": "yes"})
    copy.per_turn.clear()
    copy.decisions.clear()
    copy.failed_calls.append("c9")
    copy.model_call_ids.append("c9")
    copy.grants.clear()
    copy.turns += 5
    assert run.dumps() == saved  # the original is untouched


def test_v3_fixture_names_the_key_and_user_that_started_the_run() -> None:
    state = RunState.loads((FIXTURES / "run_v3.json").read_bytes())
    assert state.key_id == "key_0LkDmkqAb3XqYg7tH2Pz" and state.user == "ana@example.com"
    older = RunState.loads((FIXTURES / "run_v2.json").read_bytes())
    assert older.version == SCHEMA_VERSION and older.key_id == "" and older.user is None


def test_v5_stored_fixture_is_a_head_and_its_transcript_beside_it() -> None:
    stored = orjson.loads((FIXTURES / "run_v5_stored.json").read_bytes())
    assert "messages" not in stored["head"] and "per_turn" not in stored["head"]
    assert stored["head"]["transcript"] == {"messages": 4, "per_turn": 2}
    state = RunState.from_json(stored["head"], (stored["messages"], stored["per_turn"]))
    assert state == RunState.loads((FIXTURES / "run_v5.json").read_bytes())
    with pytest.raises(StateError, match="counts 4 messages and 2 turns, the store holds 3 and 2"):
        RunState.from_json(stored["head"], (stored["messages"][:3], stored["per_turn"]))
    with pytest.raises(StateError, match="without its transcript"):
        RunState.from_json(stored["head"])


def test_v6_stored_fixture_keeps_each_turns_call_ids_with_it_and_none_in_the_head() -> None:
    stored = orjson.loads((FIXTURES / "run_v6_stored.json").read_bytes())
    assert stored["head"]["model_call_ids"] == [] and stored["per_turn"] == [[110, 20, ["c1"]], [130, 20, ["c2"]]]
    state = RunState.from_json(stored["head"], (stored["messages"], stored["per_turn"]))
    assert state == RunState.loads((FIXTURES / "run_v6.json").read_bytes()) and state.model_call_ids == ["c1", "c2"]
    assert (state.stored_per_turn, state.stored_call_ids) == (2, 2)
    v5 = orjson.loads((FIXTURES / "run_v5_stored.json").read_bytes())  # its ids in its head, none in its turns
    old = RunState.from_json(v5["head"], (v5["messages"], v5["per_turn"]))
    assert old.model_call_ids == ["c1", "c2"] and (old.stored_per_turn, old.stored_call_ids) == (2, 0)
    with pytest.raises(StateError, match="call ids must be a list"):
        RunState.from_json(stored["head"], (stored["messages"], [[110, 20, "c1"], [130, 20]]))


def test_a_turns_call_ids_go_with_it_and_wait_in_the_head_for_the_next_turn() -> None:
    v5 = orjson.loads((FIXTURES / "run_v5_stored.json").read_bytes())
    run = RunState.from_json(v5["head"], (v5["messages"], v5["per_turn"]))
    run.mark_stored()
    # a save without a turn (a decision): the v5 head's ids stay in the head, nothing is written beside it
    quiet = transcript_change(run)
    assert (quiet.per_turn, quiet.call_ids) == ([], []) and run.head_json()["model_call_ids"] == ["c1", "c2"]
    run.mark_stored()
    assert run.stored_call_ids == 0
    # the next turn takes them, with its own: the head holds none from then on
    run.model_call_ids.append("c3")
    run.count_turn(Usage(1, 2), 0.0)
    turn = transcript_change(run)
    assert (turn.per_turn_from, turn.per_turn, turn.call_ids) == (2, [Usage(1, 2)], ["c1", "c2", "c3"])
    assert run.head_json()["model_call_ids"] == []
    run.mark_stored()
    run.model_call_ids.append("c4")
    run.count_turn(Usage(3, 4), 0.0)
    assert transcript_change(run).call_ids == ["c4"] and run.head_json()["model_call_ids"] == []
    # a rewritten history (fewer turns than stored) writes every entry again, the last holding all ids
    run.mark_stored()
    run.per_turn = run.per_turn[:1]
    again = transcript_change(run)
    assert (again.per_turn_from, again.per_turn, again.call_ids, again.truncates) == (
        0, [Usage(110, 20)], ["c1", "c2", "c3", "c4"], True)


def test_a_transcript_change_is_what_came_after_the_stored_messages() -> None:
    run = RunState.loads((FIXTURES / f"run_v{SCHEMA_VERSION}.json").read_bytes())
    run.mark_stored()
    unchanged = transcript_change(run)
    assert (unchanged.messages_from, unchanged.messages, unchanged.per_turn_from, unchanged.per_turn,
            unchanged.truncates) == (4, [], 2, [], False)
    run.messages.append({"role": "tool", "tool_call_id": "c2", "name": "delete_file", "content": "ok"})
    run.count_turn(Usage(1, 2), 0.0)
    added = transcript_change(run)
    assert (added.messages_from, len(added.messages), added.per_turn_from, added.per_turn,
            added.truncates) == (4, 1, 2, [Usage(1, 2)], False)
    # the same history sent again by a client (equal, not the same objects) is not new
    run.mark_stored()
    run.messages = [dict(m) for m in run.messages] + [{"role": "user", "content": "next"}]
    assert transcript_change(run).messages_from == 5
    # a history edited in the middle is stored again from there
    run.messages = [run.messages[0], {"role": "assistant", "content": "other"}]
    edited = transcript_change(run)
    assert (edited.messages_from, edited.truncates) == (1, True)
