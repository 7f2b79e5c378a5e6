"""The optional trace file (`trace_file:`): every trace line appended, rotated by size.

With `retention.trace_file_max_mb`, a file that grew past the limit is renamed
`trace.jsonl.1` (the previous `.1` becomes `.2`, and so on) and a new one is started;
`retention.trace_file_keep` rotated files are kept, older ones deleted. Rotation happens
on the append that crossed the limit, so the file never outgrows it by more than one batch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from gateway.store.base import Event
from gateway.store.health import Condition

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rotation:
    max_bytes: int
    keep: int


_ROTATIONS: dict[Path, Rotation] = {}
_WRITES: dict[Path, Condition] = {}
"""Per trace file: whether appends succeed (a full disk fails each one: logged once)."""


def configure(path: Path, max_bytes: int | None, keep: int) -> None:
    """Rotate `path` past `max_bytes` keeping `keep` old files (None: never rotate)."""
    if max_bytes is None:
        _ROTATIONS.pop(path, None)
    else:
        _ROTATIONS[path] = Rotation(max_bytes, keep)


def rotated(path: Path, keep: int) -> list[Path]:
    """The rotated files of `path` that may exist, oldest first."""
    return [path.with_name(f"{path.name}.{i}") for i in range(keep, 0, -1)]


def append(path: Path | None, events: list[Event]) -> None:
    """Append the lines, rotating when due. A failure is logged once until appends work
    again (the store has the lines; the trace file misses them)."""
    if path is None or not events:
        return
    try:
        with path.open("ab") as fh:
            fh.write(b"".join(orjson.dumps(e) + b"\n" for e in events))
            size = fh.tell()
        rule = _ROTATIONS.get(path)
        if rule is not None and size >= rule.max_bytes:
            rotate(path, rule.keep)
    except OSError as exc:
        writes(path).fail(f"cannot append to the trace file: {exc}")
        return
    condition = _WRITES.get(path)
    if condition is not None:
        condition.recover()


def writes(path: Path) -> Condition:
    """Whether appends to `path` succeed (made on its first failure)."""
    condition = _WRITES.get(path)
    if condition is None:
        condition = _WRITES[path] = Condition(f"trace file {path}", log)
    return condition


def rotate(path: Path, keep: int) -> None:
    """trace.jsonl -> trace.jsonl.1 -> ... -> trace.jsonl.<keep>; the oldest is deleted."""
    names = [path, *reversed(rotated(path, keep))]  # path, .1, .2, ... .keep
    if keep == 0:
        path.unlink(missing_ok=True)
        return
    names[-1].unlink(missing_ok=True)
    for older, newer in zip(reversed(names[1:]), reversed(names[:-1]), strict=True):
        if newer.exists():
            os.replace(newer, older)
