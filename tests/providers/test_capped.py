"""The `max_tokens` cap of an upstream (`upstreams[].max_tokens`, 512 for kind local)."""

from __future__ import annotations

from gateway.providers.upstream import capped


def test_a_request_never_asks_for_more_than_the_cap() -> None:
    assert capped({"model": "m"}, 256) == {"model": "m", "max_tokens": 256}
    assert capped({"max_tokens": 4000}, 256)["max_tokens"] == 256
    assert capped({"max_tokens": 100}, 256)["max_tokens"] == 100  # a lower ask is kept
    assert capped({"max_tokens": None}, 256)["max_tokens"] == 256
    assert capped({"max_tokens": True}, 256)["max_tokens"] == 256
    both = capped({"max_completion_tokens": 9000}, 256)
    assert both == {"max_completion_tokens": 256, "max_tokens": 256}
    request = {"max_tokens": 4000}
    capped(request, 1)
    assert request == {"max_tokens": 4000}  # the caller's request is not changed
