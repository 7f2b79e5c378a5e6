"""A local, durable spool of bookings the store could not take (it was unreachable).

A turn paid upstream must be booked even when the store fails at that moment: its record
is appended here (one JSON line, fsynced before the caller goes on) and booked when the
store answers again. `pending()` reads the records in order; `drop(ids)` rewrites the file
without them (a new file renamed over the old one). Every access holds an exclusive
`flock`, so processes sharing one spool (replicas started from one config folder) never
lose or repeat a line. Replaying a record books it with `Booking(if_held=True)`, so a record
replayed twice (a crash between the booking and the drop) books once.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from gateway.store.errors import StoreError


class Spool:
    """The spool file at `path` (created on first append)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"spool {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def append(self, record: Mapping[str, Any]) -> str:
        """Write one record durably; returns its id."""
        rid = str(record.get("id") or uuid.uuid4().hex)
        line = orjson.dumps({**record, "id": rid}) + b"\n"
        with self._locked():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, line)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise StoreError(f"spool {self.path}: cannot append: {exc}") from exc
        return rid

    def has_pending(self) -> bool:
        """Cheap: whether the file holds anything (no lock, no read)."""
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def pending(self) -> list[dict[str, Any]]:
        """The records, oldest first (a torn last line, from a crash mid-write, is skipped)."""
        with self._locked():
            return self._read()

    def _read(self) -> list[dict[str, Any]]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"spool {self.path}: cannot read: {exc}") from exc
        out = []
        for line in raw.splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def drop(self, ids: set[str]) -> None:
        """Remove the records with these ids (they are booked)."""
        if not ids:
            return
        with self._locked():
            kept = [r for r in self._read() if r.get("id") not in ids]
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with tmp.open("wb") as fh:
                    fh.write(b"".join(orjson.dumps(r) + b"\n" for r in kept))
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            except OSError as exc:
                raise StoreError(f"spool {self.path}: cannot rewrite: {exc}") from exc
