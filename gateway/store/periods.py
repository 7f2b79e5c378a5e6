"""Budget periods: the ledger key a team's spending is summed under."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal, get_args

PeriodKind = Literal["day", "month", "total"]
PERIOD_KINDS: tuple[PeriodKind, ...] = get_args(PeriodKind)


def period_key(kind: PeriodKind, now: datetime | None = None) -> str:
    """The ledger key of the period holding `now` (UTC): "2026-11-30", "2026-11" or "total".

    A naive `now` is refused rather than guessed: local time would move the day boundary.
    """
    if kind not in PERIOD_KINDS:
        raise ValueError(f"unknown budget period {kind!r}; expected one of {', '.join(PERIOD_KINDS)}")
    if kind == "total":
        return "total"
    if now is None:
        now = datetime.now(UTC)
    elif now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"period_key needs a timezone-aware datetime, got naive {now.isoformat()}")
    utc = now.astimezone(UTC)
    return utc.strftime("%Y-%m-%d") if kind == "day" else utc.strftime("%Y-%m")
