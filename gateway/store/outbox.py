"""The outbox: messages for the world outside (webhooks) kept in the store until delivered.

A `Notice` is written in the same store step as the trace lines that caused it (each store's
`notice_rule` turns appended lines into notices), so a process killed right after an event
still has its message; a delivery task claims due notices with a lease (`claim_notices`),
so two replicas do not send the same one twice while both are alive, and books the outcome
(`notice_sent`, `notice_failed`). The store never reads a notice's `body`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

NOTICE_ID_MAX: Final = 512


@dataclass(frozen=True)
class Notice:
    """One message to deliver. `id` is unique: enqueueing an id the outbox has (or had,
    until retention forgets it) adds nothing. `period` (a budget period key) keeps the
    delivered notice, and so its id, until that period ended (`periods.period_end`)."""

    id: str
    body: bytes
    period: str | None = None


@dataclass(frozen=True)
class Claimed:
    """A notice this process holds for delivery until its lease ends; `attempts` were made before."""

    id: str
    body: bytes
    attempts: int


NoticeRule = Callable[[str, Sequence[Mapping[str, Any]]], Sequence[Notice]]
"""(stored run id, trace lines being appended) -> the notices to write with them. Runs
inside the store's write (pure and quick: no I/O)."""


def notices_of(rule: NoticeRule | None, run_id: str, events: list[Any]) -> Sequence[Notice]:
    """The notices `rule` makes of a run's trace lines, checked (`check_notices`); none without a rule."""
    notices = rule(run_id, events) if rule is not None and events else ()
    check_notices(notices)
    return notices


def check_notices(notices: Sequence[Notice]) -> None:
    """Refuse ids a store could not key by (empty, too long)."""
    for n in notices:
        if not n.id or len(n.id) > NOTICE_ID_MAX:
            raise ValueError(f"notice id must be 1-{NOTICE_ID_MAX} characters, got {len(n.id)}")
