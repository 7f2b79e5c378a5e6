"""The run's serialized form: versioned, round-trips exactly, old versions stay readable."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.harness.state import SCHEMA_VERSION, RunState, StateError, pending

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_every_schema_version_has_a_saved_fixture_that_loads() -> None:
    for version in range(1, SCHEMA_VERSION + 1):
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
