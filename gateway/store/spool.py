"""A local, durable spool of bookings the store could not take, with space set aside for it.

A turn paid upstream must be booked even when the store fails at that moment: its record
is appended here (one JSON line, fsynced before the caller goes on) and booked when the
store answers again. `pending()` reads the records in order; `drop(ids)` removes them.
Every access holds an exclusive `flock`, so processes sharing one spool (replicas started
from one config folder) never lose or repeat a line. Replaying a record books it with
`Booking(if_held=True)`, so a record replayed twice (a crash between the booking and the
drop) books once.

The store failing is often the disk being full, and the spool is on a disk too. So the
spool keeps `reserve_bytes` allocated past its end (`fallocate` with KEEP_SIZE: the file
does not grow, the blocks are its own), and appends land in that space whatever else
filled the disk. After each append the reserve is topped up again; when that fails, the
reserve is not intact (`intact`, and the `condition` says why): the gateway refuses new
calls until it is, so that the calls in flight when the disk filled are all the spool
must hold. Should an append fail all the same (a reserve smaller than they need, a file
system without `fallocate`), the record is kept in this process's memory, retried with
the rest, and the spool is not intact until it is written or booked.

Dropping everything truncates the file and allocates the reserve again; dropping some
records writes the rest to a new file, with its reserve allocated first, renamed over the
old one (when that cannot be done, nothing is dropped: the records are booked already,
and a replay of them writes nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import orjson

from gateway.store.base import Attribution, Booking, TokenCharge
from gateway.store.errors import StoreError
from gateway.store.health import Condition

log = logging.getLogger(__name__)

DEFAULT_RESERVE_BYTES: Final = 64 * 1024 * 1024
FALLOC_FL_KEEP_SIZE: Final = 1


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """Linux's fallocate(2) (glibc or musl), or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        func = libc.fallocate
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    func.restype = ctypes.c_int
    return func


_FALLOCATE = _fallocate()


