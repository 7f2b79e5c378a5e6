"""The x-ratelimit-* headers: a scope and two copies of it say the same (the tightest of equal
scopes is that scope), for any limits and clocks; a fresh scope has its whole window left.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.server.runs.rate_limits import pairs
from gateway.store.base import RateLimit, RateState

NOW = 1_800_000_000.0
counts = st.none() | st.integers(min_value=1, max_value=10**9)
leads = st.floats(min_value=-120.0, max_value=7200.0, allow_nan=False)  # the clock's lead on now, s


@settings(max_examples=300, deadline=None)
@given(window=st.sampled_from([1.0, 60.0]), requests=counts, tokens=counts, requests_lead=leads, tokens_lead=leads)
def test_one_scope_reads_like_the_general_path(window: float, requests: int | None, tokens: int | None,
                                               requests_lead: float, tokens_lead: float) -> None:
    limit = RateLimit("team:a", window, requests, tokens)
    state = RateState("team:a", NOW, NOW + requests_lead, NOW + tokens_lead)
    assert pairs([limit], [state]) == pairs([limit, limit], [state, state])


def test_a_fresh_scope_has_its_whole_window_left() -> None:
    limit = RateLimit("team:a", 60.0, 600, 100_000)
    assert dict(pairs([limit], [RateState("team:a", NOW)])) == {
        "x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "600",
        "x-ratelimit-reset-requests": "0ms", "x-ratelimit-limit-tokens": "100000",
        "x-ratelimit-remaining-tokens": "100000", "x-ratelimit-reset-tokens": "0ms"}
