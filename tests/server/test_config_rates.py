"""`rate_limits:` in config.yaml: the forms it takes, and errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config.rates import RateLimits, key_scope
from gateway.config.settings import ConfigError, load_config
from gateway.server.http.auth import KeyRing
from tests.server.conftest import config_data, write_config


def load(tmp_path: Path, **team: Any) -> Any:
    data = config_data()
    data["teams"][0].update(team)
    return load_config(write_config(tmp_path, data))


def test_per_minute_and_per_second_forms(tmp_path: Path) -> None:
    config = load(tmp_path, rate_limits={"requests_per_minute": 60, "tokens_per_minute": 10_000, "max_in_flight": 4})
    assert config.teams[0].rate_limits == RateLimits(60.0, 60, 10_000, 4)
    config = load(tmp_path, rate_limits={"tokens_per_second": 500})
    assert config.teams[0].rate_limits == RateLimits(1.0, None, 500, None)
    assert load(tmp_path, rate_limits=None).teams[0].rate_limits is None
    assert config_data()["teams"][1].get("rate_limits") is None


def test_a_key_with_its_own_limits_authenticates_as_its_team_carrying_them(tmp_path: Path) -> None:
    config = load(tmp_path, keys=["sk-test", {"key": "sk-batch", "rate_limits": {"requests_per_minute": 5}}])
    team = config.teams[0]
    assert team.keys == ("sk-test", "sk-batch")
    ring = KeyRing(config.teams)
    plain, batch = ring.team("sk-test"), ring.team("sk-batch")
    assert plain is not None and plain.caller is not None and plain.caller.limits is None  # the team's limits only
    assert batch is not None and batch.name == team.name and batch.caller is not None
    assert batch.caller.limits == RateLimits(60.0, 5) and batch.caller.scope == key_scope("sk-batch")
    assert "sk-batch" not in batch.caller.scope  # the store never sees the key


ERRORS = [
    ({"rate_limits": {"requests_per_minute": 0}}, "teams[0].rate_limits.requests_per_minute", ">= 1"),
    ({"rate_limits": {"requests_per_minute": "lots"}}, "teams[0].rate_limits.requests_per_minute", "integer"),
    ({"rate_limits": {"tokens_per_minute": 10**10}}, "teams[0].rate_limits.tokens_per_minute", "<= 1000000000"),
    ({"rate_limits": {"requests_per_minute": 5, "tokens_per_second": 5}}, "teams[0].rate_limits.tokens_per_second",
     "mixes windows"),
    ({"rate_limits": {"rpm": 5}}, "teams[0].rate_limits.rpm", "unknown field"),
    ({"rate_limits": {"max_in_flight": 0}}, "teams[0].rate_limits.max_in_flight", ">= 1"),
    ({"rate_limits": [60]}, "teams[0].rate_limits", "must be a mapping"),
    ({"keys": [{"rate_limits": {"max_in_flight": 1}}]}, "teams[0].keys[0]", "exactly one of key"),
    ({"keys": [{"key": "sk-x", "limits": {}}]}, "teams[0].keys[0].limits", "unknown field"),
    ({"keys": [{"key_env": "GATEWAY_TEST_UNSET_VAR"}]}, "teams[0].keys[0].key_env", "is not set"),
]


@pytest.mark.parametrize(("team", "field", "problem"), ERRORS)
def test_errors_name_the_field(tmp_path: Path, team: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, **team)
    assert (info.value.path, problem in info.value.problem) == (field, True), info.value