def _append(fd: int, data: bytes) -> None:
    """All of `data` at the end of `fd`, fsynced; on a failure the file is cut back to its
    size before, so that no torn line runs into the next record."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":  # torn by a crash mid-write: end that line first
        data = b"\n" + data
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass  # a torn last line is skipped when read, and the next append ends it first
        raise


def booking_json(booking: Booking) -> dict[str, Any]:
    """A booking as a spool record holds it (replayed with `if_held`: it books once)."""
    return {"team": booking.team, "period": booking.period, "actual_usd": booking.actual_usd,
            "reservation_id": booking.reservation_id,
            "tokens": [[c.scope, c.tokens, c.tokens_s] for c in booking.tokens],
            "attribution": None if booking.attribution is None else list(booking.attribution)}


def booking_from_json(data: Mapping[str, Any]) -> Booking:
    """`booking_json` read back, to be booked once (`if_held`)."""
    attribution = data.get("attribution")
    return Booking(str(data["team"]), str(data["period"]), float(data["actual_usd"]), data.get("reservation_id"),
                   if_held=True, tokens=tuple(TokenCharge(str(s), int(n), float(per))
                                              for s, n, per in data.get("tokens") or ()),
                   attribution=None if attribution is None else Attribution(*map(str, attribution)))


BOOKING_ONLY: Final = "booking"
"""A record's `only`: spend to book on the team's ledger alone (no turn of a run to save)."""


class Spool:
    """The spool file at `path` (made by `open()`), keeping `reserve_bytes` allocated past its end."""

    def __init__(self, path: Path, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.path = path
        self.reserve_bytes = reserve_bytes
        self._lock_path = path.with_name(path.name + ".lock")
        self._unwritten: dict[str, dict[str, Any]] = {}  # records no append could write (by id)
        self._reserved = reserve_bytes == 0  # whether the reserve was allocated at the last try
        self.reservable = True
        """False where the file system cannot allocate ahead (the reserve is then not kept)."""
        self.condition = Condition(f"spool {path}", log, *(() if on_change is None else (on_change,)))
        """Whether the reserve is intact and every record written."""

    @property
    def intact(self) -> bool:
        """The reserve is allocated and no record waits in memory: the spool can take the
        records of the calls in flight."""
        return self._reserved and not self._unwritten

    def open(self) -> None:
        """Make the folder, the lock file and the spool file, and allocate the reserve (a
        failure is the condition's: the spool is not intact until `keep_reserve` succeeds)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as exc:
            self._reserved = False
            self.condition.fail(f"cannot make the spool's files: {exc}")
            return
        self.keep_reserve()

    def keep_reserve(self) -> bool:
        """Allocate the reserve past the file's end, if it is not already; whether it is intact."""
        if self.reserve_bytes and self.reservable:
            try:
                with self._locked():
                    self._reserve()
            except StoreError as exc:
                self._reserved = False
                self.condition.fail(f"the spool's reserve of {self.reserve_bytes} bytes is not intact, new calls "
                                    f"are refused until it is: {exc}")
                return False
        self._reserved = True
        if self.intact:
            self.condition.recover()
        return self.intact

    def _reserve(self, fd: int | None = None) -> None:
        """fallocate(KEEP_SIZE) the reserve past the end of the spool (or of `fd`), lock held."""
        own = fd is None
        if own:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            except OSError as exc:
                raise StoreError(f"spool {self.path}: cannot open: {exc}") from exc
        assert fd is not None
        try:
            size = os.fstat(fd).st_size
            if _FALLOCATE is None:
                code, err = -1, errno.ENOSYS
            else:
                code = _FALLOCATE(fd, FALLOC_FL_KEEP_SIZE, size, self.reserve_bytes)
                err = ctypes.get_errno()
            if code != 0:
                if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self.reservable = False
                    log.warning("spool %s: this file system cannot allocate space ahead (%s): the spool keeps no "
                                "reserve, and a full disk can fail its appends", self.path, os.strerror(err))
                    return
                raise StoreError(f"spool {self.path}: cannot allocate its reserve: {os.strerror(err)}")
        finally:
            if own:
                os.close(fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"spool {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def append(self, record: Mapping[str, Any]) -> str:
        """Write one record durably (into the reserve), then top the reserve up; returns its
        id. When it cannot be written, it is kept in memory (retried with the rest, the
        spool not intact meanwhile) and StoreError says why."""
        rid = str(record.get("id") or uuid.uuid4().hex)
        data = {**record, "id": rid}
        try:
            self._write([data])
        except StoreError as exc:
            self._unwritten[rid] = data
            self.condition.fail(f"cannot write a record, kept in memory until it is booked: {exc}")
            raise
        self.keep_reserve()
        return rid

    def _write(self, records: list[dict[str, Any]]) -> None:
        line = b"".join(orjson.dumps(r) + b"\n" for r in records)
        with self._locked():
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    _append(fd, line)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise StoreError(f"spool {self.path}: cannot append: {exc}") from exc

    def write_unwritten(self) -> None:
        """Try again to write the records kept in memory (each stays there until it is)."""
        if not self._unwritten:
            return
        for rid, record in list(self._unwritten.items()):
            try:
                self._write([record])
            except StoreError:
                return
            del self._unwritten[rid]
        self.keep_reserve()

    def has_pending(self) -> bool:
        """Cheap: whether the file holds anything, or memory does (no lock, no read)."""
        if self._unwritten:
            return True
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def pending(self) -> list[dict[str, Any]]:
        """The records, oldest first, then those kept in memory (a torn last line, from a
        crash mid-write, is skipped)."""
        with self._locked():
            stored = self._read()
        seen = {str(r.get("id")) for r in stored}
        return stored + [r for rid, r in self._unwritten.items() if rid not in seen]

    def reservations(self) -> set[str]:
        """The reservation ids of the records waiting (held until they are booked)."""
        out: set[str] = set()
        for record in self.pending():
            booking = record.get("booking")
            if isinstance(booking, dict) and isinstance(booking.get("reservation_id"), str):
                out.add(booking["reservation_id"])
        return out

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
        for rid in ids:
            self._unwritten.pop(rid, None)
        with self._locked():
            kept = [r for r in self._read() if r.get("id") not in ids]
            if not kept:
                try:
                    os.truncate(self.path, 0)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise StoreError(f"spool {self.path}: cannot empty: {exc}") from exc
            else:
                self._rewrite(kept)
        self.keep_reserve()

    def _rewrite(self, kept: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                data = b"".join(orjson.dumps(r) + b"\n" for r in kept)
                if self.reserve_bytes and self.reservable and _FALLOCATE is not None:
                    if _FALLOCATE(fd, FALLOC_FL_KEEP_SIZE, 0, len(data) + self.reserve_bytes) != 0:
                        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"spool {self.path}: cannot rewrite: {exc}") from exc
