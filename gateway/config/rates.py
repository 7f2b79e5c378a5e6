"""`rate_limits:` of a team or of one of its keys (docs/config.md, docs/limits.md).

    rate_limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_in_flight: 20}

or the per-second forms (`requests_per_second`, `tokens_per_second`: a window of one second,
for short windows in tests and for upstream quotas stated per second). One block uses one
window: per-minute and per-second forms do not mix. A key names its own limits as
`keys: [{key: "sk-...", rate_limits: {...}}]` (or `key_env:` instead of `key:`); its calls
are held to the key's limits and the team's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gateway.config.fields import Field

MAX_RATE = 1_000_000_000
"""The largest requests or tokens per window a config may name."""
MAX_IN_FLIGHT = 1_000_000
WINDOWS = {"minute": 60.0, "second": 1.0}


@dataclass(frozen=True)
class RateLimits:
    """A team's or a key's limits: `requests` and `tokens` per `window_s` (None: no limit),
    and `max_in_flight` calls at once."""

    window_s: float = 60.0
    requests: int | None = None
    tokens: int | None = None
    max_in_flight: int | None = None


def key_scope(key: str) -> str:
    """The store's name for a key's limits: a digest, never the key."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:24]


def parse_rate_limits(at: Field) -> RateLimits | None:
    """A `rate_limits:` block (None when absent or null); refuses mixed windows by name."""
    if at.missing or at.value is None:
        return None
    at.keys_only({f"{kind}_per_{unit}" for kind in ("requests", "tokens") for unit in WINDOWS} | {"max_in_flight"})
    window: str | None = None
    counts: dict[str, int | None] = {"requests": None, "tokens": None}
    for unit in WINDOWS:
        for kind in counts:
            field = at.get(f"{kind}_per_{unit}")
            if field.missing or field.value is None:
                continue
            if window is not None and window != unit:
                field.invalid(f"mixes windows: this block already names a limit per {window}; use one window per "
                              f"block (all per_minute or all per_second)")
            window = unit
            counts[kind] = field.optional_int(0, low=1, high=MAX_RATE)
    in_flight_at = at.get("max_in_flight")
    in_flight = None if in_flight_at.missing or in_flight_at.value is None else in_flight_at.optional_int(
        0, low=1, high=MAX_IN_FLIGHT)
    if window is None and in_flight is None:
        return None
    return RateLimits(WINDOWS[window or "minute"], counts["requests"], counts["tokens"], in_flight)
