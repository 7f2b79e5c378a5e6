"""Budget periods: the ledger key a team's spending is summed under."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal, get_args

PeriodKind = Literal["day", "week", "month", "total"]
PERIOD_KINDS: tuple[PeriodKind, ...] = get_args(PeriodKind)


def period_key(kind: PeriodKind, now: datetime | None = None) -> str:
    """The ledger key of the period holding `now` (UTC): "2026-11-30", "2026-W48" (ISO week,
    from Monday), "2026-11" or "total".

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
    if kind == "week":
        year, week, _ = utc.isocalendar()
        return f"{year:04d}-W{week:02d}"
    return utc.strftime("%Y-%m-%d") if kind == "day" else utc.strftime("%Y-%m")


def period_end(key: str) -> datetime | None:
    """When the period of a ledger key ends (UTC): the next day, Monday or month; None for `total`
    (it never ends) and for a key that is not a period of `period_key`'s shape."""
    try:
        if len(key) == 10:
            return datetime.strptime(key, "%Y-%m-%d").replace(tzinfo=UTC) + timedelta(days=1)
        if len(key) == 8 and key[4:6] == "-W":
            return datetime.strptime(key + "-1", "%G-W%V-%u").replace(tzinfo=UTC) + timedelta(days=7)
        if len(key) == 7:
            start = datetime.strptime(key, "%Y-%m").replace(tzinfo=UTC)
            return start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    except ValueError:
        return None
    return None


def ended_before(key: str, when: float) -> bool:
    """Whether the period of `key` ended before `when` (epoch seconds)."""
    end = period_end(key)
    return end is not None and end.timestamp() < when
