"""A store's address (a Redis URL, a PostgreSQL DSN) as it may be shown: without its password."""

from __future__ import annotations


def redact(dsn: str) -> str:
    """`dsn` with its password replaced by `***`, fit for errors and logs. Plain string work,
    so that a malformed address (the one an error is about) is redacted too."""
    head, at, tail = dsn.rpartition("@")
    if not at or ":" not in head.split("//", 1)[-1]:
        return dsn
    scheme, _, auth = head.partition("//")
    return f"{scheme}//{auth.split(':', 1)[0]}:***@{tail}"
