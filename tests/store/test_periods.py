"""Budget period keys: UTC days and months, rolling over at midnight UTC."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from gateway.store.periods import period_end, period_key


def test_keys_name_the_day_the_month_or_total() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert period_key("day", now) == "2026-11-30"
    assert period_key("month", now) == "2026-11"
    assert period_key("total", now) == "total"


def test_keys_roll_over_at_midnight_utc() -> None:
    last = datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    first = last + timedelta(microseconds=1)
    assert (period_key("day", last), period_key("day", first)) == ("2026-12-31", "2027-01-01")
    assert (period_key("month", last), period_key("month", first)) == ("2026-12", "2027-01")
    assert period_key("total", last) == period_key("total", first)


def test_other_timezones_are_read_in_utc() -> None:
    new_york_evening = datetime(2026, 11, 30, 20, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert period_key("day", new_york_evening) == "2026-12-01"
    assert period_key("month", new_york_evening) == "2026-12"


def test_now_defaults_to_the_current_utc_date() -> None:
    before = datetime.now(UTC).strftime("%Y-%m-%d")
    key = period_key("day")
    after = datetime.now(UTC).strftime("%Y-%m-%d")
    assert key in {before, after}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        period_key("day", datetime(2026, 11, 30, 12, 0))
    with pytest.raises(ValueError, match="'year'"):
        period_key("year", datetime(2026, 11, 30, tzinfo=UTC))  # type: ignore[arg-type]


def test_a_week_is_an_iso_week_from_monday() -> None:
    assert period_key("week", datetime(2026, 11, 30, tzinfo=UTC)) == "2026-W49"
    assert period_key("week", datetime(2027, 1, 1, tzinfo=UTC)) == "2026-W53"  # ISO: the week of its Thursday
    end = period_end("2026-W49")
    assert end == datetime(2026, 12, 7, tzinfo=UTC)
