"""The `recovery` field of a policy: interrupt (default) or resume; anything else named."""

from __future__ import annotations

import pytest

from gateway.policy.errors import PolicyError
from gateway.policy.schema import parse_policy


def test_recovery_defaults_to_interrupt_and_accepts_resume() -> None:
    assert parse_policy(b"name: p\n", "p.yaml").recovery == "interrupt"
    assert parse_policy(b"name: p\nrecovery: resume\n", "p.yaml").recovery == "resume"


def test_an_unknown_recovery_is_named() -> None:
    with pytest.raises(PolicyError, match=r"recovery.*interrupt, resume"):
        parse_policy(b"name: p\nrecovery: retry\n", "p.yaml")
