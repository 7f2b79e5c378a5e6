"""The access log: one structured line per request (docs/telemetry.md#access-log).

`AccessLog.write(fields)` formats one line, JSON (one object, keys in `FIELDS` order, null
for what a request did not have) or logfmt (`key=value`, quoted where needed, absent fields
left out), and writes it with one `write` call: to stderr (the workers of `--workers N`
share it; a line is one write, so lines never interleave), or to a file rotated past
`max_mb` (`access.log` -> `access.log.1` ...; with several workers, the one whose line
crossed the limit rotates, under a lock, and the others follow the new file within a
second).

It never holds a secret: the server hands it a key's id, never the key.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

import orjson

from gateway.config.telemetry import AccessLogConfig
from gateway.store.tracefile import rotate

log = logging.getLogger(__name__)

FIELDS: Final = ("time", "method", "route", "status", "duration_ms", "bytes", "team", "key_id", "run_id", "model",
                 "turns", "cost_usd", "trace_id", "error_code")
"""Every line's fields, in order (docs/telemetry.md)."""
REOPEN_CHECK_S: Final = 1.0
MB: Final = 1024 * 1024


def iso_time(ts: float) -> str:
    """UTC, ISO 8601 with milliseconds: 2026-12-05T10:11:12.345Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def _logfmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    text = str(value)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    return orjson.dumps(text).decode()  # quoted, escaped (control characters included)


def logfmt(fields: Mapping[str, Any]) -> bytes:
    return (" ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items() if v is not None) + "\n").encode()


def json_line(fields: Mapping[str, Any]) -> bytes:
    return orjson.dumps(fields) + b"\n"


class AccessLog:
    """Where the lines go, and in which format."""

    def __init__(self, config: AccessLogConfig) -> None:
        self.config = config
        self.excluded = config.exclude_routes
        self._format = logfmt if config.format == "logfmt" else json_line
        self._file: IO[bytes] | None = None
        self._checked = 0.0
        self._max_bytes = int(config.max_mb * MB)

    def write(self, fields: Mapping[str, Any]) -> None:
        line = self._format(fields)
        path = self.config.file
        try:
            if path is None:
                os.write(sys.stderr.fileno(), line)
                return
            fh = self._open(path)
            fh.write(line)
            fh.flush()
            if fh.tell() >= self._max_bytes:
                self._rotate(path)
        except OSError as exc:  # a full disk or a closed stderr must not fail the request
            log.warning("cannot write the access log: %s", exc)

    def _open(self, path: Path) -> IO[bytes]:
        fh = self._file
        now = time.monotonic()
        if fh is not None and now - self._checked >= REOPEN_CHECK_S:
            self._checked = now
            try:
                moved = os.stat(path).st_ino != os.fstat(fh.fileno()).st_ino  # another worker rotated it
            except FileNotFoundError:
                moved = True
            if moved:
                fh.close()
                fh = None
        if fh is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = self._file = path.open("ab", buffering=0)
            self._checked = now
        return fh

    def _rotate(self, path: Path) -> None:
        """access.log -> .1 -> ... (under a lock: the workers share the file); then a new file."""
        lock = path.with_name(path.name + ".lock")
        with lock.open("ab") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                if path.exists() and path.stat().st_size >= self._max_bytes:  # not rotated by another meanwhile
                    rotate(path, self.config.keep)
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)
        self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
